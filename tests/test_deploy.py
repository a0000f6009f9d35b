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
        assert spec["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317", name
    assert compose["telemetry"]["command"][4:7] == ["--port", "4317", "--http-port"]
    volumes = compose["otel-collector"]["volumes"]
    assert "./otel-collector.yaml:/etc/otelcol/config.yaml:ro" in volumes


def test_collector_fans_traces_out_to_telemetry_and_jaeger():
    cfg = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    pipeline = cfg["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"] and "grpc" in cfg["receivers"]["otlp"]["protocols"]
    endpoints = {cfg["exporters"][e]["endpoint"] for e in pipeline["exporters"]}
    assert endpoints == {"telemetry:4317", "jaeger:4317"}
    assert set(pipeline["processors"]) <= set(cfg["processors"])
