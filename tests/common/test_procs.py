"""Supervised children die with their supervisor, even when it is killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

SUPERVISOR = """
import sys, time
from cotserve.common.procs import Child, free_port, grpc_ready, python_cli, wait_serving
port = free_port()
child = Child("telemetry", f"127.0.0.1:{port}", python_cli("serve", "telemetry", "--port", str(port), "--no-state"),
              grpc_ready(f"127.0.0.1:{port}"))
child.start()
wait_serving(child, 60, lambda: None)   # gRPC threads run in this process from here on
child2 = Child("telemetry2", "x", python_cli("serve", "telemetry", "--port", str(free_port()), "--no-state"), lambda: True)
child2.start()                          # a start after gRPC use must not hang
print(child.proc.pid, child2.proc.pid, flush=True)
time.sleep(120)
"""


def test_children_die_when_the_supervisor_is_killed():
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in sup.stdout.readline().split()]
        assert len(pids) == 2 and all(os.path.exists(f"/proc/{p}") for p in pids)
        sup.send_signal(signal.SIGKILL)
        sup.wait(10)
        deadline = time.monotonic() + 20
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
            time.sleep(0.2)
        assert not alive, f"children outlived their supervisor: {alive}"
    finally:
        if sup.poll() is None:
            sup.kill()
