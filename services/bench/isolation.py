"""`cotserve bench isolation`: the noisy-neighbour benchmark.

Tenant A floods BATCH requests (closed loop, many at once, from a process of its own) while tenant B
sends a steady INTERACTIVE stream and a trickle of REALTIME (open loop, fixed rates). Three runs, each on a
fresh worker + gateway: B alone; B + flood with SLA scheduling and admission on; B + flood with
both off (FIFO worker, gateway forwarding everything). Reported per class of tenant B: TTFT and
inter-token p50/p99, the share of requests that missed their targets, the TTFT spread (p99 - p50),
and the total output tokens/s of each run.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from cotserve.common.clitools import run_loop
from cotserve.common.stats import percentile
from cotserve.common.sampling import SlaClass
from cotserve.common.sla import DEFAULT_SLA_TARGETS, SlaTarget
from cotserve.sdk import AsyncClient, CotserveError, Reasoning, ResourceExhausted, SelfConsistency


@dataclass(slots=True)
class RequestRecord:
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    gateway_ttft_ms: float | None = None  # the same first token, timed at the gateway (from its arrival there)
    queue_ms: float | None = None  # of that: waiting for admission at the gateway and in the worker's queue

    def missed(self, target: SlaTarget) -> bool:
        if self.error is not None or self.ttft_ms is None or self.ttft_ms > target.ttft_ms:
            return True
        return bool(self.itl_ms) and percentile(self.itl_ms, 95) > target.itl_p95_ms


@dataclass(slots=True)
class RunResult:
    name: str
    seconds: float
    by_class: dict[SlaClass, list[RequestRecord]]
    flood_tokens: int
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds of each process in B's window

    @property
    def total_tokens_per_s(self) -> float:
        b_tokens = sum(r.tokens for recs in self.by_class.values() for r in recs)
        return (b_tokens + self.flood_tokens) / self.seconds


async def _one(client: AsyncClient, prompt: str, cls: str, max_new_tokens: int, rec: RequestRecord) -> None:
    start = last = time.perf_counter()
    try:
        async for chunk in client.stream(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, sla=cls, timeout_s=120):
            now = time.perf_counter()
            if rec.ttft_ms is None:
                rec.ttft_ms = (now - start) * 1000
                rec.itl_ms.extend([0.0] * (len(chunk.token_ids) - 1))
            else:  # a merged chunk's tokens: the first waited, the rest came with it
                rec.itl_ms.extend([(now - last) * 1000] + [0.0] * (len(chunk.token_ids) - 1))
            last = now
            rec.tokens += len(chunk.token_ids)
            if chunk.timing is not None:
                rec.gateway_ttft_ms, rec.queue_ms = chunk.timing.ttft_ms, chunk.timing.queue_ms
    except CotserveError as err:
        rec.error = err.code.name


async def _open_loop(client: AsyncClient, rate_per_s: float, stop_at: float, cls: str, prompts: list[str],
                     max_new_tokens: int, out: list[RequestRecord], rng: random.Random) -> None:
    tasks = []
    next_at = time.perf_counter()
    while next_at < stop_at:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        rec = RequestRecord()
        out.append(rec)
        tasks.append(asyncio.create_task(_one(client, rng.choice(prompts), cls, max_new_tokens, rec)))
        next_at += rng.expovariate(rate_per_s)  # Poisson arrivals at the given mean rate
    await asyncio.gather(*tasks)


async def _flood_loop(client: AsyncClient, stop: asyncio.Event, prompt: str, max_new_tokens: int, counter: list[int],
                      votes: int = 0) -> None:
    """One of the flood's streams, again and again: BATCH requests; with `votes`, INTERACTIVE self-consistency votes of
    up to that many samples (rounds of VOTE_ROUND) at temperature 1.0 instead, the heaviest thing a tenant can ask."""
    options = dict(max_new_tokens=max_new_tokens, ignore_eos=True, sla="batch", timeout_s=300)
    if votes:
        options = dict(max_new_tokens=max_new_tokens, sla="interactive", temperature=1.0, timeout_s=300,
                       reasoning=Reasoning(self_consistency=SelfConsistency(max_samples=votes,
                                                                            min_samples=min(votes, VOTE_ROUND))))
    while not stop.is_set():
        try:
            async for chunk in client.stream(prompt, **options):
                counter[0] += len(chunk.token_ids)
                if stop.is_set():
                    return
        except ResourceExhausted as err:
            await asyncio.sleep((err.retry_after_ms or 100) / 1000)
        except CotserveError:
            await asyncio.sleep(0.1)


VOTE_ROUND = 16
"""Samples a flooding vote runs at once (its self-consistency min_samples)."""


async def flood(address: str, concurrency: int, votes: int = 0, api_key: str | None = None) -> None:
    """Tenant A's flood as a process of its own (`python -m cotserve.bench.isolation ADDRESS CONCURRENCY`), a call
    per request (a neighbour as it comes): it prints
    "ready" once its streams run; a line "start" on stdin zeroes its token count, "stop" prints the count and ends.
    Apart from B's client, so that B's times are not the benchmark's own event loop relaying A's tokens (the two
    still share the machine's cores, as a real tenant's neighbours do)."""
    import sys

    flood_prompt = "12+30-7+5+61-20=" if votes else " ".join(str(i % 100) for i in range(40))
    tokens = [0]
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with AsyncClient(address, api_key=api_key) as client:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(_flood_loop(client, stop, flood_prompt, 64 if votes else 96, tokens, votes))
                 for _ in range(concurrency)]
        print("ready", flush=True)
        while (line := (await reader.readline()).decode().strip()) not in ("stop", ""):
            if line == "start":
                tokens[0] = 0
        print(tokens[0], flush=True)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds each named process has used so far (subtract two snapshots for a window's share)."""
    from cotserve.worker.utilization import process_cpu_seconds

    return {name: process_cpu_seconds(pid) for name, pid in pids.items()}


async def drive(address: str, *, duration_s: float, flood_concurrency: int, interactive_rps: float,
                realtime_rps: float, seed: int = 0, pids: dict[str, int] | None = None, multiplex: bool = True,
                flood_votes: int = 0, keys: tuple[str | None, str | None] = (None, None)) -> RunResult:
    """Tenant B's load for `duration_s` against `address`, with tenant A's flood (its own process) when
    `flood_concurrency` > 0: the seconds, B's records by class, A's tokens and the CPU seconds of each process in
    `pids` (and of the two clients) in B's window. With `multiplex` tenant B's client sends its requests as streams
    of one Session call (`AsyncClient(multiplex=True)`), otherwise as a call each; the flood is a call per request.
    `flood_votes`: the flood sends INTERACTIVE votes of that many samples (`_flood_loop`); `keys`: tenant A's and
    tenant B's API keys, for a gateway that tells tenants apart."""
    import os
    import sys

    rng = random.Random(seed)
    prompts = [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}-{rng.randint(0, 99)}+{rng.randint(0, 99)}=" for _ in range(32)]
    records: dict[SlaClass, list[RequestRecord]] = {SlaClass.INTERACTIVE: [], SlaClass.REALTIME: []}
    proc = None
    if flood_concurrency:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "cotserve.bench.isolation", address,
                                                    str(flood_concurrency), str(flood_votes), keys[0] or "",
                                                    stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE)
    try:
        if proc is not None:
            await proc.stdout.readline()  # "ready"
            await asyncio.sleep(2.0)  # let the flood fill the worker before B starts
            proc.stdin.write(b"start\n")
            await proc.stdin.drain()
        pids = {**(pids or {}), "tenant B's client": os.getpid(), **({"tenant A's flood client": proc.pid} if proc else {})}
        async with AsyncClient(address, multiplex=multiplex, api_key=keys[1]) as b_client:
            cpu_before = cpu_seconds(pids)
            start = time.perf_counter()
            stop_at = start + duration_s
            await asyncio.gather(
                _open_loop(b_client, interactive_rps, stop_at, "interactive", prompts, 32, records[SlaClass.INTERACTIVE], rng),
                _open_loop(b_client, realtime_rps, stop_at, "realtime", prompts, 16, records[SlaClass.REALTIME], rng),
            )
            seconds = time.perf_counter() - start
            cpu_s = {name: v - cpu_before[name] for name, v in cpu_seconds(pids).items()}
        tokens_in_window = 0
        if proc is not None:
            proc.stdin.write(b"stop\n")
            await proc.stdin.drain()
            tokens_in_window = int((await proc.stdout.readline()).decode().strip() or 0)
            await proc.wait()
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
    return RunResult("", seconds, records, tokens_in_window, cpu_s)


def cpu_table(results: list[RunResult]):
    """Each process's share of one core in B's window, per run: where the flood's cost lands on the machine."""
    from rich.table import Table

    t = Table(title="CPU in tenant B's window (% of one core)")
    t.add_column("process")
    for r in results:
        t.add_column(r.name, justify="right")
    names = list(dict.fromkeys(n for r in results for n in r.cpu_s))
    for name in names:
        t.add_row(name, *(f"{100 * r.cpu_s[name] / r.seconds:.0f}" if name in r.cpu_s else "-" for r in results))
    t.add_row("all", *(f"{100 * sum(r.cpu_s.values()) / r.seconds:.0f}" for r in results))
    return t


def summarize(results: list[RunResult], title: str = "tenant B under tenant A's BATCH flood"):
    from rich.table import Table

    def p50_99(values: list[float | None]) -> str:
        got = [v for v in values if v is not None]
        return f"{percentile(got, 50):.1f}/{percentile(got, 99):.1f}" if got else "-"

    t = Table(title=title)
    for col in ("run", "class", "requests", "TTFT p50/p99 ms", "at the gateway", "of it queued", "ITL p50/p99 ms",
                "missed", "TTFT spread ms", "total tok/s"):
        t.add_column(col, justify="right")
    for r in results:
        for cls, recs in r.by_class.items():
            ttft = [x.ttft_ms for x in recs if x.ttft_ms is not None]
            itl = [g for x in recs for g in x.itl_ms]
            missed = sum(x.missed(DEFAULT_SLA_TARGETS[cls]) for x in recs) / max(1, len(recs))
            t.add_row(r.name, cls.name, str(len(recs)),
                      f"{percentile(ttft, 50):.1f}/{percentile(ttft, 99):.1f}",
                      p50_99([x.gateway_ttft_ms for x in recs]), p50_99([x.queue_ms for x in recs]),
                      f"{percentile(itl, 50):.1f}/{percentile(itl, 99):.1f}",
                      f"{missed:.1%}", f"{percentile(ttft, 99) - percentile(ttft, 50):.1f}",
                      f"{r.total_tokens_per_s:.0f}")
    return t


def goals(alone: RunResult, on: RunResult, fifo: RunResult) -> list[str]:
    def p99(r: RunResult) -> float:
        return percentile([x.ttft_ms for x in r.by_class[SlaClass.INTERACTIVE] if x.ttft_ms is not None], 99)

    recs = on.by_class[SlaClass.INTERACTIVE]
    miss = sum(x.missed(DEFAULT_SLA_TARGETS[SlaClass.INTERACTIVE]) for x in recs) / max(1, len(recs))
    ratio = p99(on) / p99(alone) if p99(alone) else float("nan")
    share = on.total_tokens_per_s / fifo.total_tokens_per_s if fifo.total_tokens_per_s else float("nan")
    return [
        f"INTERACTIVE p99 TTFT under the flood / alone: {ratio:.2f}x (goal <= 1.5x; FIFO: {p99(fifo) / p99(alone):.2f}x)",
        f"INTERACTIVE target-miss rate under the flood: {miss:.1%} (goal < 2%)",
        f"total output tokens/s vs FIFO: {share:.0%} (goal >= 90%)",
    ]


if __name__ == "__main__":
    import sys

    run_loop(flood(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0,
                   (sys.argv[4] or None) if len(sys.argv) > 4 else None))


def fairness_goals(alone: RunResult, fair: RunResult, unfair: RunResult) -> list[str]:
    """Tenant B's INTERACTIVE p99 TTFT under tenant A's flood of votes, against B alone, with and without fair shares."""
    def p99(r: RunResult) -> float:
        return percentile([x.ttft_ms for x in r.by_class[SlaClass.INTERACTIVE] if x.ttft_ms is not None], 99)

    ratio = p99(fair) / p99(alone) if p99(alone) else float("nan")
    other = p99(unfair) / p99(alone) if p99(alone) else float("nan")
    return [f"tenant B's INTERACTIVE p99 TTFT under tenant A's votes / alone: {ratio:.2f}x with fair shares "
            f"(goal <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'}); {other:.2f}x without (--scheduling priority-yield)"]
