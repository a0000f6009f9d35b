"""The heatmap page in headless Chromium (Debian's chromium, installed by `make test`), the JSON API
behind it, and `cotserve heatmap` writing PNG and HTML files."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from cotserve.common.procs import free_port
from cotserve.telemetry.otlpbuild import export_request, gateway_attrs, span
from tests.conftest import start_telemetry, stop_process

# (version, kv fraction, SLA class, ttft ms) -> requests
MIX = {("m@a", 0.10, "SLA_CLASS_INTERACTIVE", 20.0): 5, ("m@a", 0.60, "SLA_CLASS_BATCH", 80.0): 3,
       ("m@b", 0.90, "SLA_CLASS_INTERACTIVE", 300.0): 2}


@pytest.fixture(scope="module")
def chromium():
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("COTSERVE_REQUIRE_BROWSER"):
            pytest.fail("chromium is not installed (make test installs Debian's chromium package)")
        pytest.skip("chromium is not installed (make test installs Debian's chromium package)")
    return path


@pytest.fixture(scope="module")
def telemetry_with_data():
    http_port = free_port()
    proc, address = start_telemetry("--http-port", str(http_port), "--no-state")
    now = time.time_ns()
    spans = [span(gateway_attrs(ttft=ttft + i, kv_frac=kv, version=v, sla=sla), now - i * 10**9)
             for (v, kv, sla, ttft), n in MIX.items() for i in range(n)]
    with grpc.insecure_channel(address) as ch:
        resp = trace_service_pb2_grpc.TraceServiceStub(ch).Export(export_request(spans), timeout=10)
        assert resp.partial_success.rejected_spans == 0
    yield address, f"http://127.0.0.1:{http_port}"
    stop_process(proc)


def run_chromium(chromium: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'chromium-profile'}",
             "--virtual-time-budget=5000", "--window-size=1200,1000"]
    return subprocess.run([chromium, *flags, *args], capture_output=True, text=True, timeout=120)


def cells_of(dom: str) -> dict[tuple[str, int], int]:
    cells = re.findall(r'<td class="cell[^"]*" data-version="([^"]+)" data-kv="(\d+)" data-count="(\d+)"', dom)
    return {(v, int(k)): int(n) for v, k, n in cells if int(n)}


def test_live_page_in_headless_chromium_shows_the_cells(chromium, telemetry_with_data, tmp_path):
    _, url = telemetry_with_data
    dom = run_chromium(chromium, tmp_path, "--dump-dom", f"{url}/?metric=ttft").stdout
    assert cells_of(dom) == {("m@a", 0): 5, ("m@a", 50): 3, ("m@b", 75): 2}
    assert re.search(r'id="status">10 requests · all classes · whole retention · updated', dom)
    assert "time to first token" in dom and "KV occupancy: share of the worker's KV-cache pool" in dom
    assert sorted(re.findall(r'<canvas [^>]*data-version="([^"]+)"', dom)) == ["m@a", "m@b"]
    # the class filter travels from the page's URL to the API
    batch = run_chromium(chromium, tmp_path, "--dump-dom", f"{url}/?metric=ttft&sla=batch").stdout
    assert cells_of(batch) == {("m@a", 50): 3} and "3 requests · class batch" in batch
    shot = tmp_path / "page.png"
    run_chromium(chromium, tmp_path, f"--screenshot={shot}", f"{url}/?metric=ttft")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_json_api_and_its_errors(telemetry_with_data):
    _, url = telemetry_with_data
    data = json.load(urllib.request.urlopen(f"{url}/api/heatmap?metric=ttft&sla=interactive", timeout=10))
    assert {(c["model_version"], c["kv_pct"]): c["count"] for c in data["cells"]} == {("m@a", 0): 5, ("m@b", 75): 2}
    assert data["bucket_upper_ms"][-1] is None and data["bucket_upper_ms"][49] == 50.0
    for query, message in (("metric=p99", "metric: want one of e2e, ttft, tpot, queue"), ("sla=gold", "sla: want all, realtime"),
                           ("window_s=-5", "window_s: want 0")):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{url}/api/heatmap?{query}", timeout=10)
        assert err.value.code == 400 and message in json.load(err.value)["error"]
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{url}/nope", timeout=10)
    assert err.value.code == 404


def test_heatmap_command_writes_png_and_html(telemetry_with_data, tmp_path):
    address, _ = telemetry_with_data
    cli = [sys.executable, "-m", "cotserve.cli", "heatmap", "--address", address]
    png = subprocess.run([*cli, "--metric", "ttft", "--out", str(tmp_path / "h.png")], capture_output=True, text=True, timeout=120)
    assert png.returncode == 0, png.stderr
    assert "n=5" in png.stdout and "n=3" in png.stdout and "n=2" in png.stdout
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = subprocess.run([*cli, "--metric", "e2e", "--sla", "batch", "--out", str(tmp_path / "h.html")],
                          capture_output=True, text=True, timeout=60)
    assert html.returncode == 0, html.stderr
    page = (tmp_path / "h.html").read_text()
    embedded = json.loads(re.search(r"const EMBEDDED = (\{.*?\});\n", page).group(1))
    assert [(c["model_version"], c["kv_pct"], c["count"]) for c in embedded["cells"]] == [("m@a", 50, 3)]
    assert not re.search(r'(src|href)="', page)  # self-contained: nothing loaded from elsewhere
    bad = subprocess.run([*cli, "--out", str(tmp_path / "h.svg")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "want a .png or .html file" in bad.stderr
    bad = subprocess.run([*cli, "--metric", "p42"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "metric: want one of e2e, ttft, tpot, queue" in bad.stderr
