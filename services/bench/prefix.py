"""`cotserve bench prefix`: what the prefix cache and parallel samples save.

Every configuration runs on a fresh worker + gateway (the worker's counters, peak KV blocks
included, then describe that run alone), through the SDK:

- shared system prompt: `system_tokens` of one system prompt followed by a different short
  question per request, `requests` of them at `concurrency`, with the prefix cache off and on:
  TTFT p50/p95, prompt tokens the worker computed (its Stats) against the unique prompt tokens
  of the workload, the cache's hit rate, wall time.
- parallel samples: one request with n samples against n separate requests sent at once (cache
  off, as before parallel sampling existed, and cache on): peak KV blocks, wall time, prompt
  tokens computed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc

from cotserve.bench.throughput import first_token_ms, prompt_of_tokens
from cotserve.common.clitools import run_loop
from cotserve.common.topology import stack
from cotserve.common.procs import free_port
from cotserve.bench.warm import running
from cotserve.common.stats import percentile
from cotserve.sdk import AsyncClient
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc


@dataclass(slots=True, frozen=True)
class RunResult:
    name: str
    seconds: float
    ttft_ms: list[float]
    prompt_tokens_computed: int
    unique_prompt_tokens: int
    queried_tokens: int
    hit_tokens: int
    peak_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


async def _worker_stats(address: str) -> worker_pb2.StatsResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerServiceStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)


async def _ttft(client: AsyncClient, prompt: str, max_new_tokens: int, **kwargs) -> float:
    return await first_token_ms(client.stream(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, timeout_s=600, **kwargs))


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


class Stack:
    """A fresh worker + gateway for one configuration, no admission control (the bench sets the load)."""

    def __init__(self, model: Path, caching: bool, log: Callable[[str], None],
                 worker_args: tuple[str, ...] = ("--max-num-seqs", "32")) -> None:
        worker_extra = ("--model", str(model), *worker_args, "--prefix-caching" if caching else "--no-prefix-caching")
        self.children, _ = stack(None, free_port(), None, full=False, worker_extra=worker_extra,
                                 gateway_extra=("--no-admission",))
        self.log = log

    def __enter__(self) -> "Stack":
        self._running = running(self.children, timeout_s=180, grace_s=2.0,
                                on_start=lambda child: self.log(f"  starting {child.name} ..."))
        self._running.__enter__()
        return self

    @property
    def worker(self) -> str:
        return self.children[0].address

    @property
    def gateway(self) -> str:
        return self.children[-1].address

    def __exit__(self, *exc: object) -> None:
        self._running.__exit__(*exc)


async def _measure(name: str, st: Stack, unique_tokens: int, work) -> RunResult:
    async with AsyncClient(st.gateway) as client:
        await client.generate("1", max_new_tokens=2)  # warm-up on an unrelated prompt
        before = await _worker_stats(st.worker)
        start = time.perf_counter()
        ttfts = await work(client)
        seconds = time.perf_counter() - start
        after = await _worker_stats(st.worker)
    return RunResult(name, seconds, ttfts, after.prompt_tokens_computed_total - before.prompt_tokens_computed_total,
                     unique_tokens, after.prefix_cache_queried_tokens_total - before.prefix_cache_queried_tokens_total,
                     after.prefix_cache_hit_tokens_total - before.prefix_cache_hit_tokens_total, after.kv_blocks_used_peak)


async def shared_system_prompt(st: Stack, name: str, system_tokens: int, requests: int, concurrency: int,
                               max_new_tokens: int) -> RunResult:
    async with AsyncClient(st.gateway) as client:
        system = await prompt_of_tokens(client, system_tokens)
        prompts = [f"{system} Q{i}: {(i * 7919) % 1000} + {i} =" for i in range(requests)]
        ids = [await client.tokenize(p) for p in prompts]
    unique = _common_prefix(ids)
    unique += sum(len(t) - unique for t in ids)

    async def work(client: AsyncClient) -> list[float]:
        sem = asyncio.Semaphore(concurrency)

        async def one(p: str) -> float:
            async with sem:
                return await _ttft(client, p, max_new_tokens)

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    return await _measure(name, st, unique, work)


async def parallel_samples(st: Stack, name: str, prompt_tokens: int, n: int, max_new_tokens: int, grouped: bool) -> RunResult:
    async with AsyncClient(st.gateway) as client:
        prompt = await prompt_of_tokens(client, prompt_tokens)
        unique = len(await client.tokenize(prompt))

    async def work(client: AsyncClient) -> list[float]:
        if grouped:
            return [await _ttft(client, prompt, max_new_tokens, n=n, temperature=1.0, seed=1)]
        return list(await asyncio.gather(*(_ttft(client, prompt, max_new_tokens, temperature=1.0, seed=1 + i)
                                           for i in range(n))))

    return await _measure(name, st, unique, work)


def default_models() -> list[Path]:
    from cotserve.worker.config import DEMO_MODEL

    longctx = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "stdlib_llama"
    return [DEMO_MODEL] + ([longctx] if (longctx / "config.json").exists() else [])


def report_shared_prompt(console, folder: Path, size: int, requests: int, concurrency: int,
                         max_new_tokens: int) -> list[tuple[bool, str]]:
    """The shared-system-prompt workload with the prefix cache off and on: its table printed, its goals returned."""
    from rich.table import Table

    log = lambda m: console.print(m, style="dim")  # noqa: E731
    shared = Table(title=f"{folder.name}: {size}-token system prompt + a question, {requests} requests at concurrency {concurrency}")
    for col in ("prefix cache", "TTFT p50 ms", "TTFT p95 ms", "prompt tokens computed", "vs unique", "hit rate", "wall s",
                "TTFT p50 vs off"):
        shared.add_column(col, justify="right")
    runs = []
    for caching in (False, True):
        name = "on" if caching else "off"
        log(f"{folder.name}: shared system prompt, cache {name} ...")
        with Stack(folder, caching, log) as st:
            runs.append(run_loop(shared_system_prompt(st, name, size, requests, concurrency, max_new_tokens)))
    off, on = runs
    for r in runs:
        p50 = percentile(r.ttft_ms, 50)
        shared.add_row(r.name, f"{p50:,.1f}", f"{percentile(r.ttft_ms, 95):,.1f}", f"{r.prompt_tokens_computed:,}",
                       f"{r.prompt_tokens_computed / r.unique_prompt_tokens:.2f}x", f"{r.hit_rate:.1%}", f"{r.seconds:.1f}",
                       f"{p50 / percentile(off.ttft_ms, 50):.2f}x")
    console.print(shared)
    ttft_ratio = percentile(on.ttft_ms, 50) / percentile(off.ttft_ms, 50)
    computed = on.prompt_tokens_computed / on.unique_prompt_tokens
    return [(ttft_ratio <= 0.3, f"{folder.name}: TTFT p50 with the cache {ttft_ratio:.2f}x of without (goal <= 0.3x)"),
            (computed <= 1.1, f"{folder.name}: prompt tokens computed {computed:.2f}x the unique ones (goal <= 1.1x)")]


def report_parallel_samples(console, folder: Path, prompt_size: int, samples: int,
                            sample_tokens: int) -> list[tuple[bool, str]]:
    """n samples of one prompt against n requests (cache off and on): its table printed, its goals returned."""
    from rich.table import Table

    log = lambda m: console.print(m, style="dim")  # noqa: E731
    par = Table(title=f"{folder.name}: {samples} samples of one {prompt_size}-token prompt, {sample_tokens} tokens each")
    for col in ("how", "peak KV blocks", "bound", "prompt tokens computed", "wall s", "wall vs n requests (cache off)"):
        par.add_column(col, justify="right")
    bs = 16
    bound = -(-prompt_size // bs) + samples * -(-sample_tokens // bs) + samples
    results = []
    for label, caching, grouped in ((f"{samples} requests, cache off", False, False),
                                    (f"{samples} requests, cache on", True, False), (f"n={samples}", True, True)):
        log(f"{folder.name}: {label} ...")
        with Stack(folder, caching, log) as st:
            results.append(run_loop(parallel_samples(st, label, prompt_size, samples, sample_tokens, grouped)))
    base, group = results[0], results[-1]
    for r in results:
        par.add_row(r.name, str(r.peak_blocks), str(bound), f"{r.prompt_tokens_computed:,}", f"{r.seconds:.2f}",
                    f"{r.seconds / base.seconds:.2f}x")
    console.print(par)
    return [(group.peak_blocks <= bound, f"{folder.name}: n={samples} peak KV blocks {group.peak_blocks} (goal <= {bound})"),
            (group.seconds / base.seconds <= 0.6,
             f"{folder.name}: n={samples} wall time {group.seconds / base.seconds:.2f}x of {samples} requests (goal <= 0.6x)")]
