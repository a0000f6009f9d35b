"""`cotserve bench sandbox`: per-run overhead and throughput of the sandbox, and the guard's rates.

Per-run overhead is instantiate + run + collect of `strip-think` on a 2 KB input (a fresh store,
WASI context and instance each time, as the service does), measured in this process on the same
engine the service uses; runs/s uses a pool of 2 threads.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cotserve.bench.guard import ATTACKS, ordinary_prompts
from cotserve.common.stats import percentile
from cotserve.sandbox.runner import Limits, Outcome, SandboxEngine
from cotserve.sandbox.server import SHIPPED_DIR, SandboxConfig

INPUT_2KB = b"<think>" + b"12+30=42. " * 200 + b"</think> 42"


@dataclass(slots=True, frozen=True)
class SandboxBench:
    runs: int
    p50_ms: float
    p99_ms: float
    threads: int
    runs_per_s: float


@dataclass(slots=True, frozen=True)
class GuardEval:
    detected: int
    attacks: int
    false_positives: int
    ordinary: int
    arithmetic_rejected: int
    missed: tuple[str, ...]
    flagged: tuple[str, ...]


def bench_runs(runs: int = 1000, threads: int = 2) -> SandboxBench:
    engine = SandboxEngine()
    try:
        module = engine.compile((SHIPPED_DIR / "strip_think.wasm").read_bytes())
        limits: Limits = SandboxConfig().default_limits
        for _ in range(20):
            engine.run(module, INPUT_2KB, [], limits)  # warm-up
        walls = []
        for _ in range(runs):
            r = engine.run(module, INPUT_2KB, [], limits)
            assert r.outcome == Outcome.OK and r.output == b"42"
            walls.append(r.wall_ms)
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: engine.run(module, INPUT_2KB, [], limits), range(runs)))
        rate = runs / (time.perf_counter() - start)
    finally:
        engine.close()
    return SandboxBench(runs, percentile(walls, 50), percentile(walls, 99), threads, rate)


def evaluate_guard() -> GuardEval:
    engine = SandboxEngine()
    try:
        module = engine.compile((SHIPPED_DIR / "cot_guard.wasm").read_bytes())
        limits = SandboxConfig().default_limits

        def rejected(prompt: str) -> bool:
            r = engine.run(module, prompt.encode(), [], limits)
            return r.outcome == Outcome.EXIT_NONZERO and r.exit_code == 1

        hits = [rejected(a) for a in ATTACKS]
        ordinary = ordinary_prompts()
        flags = [rejected(p) for p in ordinary]
    finally:
        engine.close()
    return GuardEval(
        detected=sum(hits), attacks=len(ATTACKS), false_positives=sum(flags), ordinary=len(ordinary),
        arithmetic_rejected=sum(f for p, f in zip(ordinary, flags) if p.endswith("=")),
        missed=tuple(a for a, h in zip(ATTACKS, hits) if not h),
        flagged=tuple(dict.fromkeys(p for p, f in zip(ordinary, flags) if f)),
    )
