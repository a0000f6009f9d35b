"""deploy/envoy/: every Envoy file parses into Envoy's own typed configuration (envoy-data-plane: the
data-plane-api protos as classes; an unknown or misspelt field, a bad enum or duration fails, inside
`typed_config` too), and does what the ingress promises: TLS with h2, the gateway API and the OpenAI API routed
to health-checked, least-request gateways, retries only before a response starts, stream timeouts, tracing to
the collector, access logs, per-route limits, and transcoding from the current buf-built descriptor set."""

from __future__ import annotations

import copy
import importlib
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from google.protobuf import descriptor_pb2

from tests.conftest import ROOT

ENVOY = ROOT / "deploy" / "envoy"
CONFIGS = sorted(ENVOY.glob("*.yaml"))


def _type_urls(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "@type":
                yield value
            else:
                yield from _type_urls(value)
    elif isinstance(node, list):
        for value in node:
            yield from _type_urls(value)


def parse_bootstrap(config: dict):
    """The config as Envoy's typed Bootstrap; every message a `typed_config` names is loaded first so that it is
    checked too (envoy-data-plane registers a type when its module is imported)."""
    from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap

    for url in set(_type_urls(config)):
        package = url.split("/", 1)[1].rsplit(".", 1)[0]
        importlib.import_module(f"envoy_data_plane.{package}")
    return Bootstrap.from_dict(config)


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_there_is_an_envoy_config():
    assert [p.name for p in CONFIGS] == ["envoy.yaml"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_field_is_envoys(path):
    bootstrap = parse_bootstrap(load(path))
    assert bootstrap.static_resources.listeners and bootstrap.static_resources.clusters


@pytest.mark.parametrize("mistake", [
    ("stat_prefix: gateway_grpc", "stat_prefx: gateway_grpc", "Unknown field 'stat_prefx'"),  # inside a per-route Any
    ("lb_policy: LEAST_REQUEST", "lb_policy: LEAST_REQUESTS", "LEAST_REQUESTS"),
    ("grpc_timeout_header_max: 600s", "grpc_timeout_header_max: 600q", "Invalid duration"),
    ("always_print_primitive_fields", "always_print_primitives", "Unknown field 'always_print_primitives'"),
])
def test_a_misspelt_field_is_caught(mistake):
    """The check is real: each of these one-word mistakes fails it."""
    good, bad, message = mistake
    text = (ENVOY / "envoy.yaml").read_text()
    assert good in text
    with pytest.raises((KeyError, ValueError, TypeError), match=message):
        parse_bootstrap(yaml.safe_load(text.replace(good, bad, 1)))


def _hcm(config: dict) -> dict:
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (hcm,) = chain["filters"]
    return hcm["typed_config"]


def _routes(config: dict) -> dict[str, dict]:
    (vhost,) = _hcm(config)["route_config"]["virtual_hosts"]
    return {r["name"]: r for r in vhost["routes"]}


def _clusters(config: dict) -> dict[str, dict]:
    return {c["name"]: c for c in config["static_resources"]["clusters"]}


def test_tls_termination_with_h2_and_http1():
    config = load(ENVOY / "envoy.yaml")
    (chain,) = config["static_resources"]["listeners"][0]["filter_chains"]
    tls = chain["transport_socket"]["typed_config"]
    assert tls["@type"].endswith("DownstreamTlsContext")
    assert tls["common_tls_context"]["alpn_protocols"] == ["h2", "http/1.1"]
    (cert,) = tls["common_tls_context"]["tls_certificates"]
    assert cert["certificate_chain"]["filename"] == "/etc/envoy/tls/server.pem"
    assert _hcm(config)["codec_type"] == "AUTO"


def test_routes_reach_health_checked_least_request_gateways():
    config = load(ENVOY / "envoy.yaml")
    routes, clusters = _routes(config), _clusters(config)
    assert routes["gateway-grpc"]["match"] == {"prefix": "/cotserve.gateway.v1.GatewayService/"}
    assert routes["openai-http"]["match"] == {"prefix": "/v1/"}
    assert routes["not-found"]["direct_response"]["status"] == 404
    grpc, http = clusters[routes["gateway-grpc"]["route"]["cluster"]], clusters[routes["openai-http"]["route"]["cluster"]]
    assert grpc["lb_policy"] == http["lb_policy"] == "LEAST_REQUEST"
    assert "http2_protocol_options" in grpc["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    assert grpc["health_checks"][0]["grpc_health_check"] == {}
    assert http["health_checks"][0]["http_health_check"]["path"] == "/health"
    endpoints = {c["name"]: c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
                 for c in clusters.values()}
    # the ports the compose stack's gateway serves (gRPC and the OpenAI API)
    assert endpoints[grpc["name"]] == {"address": "gateway", "port_value": 50051}
    assert endpoints[http["name"]] == {"address": "gateway", "port_value": 8000}


def test_retries_only_before_a_response_starts_and_stream_friendly_timeouts():
    routes = _routes(load(ENVOY / "envoy.yaml"))
    before_response = {"connect-failure", "refused-stream", "reset-before-request", "unavailable", "retriable-status-codes"}
    for name in ("gateway-grpc", "openai-http"):
        route = routes[name]["route"]
        retry_on = set(route["retry_policy"]["retry_on"].split(","))
        # no "reset" (a reset mid-stream would replay a request whose tokens the client already has)
        assert retry_on <= before_response, (name, retry_on - before_response)
        assert route["retry_policy"]["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
        assert route["idle_timeout"] == "120s"
    grpc = routes["gateway-grpc"]["route"]
    assert grpc["timeout"] == "0s" and grpc["max_stream_duration"] == {"grpc_timeout_header_max": "600s"}
    assert routes["openai-http"]["route"]["retry_policy"]["retriable_status_codes"] == [503]


def test_tracing_access_logs_and_per_route_limits():
    config = load(ENVOY / "envoy.yaml")
    hcm, clusters = _hcm(config), _clusters(config)
    provider = hcm["tracing"]["provider"]
    assert provider["name"] == "envoy.tracers.opentelemetry"
    collector = clusters[provider["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]]
    assert collector["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] == {
        "address": "otel-collector", "port_value": 4317}
    log_format = hcm["access_log"][0]["typed_config"]["log_format"]["json_format"]
    assert {"status", "grpc_status", "duration_ms", "upstream", "traceparent"} <= set(log_format)
    filters = [f["name"] for f in hcm["http_filters"]]
    assert filters[-1] == "envoy.filters.http.router"
    for name, route in _routes(config).items():
        if name == "not-found":
            continue
        per_route = route["typed_per_filter_config"]
        assert set(per_route) <= set(filters), name  # a per-route config for a filter that runs
        bucket = per_route["envoy.filters.http.local_ratelimit"]["token_bucket"]
        assert bucket["tokens_per_fill"] > 0 and bucket["fill_interval"] == "1s"


def test_transcoder_reads_the_current_buf_built_descriptor_set(tmp_path):
    config = load(ENVOY / "envoy.yaml")
    (transcoder,) = [f["typed_config"] for f in _hcm(config)["http_filters"]
                     if f["name"] == "envoy.filters.http.grpc_json_transcoder"]
    assert transcoder["proto_descriptor"] == "/etc/envoy/gateway.binpb"
    committed = ENVOY / "gateway.binpb"
    fresh = tmp_path / "gateway.binpb"
    buf = shutil.which("buf")
    assert buf, "buf not found: install the dev extra (buf-bin)"
    subprocess.run([buf, "build", "--path", "cotserve/gateway", "--as-file-descriptor-set", "--exclude-source-info",
                    "-o", str(fresh)], cwd=ROOT / "protos", check=True)
    assert committed.read_bytes() == fresh.read_bytes(), "run `make envoy-descriptor`"
    files = descriptor_pb2.FileDescriptorSet.FromString(committed.read_bytes()).file
    services = {f"{f.package}.{s.name}": [m.name for m in s.method] for f in files for s in f.service}
    assert transcoder["services"] == ["cotserve.gateway.v1.GatewayService"]
    assert set(services["cotserve.gateway.v1.GatewayService"]) >= {"Generate", "GenerateStream", "ListModels"}


def test_compose_runs_envoy_with_its_config_certificates_and_descriptor():
    compose = load(ROOT / "deploy" / "docker-compose.yml")["services"]
    envoy = compose["envoy"]
    assert envoy["image"].startswith("envoyproxy/envoy:v1.")
    assert envoy["command"][:2] == ["-c", "/etc/envoy/envoy.yaml"]
    assert {"./envoy/envoy.yaml:/etc/envoy/envoy.yaml:ro", "./envoy/gateway.binpb:/etc/envoy/gateway.binpb:ro",
            "envoy-tls:/etc/envoy/tls:ro"} <= set(envoy["volumes"])
    assert "8443:8443" in envoy["ports"]
    gateway = compose["gateway"]["command"]
    assert gateway[gateway.index("--http-port") + 1] == "8000" and gateway[gateway.index("--port") + 1] == "50051"
    assert envoy["depends_on"]["gateway"]["condition"] == "service_healthy"


def test_parse_rejects_a_type_envoy_does_not_have():
    config = copy.deepcopy(load(ENVOY / "envoy.yaml"))
    _hcm(config)["http_filters"][-1]["typed_config"]["@type"] = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Routr"
    with pytest.raises((TypeError, KeyError, ValueError)):
        parse_bootstrap(config)


def test_no_buffer_filter_stalls_a_streaming_call():
    """A buffer filter waits for a whole request body; a Session call's body (a stream of requests) never ends, so
    Envoy must not have one on the routes to the gateway."""
    cfg = load(ROOT / "deploy" / "envoy" / "envoy.yaml")
    for listener in cfg["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                names = [h["name"] for h in f.get("typed_config", {}).get("http_filters", [])]
                assert "envoy.filters.http.buffer" not in names, names
