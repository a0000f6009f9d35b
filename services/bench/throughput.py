"""`cotserve bench throughput`: streaming load through the gateway at several concurrency levels."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator

from cotserve.common.stats import percentile
from cotserve.sdk import AsyncClient


@dataclass(slots=True, frozen=True)
class LevelResult:
    concurrency: int
    num_requests: int
    seconds: float
    output_tokens: int
    ttft_ms: list[float]
    itl_ms: list[float]

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


async def first_token_ms(stream: AsyncIterable) -> float:
    """Milliseconds from now to a stream's first message; the stream is read to its end."""
    start, first = time.perf_counter(), None
    async for _ in stream:
        first = first or time.perf_counter()
    return ((first or time.perf_counter()) - start) * 1000


async def mux_messages(client, request) -> AsyncIterator[list]:
    """`request` opened as a stream of a multiplexed call (`common/multiplex_client`) when first read, its messages as
    they come; the stream closed however the reading ends. For `first_token_ms`, whose clock then counts the open."""
    stream = await client.open(request, None)
    try:
        while (batch := await stream.pending()) is not None:
            yield batch
    finally:
        stream.close()


async def prompt_of_tokens(client: AsyncClient, num_tokens: int, model: str = "") -> str:
    """A text that the served model's tokenizer turns into exactly (or, failing that, just under) `num_tokens` tokens."""
    def text(k: int) -> str:
        return " ".join(str((7 * i) % 100) for i in range(k))

    lo, hi = 1, num_tokens
    best = text(1)
    while lo <= hi:
        mid = (lo + hi) // 2
        n = len(await client.tokenize(text(mid), model=model))
        if n <= num_tokens:
            best, lo = text(mid), mid + 1
            if n == num_tokens:
                break
        else:
            hi = mid - 1
    return best


async def run_level(address: str, concurrency: int, prompt: str, max_new_tokens: int, num_requests: int,
                    model: str = "", multiplex: bool = False) -> LevelResult:
    """`num_requests` streamed requests, `concurrency` at a time, through the SDK (`multiplex`: as streams of one
    Session call, `AsyncClient(multiplex=True)`; else a GenerateStream call each)."""
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    sem = asyncio.Semaphore(concurrency)
    async with AsyncClient(address, timeout_s=600, multiplex=multiplex) as client:

        async def one() -> None:
            nonlocal tokens
            async with sem:
                start = last = time.perf_counter()
                first = True
                async for chunk in client.stream(prompt, model=model, max_new_tokens=max_new_tokens, ignore_eos=True, sla="batch"):
                    now = time.perf_counter()
                    # a merged chunk's tokens: the first waited, the rest came with it
                    (ttft if first else itl).append((now - (start if first else last)) * 1000)
                    itl.extend([0.0] * (len(chunk.token_ids) - 1))
                    first, last = False, now
                    tokens += len(chunk.token_ids)

        began = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(num_requests)))
        seconds = time.perf_counter() - began
    return LevelResult(concurrency, num_requests, seconds, tokens, ttft, itl)


async def run_level_http(base_url: str, concurrency: int, prompt: str, max_new_tokens: int, num_requests: int,
                         model: str = "") -> LevelResult:
    """`run_level` through the gateway's OpenAI-compatible API: streamed `/v1/completions`, one SSE event read per
    chunk, the tokens counted from the usage event at the end."""
    import aiohttp

    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    sem = asyncio.Semaphore(concurrency)
    body = {"prompt": prompt, "max_tokens": max_new_tokens, "ignore_eos": True, "stream": True, "service_tier": "flex",
            "stream_options": {"include_usage": True}, **({"model": model} if model else {})}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one() -> None:
            nonlocal tokens
            async with sem:
                start = last = time.perf_counter()  # (the response's headers come with its first chunk)
                first = True
                async with session.post(base_url.rstrip("/") + "/completions", json=body) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
                    async for line in resp.content:
                        if not line.startswith(b"data: {"):
                            continue
                        now = time.perf_counter()
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            tokens += event["usage"]["completion_tokens"]
                        if event["choices"]:
                            (ttft if first else itl).append((now - (start if first else last)) * 1000)
                            first, last = False, now

        began = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(num_requests)))
        seconds = time.perf_counter() - began
    return LevelResult(concurrency, num_requests, seconds, tokens, ttft, itl)


async def run(address: str, levels: list[int], prompt_tokens: int, max_new_tokens: int, requests_per_level: int | None,
              model: str = "", progress=print, http_url: str | None = None) -> list[LevelResult] | list[tuple[LevelResult, LevelResult]]:
    """Each level through gRPC; with `http_url` also through the HTTP API right after it: (gRPC, HTTP) per level."""
    async with AsyncClient(address) as client:
        prompt = await prompt_of_tokens(client, prompt_tokens, model)
        await client.generate(prompt, model=model, max_new_tokens=4)  # warm-up
    results = []
    for c in levels:
        n = requests_per_level or max(16, 2 * c)
        progress(f"  concurrency {c}: {n} requests of {prompt_tokens} + {max_new_tokens} tokens ...")
        grpc_result = await run_level(address, c, prompt, max_new_tokens, n, model)
        if http_url is None:
            results.append(grpc_result)
            continue
        progress(f"  concurrency {c}: the same through the HTTP API ...")
        results.append((grpc_result, await run_level_http(http_url, c, prompt, max_new_tokens, n, model)))
    return results


def table(results: list[LevelResult] | list[tuple[LevelResult, LevelResult]]):
    """One row per level, or with the HTTP API two rows per level and the ratio of their output tok/s."""
    from rich.table import Table

    paired = bool(results) and isinstance(results[0], tuple)
    t = Table(title="cotserve throughput (through the gateway, streaming)")
    for col in ("concurrency", *(("API",) if paired else ()), "requests", "req/s", "output tok/s",
                "TTFT p50/p95/p99 ms", "ITL p50/p95/p99 ms", *(("HTTP / gRPC tok/s",) if paired else ())):
        t.add_column(col, justify="right")
    for item in results:
        rows = [("gRPC", item[0]), ("HTTP", item[1])] if paired else [("", item)]
        for api, r in rows:
            ratio = f"{item[1].output_tokens_per_s / item[0].output_tokens_per_s:.2f}x" if paired and api == "HTTP" else ""
            t.add_row(
                str(r.concurrency), *((api,) if paired else ()), str(r.num_requests), f"{r.requests_per_s:.2f}",
                f"{r.output_tokens_per_s:.1f}",
                "/".join(f"{percentile(r.ttft_ms, q):.1f}" for q in (50, 95, 99)),
                "/".join(f"{percentile(r.itl_ms, q):.1f}" for q in (50, 95, 99)), *((ratio,) if paired else ()),
            )
    return t


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")
