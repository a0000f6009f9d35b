"""`cotserve bench faults`: kill and freeze each service under a steady load and see what breaks.

The stack is `cotserve up`'s (every service, supervised the same way: a child that exits is
restarted on its port), with two tenants: `open` (no limits, every class) and `limited` (a
concurrency limit, so its requests need Redis). A closed-loop load runs from six clients, all SLA
classes: REALTIME, two INTERACTIVE, BATCH (tenant `open`), INTERACTIVE as `limited` (needs Redis)
and INTERACTIVE with the `strip-think` post-processor (needs the sandbox). The gateway's BATCH
deferral on the SLO forecast is off (`--no-slo-admission`): shedding load is not a failure.

For each target (worker, redis, sandbox, slo, router, telemetry) and each fault (SIGKILL; SIGSTOP
for 5 s, then SIGCONT) it reports:

- requests in the phase, and those that failed, by status code;
- failures that should not have happened: a request that failed although it needs nothing that
  was hit (the worker serves everyone: there only requests already in flight on it may fail; a
  request arriving while it restarts waits for it);
- requests never answered (no status within `no_answer_s`): must be 0;
- recovery: from the fault until every client's requests succeed again (the first success of a
  request started after the fault, with no failure after it);
- leaks once the load pauses after the phase: KV blocks still held on the worker, concurrency
  leases still held in Redis.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from cotserve.common.clitools import run_loop
from cotserve.common.procs import Child, Supervisor, free_port
from cotserve.bench.warm import running
from cotserve.sdk import AsyncClient, CotserveError
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

TARGETS = ("worker", "redis", "sandbox", "slo", "router", "telemetry")
MODES = ("kill", "stop")
PROMPTS = ("37+48-12=", "12+30-7+5=", "61-20+4=", "8+9+10-3=", "45-17+22=", "70-35+6-1=")
NEEDS = {"redis": "limited", "sandbox": "post"}  # the client that needs each optional dependency


@dataclass(slots=True)
class ClientSpec:
    name: str
    sla: str
    api_key: str
    post_processor: str = ""


@dataclass(slots=True)
class Record:
    client: str
    start: float
    end: float
    code: str  # "OK" or the status name; "NO_ANSWER" when nothing came back in time


@dataclass(slots=True)
class PhaseResult:
    target: str
    mode: str
    requests: int
    failed: Counter
    unexpected: Counter  # failures the fault should not have caused
    no_answer: int
    recovery_s: float | None  # None: never recovered within the observation window
    kv_blocks_leaked: int
    leases_leaked: int
    notes: list[str] = field(default_factory=list)


class Load:
    """Closed-loop clients, each with at most one request in flight; `pause()` stops new requests and waits for
    the ones in flight."""

    def __init__(self, address: str, clients: list[ClientSpec], max_new_tokens: int, no_answer_s: float) -> None:
        self.address, self.clients = address, clients
        self.max_new_tokens, self.no_answer_s = max_new_tokens, no_answer_s
        self.records: list[Record] = []
        self.running = asyncio.Event()
        self.idle: dict[str, asyncio.Event] = {c.name: asyncio.Event() for c in clients}
        self._tasks: list[asyncio.Task] = []
        self._stop = False

    def start(self) -> None:
        self.running.set()
        self._tasks = [asyncio.create_task(self._client(c, i)) for i, c in enumerate(self.clients)]

    async def _client(self, spec: ClientSpec, offset: int) -> None:
        async with AsyncClient(self.address, api_key=spec.api_key) as client:
            i = offset
            while not self._stop:
                if not self.running.is_set():
                    self.idle[spec.name].set()
                    await self.running.wait()
                    continue
                self.idle[spec.name].clear()
                i += 1
                start = time.monotonic()
                code = "OK"

                async def one() -> None:
                    async for _ in client.stream(PROMPTS[i % len(PROMPTS)], max_new_tokens=self.max_new_tokens,
                                                 sla=spec.sla, post_processor=spec.post_processor):
                        pass

                try:
                    await asyncio.wait_for(one(), self.no_answer_s)
                except asyncio.TimeoutError:
                    code = "NO_ANSWER"
                except CotserveError as err:
                    code = err.code.name
                    await asyncio.sleep(0.2)  # a failing client does not spin
                self.records.append(Record(spec.name, start, time.monotonic(), code))
            self.idle[spec.name].set()

    async def pause(self, timeout_s: float) -> bool:
        self.running.clear()
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self.idle.values())), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def resume(self) -> None:
        self.running.set()

    async def close(self) -> None:
        self._stop = True
        self.running.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _recovery(records: list[Record], clients: list[str], fault_at: float) -> float | None:
    """Seconds from the fault until each client's requests (started after it) succeed for good."""
    worst = 0.0
    for name in clients:
        mine = sorted((r for r in records if r.client == name and r.start >= fault_at), key=lambda r: r.start)
        last_bad = max((k for k, r in enumerate(mine) if r.code != "OK"), default=-1)
        good = mine[last_bad + 1:]
        if not good:
            return None
        worst = max(worst, good[0].end - fault_at)
    return worst


async def _kv_blocks_used(worker_address: str) -> int:
    async with grpc.aio.insecure_channel(worker_address) as ch:
        stats = await worker_pb2_grpc.WorkerServiceStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5)
    return stats.kv_blocks_used + stats.num_running_seqs


def _leases(redis_url: str) -> int:
    import redis

    try:
        return int(redis.Redis.from_url(redis_url, socket_timeout=2).zcard("cotserve:quota:limited:concurrent"))
    except redis.RedisError:
        return -1


async def run_phase(load: Load, child: Child, target: str, mode: str, worker: Child, redis_url: str,
                    stop_s: float, settle_s: float, log: Callable[[str], None]) -> PhaseResult:
    load.resume()
    await asyncio.sleep(settle_s)
    first = len(load.records)
    fault_at = time.monotonic()
    pid = child.proc.pid  # type: ignore[union-attr]
    notes = []
    if mode == "kill":
        os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        deadline = time.monotonic() + 60
        while not (child.proc.pid != pid and child.is_ready()):  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                notes.append("not back within 60 s")
                break
            await asyncio.sleep(0.1)
        back_at = time.monotonic()
    else:
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(stop_s)
        os.kill(pid, signal.SIGCONT)
        back_at = time.monotonic()
    log(f"  {target} {mode}: back after {back_at - fault_at:.1f}s; observing ...")
    await asyncio.sleep(settle_s + 2)
    drained = await load.pause(60)
    if not drained:
        notes.append("some requests did not finish within 60 s of the pause")
    records = load.records[first:]
    # requests in flight when the fault hit, or started after it
    hit = [r for r in records if r.end >= fault_at]
    failed = Counter(r.code for r in hit if r.code not in ("OK", "NO_ANSWER"))
    unexpected: Counter = Counter()
    for r in hit:
        if r.code in ("OK", "NO_ANSWER"):
            continue
        if target == "worker":
            if r.start >= fault_at:  # arrived after the fault: should have waited for the restart
                unexpected[r.code] += 1
        elif NEEDS.get(target) != r.client:
            unexpected[r.code] += 1
    await asyncio.sleep(1.0)  # the worker frees a cancelled request's pages on its next step
    kv = await _kv_blocks_used(worker.address)
    leases = _leases(redis_url)
    return PhaseResult(target, mode, len(hit), failed, unexpected, sum(r.code == "NO_ANSWER" for r in hit),
                       _recovery(records, [c.name for c in load.clients], fault_at), kv, leases, notes)


def faults(targets: tuple[str, ...], modes: tuple[str, ...], stop_s: float, settle_s: float, max_new_tokens: int,
           log: Callable[[str], None], log_dir: Path) -> list[PhaseResult]:
    from cotserve.common.topology import stack
    from cotserve.gateway.tenants import add_key

    tenants = log_dir / "tenants.toml"
    from cotserve.common.sampling import SlaClass

    open_key = add_key(tenants, "open", frozenset(SlaClass))
    limited_key = add_key(tenants, "limited", max_concurrent=8)
    children, redis_url = stack(None, free_port(), None, telemetry_port=free_port(), telemetry_http_port=free_port(),
                                # BATCH deferral on the SLO forecast is a load decision, not a fault: off, so that
                                # every failure counted here is one a fault caused
                                gateway_extra=("--tenants-file", str(tenants), "--no-slo-admission"), log_dir=log_dir)
    with running(children, timeout_s=180, grace_s=3.0, on_start=lambda child: log(f"starting {child.name} ...")):
        return _with_faults(children, redis_url, targets, modes, stop_s, settle_s, max_new_tokens, (open_key, limited_key), log)


def _with_faults(children: list[Child], redis_url: str, targets: tuple[str, ...], modes: tuple[str, ...], stop_s: float,
                 settle_s: float, max_new_tokens: int, keys: tuple[str, str], log: Callable[[str], None]) -> list[PhaseResult]:
    """The stack is up: supervise it on a thread (restarts, as `up` does), drive the clients, and fault each target
    in each mode."""
    by_name = {c.name: c for c in children}
    open_key, limited_key = keys
    stop = threading.Event()
    failure: list[BaseException] = []
    supervisor = Supervisor(children, lambda line: log("  supervisor: " + line.splitlines()[0]))

    def supervise() -> None:
        try:
            while not stop.is_set():
                supervisor.poll()
                time.sleep(0.1)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failure.append(exc)

    clients = [ClientSpec("realtime", "realtime", open_key), ClientSpec("interactive-1", "interactive", open_key),
               ClientSpec("interactive-2", "interactive", open_key), ClientSpec("batch", "batch", open_key),
               ClientSpec("limited", "interactive", limited_key),
               ClientSpec("post", "interactive", open_key, post_processor="strip-think")]

    async def main() -> list[PhaseResult]:
        load = Load(by_name["gateway"].address, clients, max_new_tokens, no_answer_s=45.0)
        load.start()
        results = []
        try:
            for target in targets:
                for mode in modes:
                    log(f"{target}: {'SIGKILL' if mode == 'kill' else f'SIGSTOP for {stop_s:.0f}s'} ...")
                    results.append(await run_phase(load, by_name[target], target, mode, by_name["worker"], redis_url,
                                                   stop_s, settle_s, log))
                    if failure:
                        raise failure[0]
        finally:
            await load.close()
        return results

    threading.Thread(target=supervise, name="cotserve-bench-supervisor", daemon=True).start()
    try:
        return run_loop(main())
    finally:
        stop.set()
