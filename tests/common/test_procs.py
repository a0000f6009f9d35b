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


def test_supervisor_restarts_with_backoff_and_gives_up_on_a_crash_loop(tmp_path):
    """A child that exits is restarted (at once, then after 0.5 s, 1 s, ...); one that keeps exiting stops the
    stack with a message naming it, why, and its log."""
    import pytest

    from cotserve.common.procs import Child, CrashLoop, Supervisor

    flaky = Child("flaky", "x", [sys.executable, "-c", "import sys; print('boom', flush=True); sys.exit(3)"],
                  lambda: True, log_dir=tmp_path)
    steady = Child("steady", "y", [sys.executable, "-c", "import time; time.sleep(60)"], lambda: True, log_dir=tmp_path)
    said: list[str] = []
    for c in (flaky, steady):
        c.start()
    sup = Supervisor([flaky, steady], said.append, max_crashes=4, window_s=60)
    restarted_at: list[float] = []
    try:
        with pytest.raises(CrashLoop) as err:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                before = flaky.starts
                sup.poll()
                if flaky.starts != before:
                    restarted_at.append(time.monotonic())
                time.sleep(0.02)
        assert steady.proc.poll() is None and steady.starts == 1  # the others kept running
    finally:
        steady.stop(1.0)
        flaky.stop(1.0)
    assert flaky.starts == 4
    gaps = [b - a for a, b in zip(restarted_at, restarted_at[1:])]
    assert gaps[0] >= 0.5 and gaps[1] >= 1.0, gaps  # backoff doubles
    assert str(err.value).startswith(f"flaky (exit code 3) exited 4 times within 60s; giving up. Its log: {tmp_path / 'flaky.log'}")
    assert "boom" in str(err.value)
    assert said[0].startswith("flaky: exit code 3; restarting in 0.0s. Last lines of")
    assert (tmp_path / "flaky.log").read_text().count("--- cotserve up: start") == 4
