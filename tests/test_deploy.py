"""deploy/: the compose stack runs every service `cotserve serve` offers, each exporting its spans to
the collector, and the collector fans traces out to the telemetry service and to Jaeger."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.main import get_command

from cotserve.cli import app

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_compose_runs_every_service_and_each_exports_to_the_collector():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    served = {name: spec for name, spec in compose.items() if spec.get("command", [None])[0] == "serve"}
    assert {spec["command"][1] for spec in served.values()} == set(get_command(app).commands["serve"].commands)
    for name, spec in served.items():
        if name == "telemetry":
            assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in spec.get("environment", {})  # never exports to itself
            continue
        env = spec["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "https://otel-collector:4317", name  # over mutual TLS
        assert env["OTEL_EXPORTER_OTLP_INSECURE"] == "false"
        assert (env["OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"], env["OTEL_EXPORTER_OTLP_CLIENT_KEY"],
                env["OTEL_EXPORTER_OTLP_CERTIFICATE"]) == tuple(f"/etc/cotserve/tls/{f}" for f in ("tls.crt", "tls.key", "ca.crt"))
    assert compose["telemetry"]["command"][4:7] == ["--port", "4317", "--http-port"]
    volumes = compose["otel-collector"]["volumes"]
    assert "./otel-collector.yaml:/etc/otelcol/config.yaml:ro" in volumes and "tls-collector:/etc/otelcol/tls:ro" in volumes


def test_collector_fans_traces_out_to_telemetry_and_jaeger():
    cfg = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    pipeline = cfg["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"] and "grpc" in cfg["receivers"]["otlp"]["protocols"]
    endpoints = {cfg["exporters"][e]["endpoint"] for e in pipeline["exporters"]}
    assert endpoints == {"telemetry:4317", "jaeger:4317"}
    assert set(pipeline["processors"]) <= set(cfg["processors"])
    # mutual TLS in (the services' certificates of the stack's CA) and out to the telemetry service (its own)
    own = {"cert_file": "/etc/otelcol/tls/tls.crt", "key_file": "/etc/otelcol/tls/tls.key"}
    for protocol in cfg["receivers"]["otlp"]["protocols"].values():
        assert protocol["tls"] == {**own, "client_ca_file": "/etc/otelcol/tls/ca.crt"}
    assert cfg["exporters"]["otlp/cotserve-telemetry"]["tls"] == {**own, "ca_file": "/etc/otelcol/tls/ca.crt"}


def _dockerfile() -> list[tuple[str, str]]:
    """deploy/Dockerfile as (instruction, rest) pairs, continuation lines joined, a heredoc's lines part of its RUN."""
    steps: list[tuple[str, str]] = []
    heredoc = None
    for line in (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ").splitlines():
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            else:
                steps[-1] = (steps[-1][0], steps[-1][1] + "\n" + line)
            continue
        if not line.strip() or line.strip().startswith("#"):
            continue
        kind, _, rest = line.strip().partition(" ")
        steps.append((kind.upper(), rest))
        if "<<'" in rest:
            heredoc = rest.split("<<'", 1)[1].split("'", 1)[0]
    return steps


def test_the_image_installs_the_services_extras():
    """The requirements the image installs are pyproject's service extras: all but [gpu] on the CPU image
    (no triton, no NVIDIA libraries), everything on the CUDA one."""
    import subprocess
    import sys
    import tomllib

    script = next(rest for k, rest in _dockerfile() if k == "RUN" and "requirements.txt <<" in rest).split("\n", 1)[1]

    def requirements(variant: str) -> list[str]:
        out = subprocess.run([sys.executable, "-", variant], input=script, capture_output=True, text=True,
                             cwd=DEPLOY.parent, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.split("\n")

    cpu, cuda = requirements("cpu"), requirements("cuda")
    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for extra in ("worker", "gateway", "router", "slo", "sandbox", "telemetry", "serve"):
        for req in extras[extra]:
            assert req.startswith("cotserve[") or req in cpu, (extra, req)
    assert set(project["dependencies"]) <= set(cpu)
    assert not [r for r in cpu if r.startswith(("triton", "nvidia"))]
    assert [r for r in cuda if r.startswith("triton")] and set(cpu) < set(cuda)


def test_the_image_runs_as_a_user_and_builds_dependencies_before_the_code():
    steps = _dockerfile()
    kinds = [k for k, _ in steps]
    copies = [i for i, (k, rest) in enumerate(steps) if k == "COPY"]
    code = next(i for i in copies if steps[i][1].startswith("services"))
    assert any(steps[i][1].startswith("kernels") for i in copies), "the kernels (kernels/, cotserve.kernels) are copied"
    torch = next(i for i, (k, rest) in enumerate(steps) if k == "RUN" and "torch" in rest)
    deps = next(i for i, (k, rest) in enumerate(steps) if k == "RUN" and "requirements" in rest)
    assert torch < deps < code, "torch and the requirements are layers below the code"
    assert "download.pytorch.org/whl/cpu" in steps[torch][1] and 'cuda) pip install "torch' in steps[torch][1]
    user = kinds.index("USER")
    assert user > code and steps[user][1] == "cotserve" and any("useradd" in rest and "--uid 10001" in rest for k, rest in steps if k == "RUN")
    assert steps[kinds.index("ENTRYPOINT")][1] == '["cotserve"]'
    # every port a cotserve container publishes in the compose stack is one the image declares
    exposed = {int(p) for k, rest in steps if k == "EXPOSE" for p in rest.split()}
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    for name, spec in compose.items():
        if "build" in spec:
            for mapping in spec.get("ports", []):
                assert int(str(mapping).split(":")[-1]) in exposed, (name, mapping)
    # the state folders the stack mounts volumes on exist in the image, owned by its user (the certificates are
    # mounted read-only, on the certs service's copies)
    made = next(rest for k, rest in steps if k == "RUN" and "useradd" in rest)
    for name, spec in compose.items():
        for volume in spec.get("volumes", []) if "build" in spec else []:
            if volume.endswith(":ro"):
                continue
            inside = volume.split(":")[1]
            assert inside in made.split() and "chown -R cotserve:cotserve /var/lib/cotserve" in made, (name, inside)
    ignored = [ln.strip() for ln in (DEPLOY.parent / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    assert not {"services", "kernels", "pyproject.toml", "README.md", "LICENSE"} & set(ignored)
    assert {".git", "deploy/tls"} <= set(ignored)


def test_compose_puts_envoy_in_front_of_the_gateway_with_its_files():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    envoy = compose["envoy"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in envoy["volumes"]}
    cfg = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    assert envoy["command"][:2] == ["-c", "/etc/envoy/envoy.yaml"]
    for inside, outside in mounts.items():
        if inside != "/etc/envoy/tls":
            assert (DEPLOY / outside).is_file(), outside
    tls = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["transport_socket"]["typed_config"]
    for cert in tls["common_tls_context"]["tls_certificates"]:
        for key in ("certificate_chain", "private_key"):
            assert cert[key]["filename"].startswith("/etc/envoy/tls/")
    assert envoy["depends_on"]["gateway"]["condition"] == "service_healthy"
    assert "ports" not in compose["gateway"] and "--http-port" in compose["gateway"]["command"]  # only through Envoy


def test_envoy_runs_as_its_own_user_without_capabilities_on_copies_of_its_certificates_that_it_alone_reads():
    compose = _compose()
    envoy, certs = compose["services"]["envoy"], compose["services"]["certs"]
    assert envoy["user"] == "101:101" and envoy["cap_drop"] == ["ALL"]
    assert envoy["security_opt"] == ["no-new-privileges:true"] and "ENVOY_UID" not in envoy.get("environment", {})
    assert "envoy-tls:/etc/envoy/tls:ro" in envoy["volumes"] and "envoy-tls" in compose["volumes"]
    assert envoy["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    # the one-shot copy: host files in read-only, out to the volume owned by uid 101, the keys readable by it alone
    assert certs["image"] == envoy["image"] and certs["network_mode"] == "none" and certs["restart"] == "no"
    script = certs["entrypoint"][-1]
    assert "./tls:/from:ro" in certs["volumes"] and "envoy-tls:/to/envoy" in certs["volumes"]
    assert "chown -R 101:101 /to/envoy" in script and "chmod 0400 /to/*/*.key" in script


def test_every_service_serves_mutual_tls_with_its_own_identity_from_a_volume_of_its_own():
    """Each cotserve service mounts only its own copy of its identity's certificate (read-only, made by the certs
    service after it ran), serves its port with it and asks callers for theirs (the gateway: TLS for Envoy, and its
    identity to the services it calls); health checks ask the plaintext health-only port; the copy of each identity's
    files is owned by the user the service runs as, the key readable by it alone."""
    from tests.cli_parse import parse_cli

    from cotserve.common.authz import IDENTITIES

    compose = _compose()
    services, certs = compose["services"], compose["services"]["certs"]
    script = certs["entrypoint"][-1]
    loop = script.split("for id in ", 1)[1].split(";", 1)[0].split()
    assert loop == [i for i in IDENTITIES if i != "operator"]  # every identity but the operator's (a person's)
    for copy in ("cp /from/$$id.pem /to/$$id/tls.crt", "cp /from/$$id.key /to/$$id/tls.key",
                 "cp /from/cotserve-local-ca.pem /to/$$id/ca.crt", "chown -R 10001:10001 /to/$$id"):
        assert copy in script
    served = {name: spec for name, spec in services.items() if spec.get("command", [None])[0] == "serve"}
    tls = {f: f"/etc/cotserve/tls/{f}" for f in ("tls.crt", "tls.key", "ca.crt")}
    for name, spec in served.items():
        own = [v for v in spec["volumes"] if v.startswith("tls-")]
        assert own == [f"tls-{name}:/etc/cotserve/tls:ro"] and f"tls-{name}:/to/{name}" in certs["volumes"], name
        assert spec["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
        _, params = parse_cli(spec["command"])
        assert (str(params["tls_cert"]), str(params["tls_key"])) == (tls["tls.crt"], tls["tls.key"]), name
        assert params["health_port"] == 8081 and "health_status('127.0.0.1:8081')" in spec["healthcheck"]["test"][-1]
        if name == "gateway":
            assert params["tls_client_ca"] is None  # tenants authenticate with API keys
            assert tuple(str(params[f"upstream_tls_{k}"]) for k in ("ca", "cert", "key")) == (
                tls["ca.crt"], tls["tls.crt"], tls["tls.key"])
        else:
            assert str(params["tls_client_ca"]) == tls["ca.crt"], name


def test_envoy_calls_the_gateway_and_the_collector_over_tls_checking_their_names():
    cfg = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    for name, sni, client in (("cotserve_gateway_grpc", "gateway", False), ("cotserve_gateway_http", "gateway", False),
                              ("otel_collector", "collector", True)):
        context = clusters[name]["transport_socket"]["typed_config"]
        assert context["sni"] == sni
        validation = context["common_tls_context"]["validation_context"]
        assert validation["trusted_ca"]["filename"] == "/etc/envoy/tls/cotserve-local-ca.pem"
        assert validation["match_typed_subject_alt_names"] == [{"san_type": "DNS", "matcher": {"exact": sni}}]
        assert ("tls_certificates" in context["common_tls_context"]) == client, name


def test_compose_publishes_only_envoy_and_grafana_beyond_this_host():
    """The services talk on the compose network only: nothing of theirs is published; Envoy (the gateway, over TLS)
    and Grafana are published; the Prometheus and Jaeger viewers on loopback only; Grafana's admin password is a
    secret, not a default."""
    compose = _compose()
    published = {name: spec.get("ports", []) for name, spec in compose["services"].items()}
    wide = {name for name, ports in published.items() for p in ports if not str(p).startswith("127.0.0.1:")}
    assert wide == {"envoy", "grafana"}, published
    for name in ("gateway", "worker", "router", "sandbox", "slo", "telemetry", "redis", "otel-collector"):
        assert not published.get(name), (name, published.get(name))
    grafana = compose["services"]["grafana"]
    assert grafana["secrets"] == ["grafana_admin_password"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert compose["secrets"]["grafana_admin_password"]["file"] == "./grafana/admin-password"
    assert "admin-password" in (DEPLOY / "grafana" / ".gitignore").read_text().split()


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_file_follows_the_compose_specification():
    """Validated against the Compose Specification's own JSON schema (tests/data/compose-spec.json): an unknown
    or misspelt key anywhere fails, as a misspelt field would make `docker compose` refuse the file."""
    import json

    import jsonschema

    schema = json.loads((DEPLOY.parent / "tests" / "data" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    compose = _compose()
    assert [e.message for e in validator.iter_errors(compose)] == []
    typo = {**compose, "services": {**compose["services"], "redis": {**compose["services"]["redis"], "restrat": "always"}}}
    assert list(validator.iter_errors(typo))


def test_every_cotserve_command_in_compose_parses_with_the_real_command_line():
    """Each service's command parses into `cotserve serve <that service>`; its COTSERVE_* variables are its
    settings; it listens beyond loopback, exports metrics on 9090 and waits for what it needs to be healthy."""
    from tests.cli_parse import envvars, parse_cli

    compose = _compose()["services"]
    served = {name: spec for name, spec in compose.items() if spec.get("command", [None])[0] == "serve"}
    assert set(served) == {"gateway", "worker", "router", "slo", "sandbox", "telemetry"}
    for name, spec in served.items():
        cmd, params = parse_cli(spec["command"])
        assert spec["command"][1] == name and params["host"] == "0.0.0.0" and params["metrics_port"] == 9090, name
        for env in spec.get("environment", {}):
            if env.startswith("COTSERVE_"):
                assert env in envvars(cmd), (name, env)
        assert spec["restart"] == "unless-stopped" and "healthcheck" in spec, name
        if "COTSERVE_REDIS_URL" in spec.get("environment", {}):
            assert spec["depends_on"]["redis"]["condition"] == "service_healthy", name
    _, gateway = parse_cli(compose["gateway"]["command"])
    for address in (*gateway["workers"], gateway["sandbox_address"], gateway["slo_address"]):
        assert compose["gateway"]["depends_on"][address.split(":")[0]]["condition"] == "service_healthy", address


def test_prometheus_scrapes_every_service_and_grafana_is_provisioned_on_it():
    compose = _compose()["services"]
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    served = [name for name, spec in compose.items() if spec.get("command", [None])[0] == "serve"]
    assert targets == {f"{name}:9090" for name in served}
    mounts = {v.split(":")[1]: v.split(":")[0] for v in compose["prometheus"]["volumes"]}
    assert (DEPLOY / mounts["/etc/prometheus/prometheus.yml"]).resolve() == (DEPLOY / "prometheus" / "prometheus.yml")
    grafana = {v.split(":")[1]: DEPLOY / v.split(":")[0] for v in compose["grafana"]["volumes"]}
    source = yaml.safe_load((grafana["/etc/grafana/provisioning"] / "datasources" / "prometheus.yaml").read_text())
    (ds,) = source["datasources"]
    assert ds["url"] == "http://prometheus:9090" and ds["uid"] == "prometheus"
    provider = yaml.safe_load((grafana["/etc/grafana/provisioning"] / "dashboards" / "cotserve.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert (grafana["/var/lib/grafana/dashboards"] / "cotserve.json").is_file()


def _exported_metric_names() -> set[str]:
    """Every metric name the services define (quoted in their code), as Prometheus exposes it."""
    import re

    names = set()
    for path in (DEPLOY.parent / "services").rglob("*.py"):
        names |= set(re.findall(r'"((?:cotserve_|vllm:)[a-z_]+)"', path.read_text()))
    return names


def test_the_grafana_dashboard_reads_metrics_the_services_export():
    """Every query names metrics the services define (a histogram's _bucket/_count/_sum, a counter's _total);
    the heatmap panels read the telemetry service's latency histogram by model version and KV occupancy, in
    Grafana's heatmap format; every panel reads the provisioned data source."""
    import json
    import re

    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "cotserve.json").read_text())
    exported = _exported_metric_names()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert {p["type"] for p in panels} == {"heatmap", "timeseries"}
    for panel in panels:
        assert panel["datasource"]["uid"] == "prometheus"
        for target in panel["targets"]:
            for name in re.findall(r"\b((?:cotserve_|vllm:)[a-z_]+)", target["expr"]):
                base = re.sub(r"_(bucket|count|sum|total)$", "", name)
                assert base in exported, (panel["title"], name)
    heatmaps = [p for p in panels if p["type"] == "heatmap"]
    assert {t["format"] for p in heatmaps for t in p["targets"]} == {"heatmap"}
    for p in heatmaps:
        expr = p["targets"][0]["expr"]
        assert expr.startswith("sum by (le) (increase(cotserve_telemetry_request_latency_seconds_bucket{")
        assert 'model_version=~"$model_version"' in expr and 'kv_occupancy="$kv_occupancy"' in expr
        assert p["repeat"] == "kv_occupancy"
    server = (DEPLOY.parent / "services" / "telemetry" / "server.py").read_text()
    assert '["metric", "model_version", "sla_class", "kv_occupancy"]' in server  # the labels the queries filter on
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert variables == {"model_version", "sla_class", "kv_occupancy"}
    titles = " ".join(p["title"] for p in panels)
    for topic in ("TTFT", "by class", "KV-cache", "balancedness", "SLO violation", "Recommended"):
        assert topic in titles, topic
