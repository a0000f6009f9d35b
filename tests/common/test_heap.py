"""A service's start-up heap is frozen, so the collector's full passes walk only what requests allocate."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROGRAM = """
import gc, json, time
import torch, grpc  # what a service holds before it serves
before = len(gc.get_objects())
from cotserve.common.heap import freeze_startup_heap
freeze_startup_heap("test")
junk = [[i] for i in range(1000)]  # allocated after start-up: still collected as usual
print(json.dumps({"before": before, "after": len(gc.get_objects()), "frozen": gc.get_freeze_count()}))
"""


@pytest.mark.parametrize("setting, frozen", [(None, True), ("0", False)])
def test_freeze_startup_heap(setting, frozen):
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k != "COTSERVE_GC_FREEZE"}
    if setting is not None:
        env["COTSERVE_GC_FREEZE"] = setting
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    if frozen:  # what start-up left is out of the collector's generations: only the later allocations remain
        assert got["frozen"] >= 0.9 * got["before"] and got["after"] < 0.05 * got["before"]
    else:  # COTSERVE_GC_FREEZE=0: nothing frozen
        assert got["frozen"] == 0 and got["after"] >= got["before"]


def test_a_served_worker_freezes_its_heap_and_so_does_its_engine_process(tmp_path):
    """`cotserve serve worker`: the gRPC front once it serves, the engine process once its model is loaded."""
    import os
    import time

    from tests.conftest import free_port, stop_process

    log = tmp_path / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cotserve.cli", "serve", "worker", "--port", str(free_port())],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            text = log.read_text()
            if "engine process: start-up heap frozen" in text and "service on 127.0.0.1" in text:
                break
            time.sleep(0.2)
        text = log.read_text()
        assert "engine process: start-up heap frozen" in text, text
        assert "service on 127.0.0.1" in text and "start-up heap frozen" in text.split("service on 127.0.0.1")[1], text
    finally:
        stop_process(proc)
