"""The API's source of truth: buf lint passes and the committed generated code is current."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from cotserve.common import protogen
from tests.conftest import ROOT


def test_buf_lint_standard_rules_pass():
    buf = shutil.which("buf")
    assert buf, "buf not found: install the dev extra (buf-bin)"
    result = subprocess.run([buf, "lint"], cwd=ROOT / "protos", capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_service_has_a_v1_proto():
    names = {p.parent.parent.name for p in protogen.proto_files()}
    assert names == {"common", "gateway", "worker", "router", "slo", "sandbox", "telemetry"}


def test_generated_code_matches_protos():
    assert protogen.stale_files() == [], "run `make protos`"


def test_stale_generated_code_is_detected(tmp_path, monkeypatch):
    copy = tmp_path / "services"
    shutil.copytree(ROOT / "services", copy, ignore=shutil.ignore_patterns("__pycache__", "cotserve-demo"))
    target = copy / "worker" / "v1" / "worker_pb2.py"
    target.write_text(target.read_text() + "\n# edited by hand\n")
    monkeypatch.setattr(protogen, "PACKAGE_ROOT", copy)
    assert protogen.stale_files() == ["out of date: services/worker/v1/worker_pb2.py"]


@pytest.mark.parametrize("service", ["gateway", "worker", "router", "slo", "sandbox", "telemetry"])
def test_generated_service_stubs_import(service):
    module = __import__(f"cotserve.{service}.v1.{service}_pb2_grpc", fromlist=["x"])
    assert any(name.endswith("ServiceStub") for name in dir(module))
