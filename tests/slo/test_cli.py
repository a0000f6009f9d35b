"""`cotserve slo record | train | forecast` against a running predictor."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc

from cotserve.slo.v1 import slo_pb2, slo_pb2_grpc
from tests.conftest import _start_service, stop_process
from tests.slo.synth import simulate

CLI = [sys.executable, "-m", "cotserve.cli", "slo"]


def test_record_then_train_then_forecast(tmp_path):
    proc, address = _start_service("slo", ["--no-state", "--retrain-interval-s", "0.5"], 60)
    try:
        windows, requests = simulate(600, t0_ms=(int(time.time()) - 570) * 1000)  # ends 30 s ahead: still fresh when asked
        with grpc.insecure_channel(address) as ch:
            stub = slo_pb2_grpc.SloServiceStub(ch)
            untrained = subprocess.run([*CLI, "forecast", "m", "--address", address], capture_output=True, text=True, timeout=60)
            assert untrained.returncode == 0 and untrained.stdout.startswith("untrained: no history yet")
            for i in range(0, 600, 200):
                stub.ReportWindows(slo_pb2.ReportWindowsRequest(windows=windows[i:i + 200]), timeout=10)
            stub.ReportWindows(slo_pb2.ReportWindowsRequest(requests=requests), timeout=10)
        rec = subprocess.run([*CLI, "record", "--out", str(tmp_path / "w.bin"), "--address", address],
                             capture_output=True, text=True, timeout=60)
        assert rec.returncode == 0 and f"wrote 600 windows and {len(requests)} request observations" in rec.stdout
        train = subprocess.run([*CLI, "train", "--data", str(tmp_path / "w.bin"), "--out", str(tmp_path / "models")],
                               capture_output=True, text=True, timeout=120)
        assert train.returncode == 0, train.stderr
        assert "XGBoost forecast" in train.stdout and "baseline: queue depth" in train.stdout and "TTFT MAPE" in train.stdout
        assert "by episode" in train.stdout and "false alarms / hour" in train.stdout  # the event-level table too
        assert "blocked cross-validation (5 folds" in train.stdout and "time in alarm" in train.stdout
        assert (tmp_path / "models" / "forecast.json").exists() and (tmp_path / "models" / "ttft.json").exists()
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run([*CLI, "forecast", "m", "--address", address], capture_output=True, text=True, timeout=60).stdout
            if "P(miss within 30 s)" in out:
                break
            assert time.monotonic() < deadline, out
            time.sleep(1)
        assert len(out.strip().splitlines()) == 6  # the probability, then the five features that pushed it most
        bad = subprocess.run([*CLI, "train", "--data", str(tmp_path / "models" / "forecast.json")], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "error:" in bad.stderr
        one = subprocess.run([*CLI, "train", "--data", str(tmp_path / "w.bin"), "--folds", "1"], capture_output=True, text=True, timeout=60)
        assert one.returncode == 2 and "folds: 1, allowed 0 (skip) or 2..20" in one.stderr
    finally:
        stop_process(proc)
