"""`cotserve bench baseline`: the same workload with transformers' `generate` on the same checkpoint.

Needs the dev extra (transformers). Runs transformers one request at a time and statically
batched, then the same load through cotserve's gateway, and prints cotserve's throughput as a
ratio of each. Every prompt has the same length, so static batching needs no padding.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from cotserve.common.clitools import run_loop


@dataclass(slots=True, frozen=True)
class BaselineResult:
    name: str
    num_requests: int
    seconds: float
    output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _load(model_dir: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def run_transformers(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, num_requests: int,
                     batch_size: int) -> BaselineResult:
    """`num_requests` identical-length requests, `batch_size` at a time (1 = one at a time)."""
    model = _load(model_dir)
    kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    model.generate(torch.tensor([prompt_ids]), **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
    tokens = 0
    start = time.perf_counter()
    done = 0
    while done < num_requests:
        n = min(batch_size, num_requests - done)
        ids = torch.tensor([prompt_ids] * n)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        tokens += (out.shape[1] - ids.shape[1]) * n
        done += n
    name = "transformers one-at-a-time" if batch_size == 1 else f"transformers static batch of {batch_size}"
    return BaselineResult(name, num_requests, time.perf_counter() - start, tokens)


def run_engine_only(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, num_requests: int,
                    batch_size: int, threads: int | None = None, kv_cache_dtype: str = "auto") -> BaselineResult:
    """cotserve's engine alone, in this process (no gRPC, no gateway, no worker front): `num_requests` greedy
    requests, all submitted at once, batched `batch_size` at a time by the scheduler (continuous batching), on
    `threads` torch threads (default: as this process has them), its KV cache in `kv_cache_dtype`."""
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        result = _run_engine_only(model_dir, prompt_ids, max_new_tokens, num_requests, batch_size, kv_cache_dtype)
    finally:
        torch.set_num_threads(saved)
    if threads is None:
        return result
    return BaselineResult(f"{result.name}, {threads} torch thread{'s' * (threads > 1)}", result.num_requests,
                          result.seconds, result.output_tokens)


def _run_engine_only(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, num_requests: int,
                     batch_size: int, kv_cache_dtype: str = "auto") -> BaselineResult:
    from cotserve.common.sampling import SamplingParams
    from cotserve.worker.engine import Engine
    from cotserve.worker.models.loader import load_model
    from cotserve.worker.config import WorkerConfig
    from cotserve.worker.sizing import engine_config

    loaded = load_model(model_dir)
    engine = Engine(loaded, engine_config(WorkerConfig(model=model_dir, max_num_seqs=batch_size,
                                                       kv_cache_dtype=kv_cache_dtype), loaded))
    engine.runner.warmed.wait(600)  # the CPU kernels compiled: measure what a warmed-up worker runs
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    counts = {"tokens": 0, "finished": 0}
    start = 0.0
    failed: list[str] = []

    def sink(out) -> None:  # on the engine's loop, which runs on this thread (as in the engine process)
        nonlocal start
        if out.error:  # a failed step fails every request in it: report it, do not wait for the rest or time it
            failed.append(f"{out.request_id}: {out.error}")
            engine.stop()
            return
        if out.request_id == "warm-up":
            if out.is_last:  # warmed up: the measured requests, all at once
                start = time.perf_counter()
                for i in range(num_requests):
                    engine.submit(f"r{i}", prompt_ids, params, sink)
            return
        counts["tokens"] += 1
        if out.is_last:
            counts["finished"] += 1
            if counts["finished"] == num_requests:
                engine.stop()

    engine.submit("warm-up", prompt_ids, SamplingParams(max_new_tokens=2, ignore_eos=True), sink)
    engine.run()
    if failed:
        raise RuntimeError(f"engine only, batch {batch_size}: the engine failed ({failed[0]})")
    seconds = time.perf_counter() - start
    return BaselineResult(f"cotserve engine only, batch {batch_size}", num_requests, seconds, counts["tokens"])


@dataclass(slots=True, frozen=True)
class LinearCeiling:
    """The most output tok/s the engine's matrix multiplies allow on `threads` threads: the time this core takes to
    run the model's linear layers (its own weight shapes and dtype, weights hot in cache, nothing else: no attention,
    no other operation, no scheduling) for this workload's prompt and new tokens, per output token."""

    tokens_per_s: float
    gflops: float  # the rate those multiplies ran at
    threads: int


@torch.inference_mode()
def linear_ceilings(model_dir: Path, prompt_tokens: int, max_new_tokens: int, batches: list[int], threads: int = 1,
                    max_prefill_rows: int = 2048) -> dict[int, LinearCeiling] | None:
    """`LinearCeiling` per batch size for requests of `prompt_tokens` + `max_new_tokens` decoded `batch` at a time (the
    prompts prefilled together, up to `max_prefill_rows` rows a multiply; each new token one decode row with the LM
    head, the first one too, which the prefill's last row makes: one row in `prompt_tokens` counted twice); None for a
    mixture of experts (which experts run depends on the tokens). The model is loaded once for all of them."""
    from cotserve.worker.models.loader import load_model

    loaded = load_model(model_dir)
    if loaded.config.num_experts:
        return None
    weights: list[torch.Tensor] = []
    for layer in loaded.model.model.layers:  # the multiplies a step runs: q/k/v and gate/up fused where loaded so
        attn, mlp = layer.self_attn, layer.mlp
        weights += [attn.qkv[0]] if attn.qkv else [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        weights += [attn.o_proj.weight]
        weights += [mlp.gate_up[0]] if mlp.gate_up else [mlp.gate_proj.weight, mlp.up_proj.weight]
        weights += [mlp.down_proj.weight]
    head = loaded.model.lm_head.weight
    flops = 2 * (sum(w.numel() for w in weights) * (prompt_tokens + max_new_tokens) + head.numel() * max_new_tokens)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    out = {}
    try:
        for batch in batches:
            prefill_rows = max(1, min(prompt_tokens * batch, max_prefill_rows))
            linear = loaded.model.layer_ops.linear  # as served: C over the weights stored transposed, or F.linear
            prefill = _linears_seconds(weights, prefill_rows, loaded.dtype, linear) / prefill_rows  # per prompt token
            decode = _linears_seconds([*weights, head], batch, loaded.dtype, linear) / batch          # per new token
            per_request = prompt_tokens * prefill + max_new_tokens * decode
            out[batch] = LinearCeiling(max_new_tokens / per_request, flops / per_request / 1e9, threads)
    finally:
        torch.set_num_threads(saved)
    return out


def print_ceiling(console, model_dir: Path, load: Load, threads: int, engine: BaselineResult) -> None:
    """The multiplies' ceiling at the load's batch on `threads` threads, and the share of it `engine` reached."""
    ceilings = linear_ceilings(model_dir, load.prompt_tokens, load.max_new_tokens, [load.concurrency], threads)
    if ceilings is None:
        return
    ceiling = ceilings[load.concurrency]
    console.print(f"the model's linear layers alone (its weight shapes, hot in cache, nothing else) on {threads} "
                  f"thread{'s' * (threads > 1)}: {ceiling.tokens_per_s:,.0f} tok/s at {ceiling.gflops:.0f} GFLOP/s; "
                  f"the engine alone as the worker runs it reaches {engine.output_tokens_per_s / ceiling.tokens_per_s:.0%} "
                  "of that ceiling", soft_wrap=True)


def _linears_seconds(weights: list[torch.Tensor], rows: int, dtype: torch.dtype, linear=torch.nn.functional.linear,
                     repeats: int = 20) -> float:
    """Seconds for one pass of `rows` rows through every weight in turn with `linear` (best of `repeats`, after a
    warm-up)."""
    inputs = [torch.randn(rows, w.shape[1], dtype=dtype) for w in weights]
    best = float("inf")
    for r in range(repeats + 2):
        start = time.perf_counter()
        for x, w in zip(inputs, weights):
            linear(x, w)
        if r >= 2:
            best = min(best, time.perf_counter() - start)
    return best


def engine_child(pid: int) -> int | None:
    """The engine process of the worker `pid` (its `python -m cotserve.worker.engine_process` child), if any."""
    import subprocess

    kids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    for k in kids:
        try:
            if "cotserve.worker.engine_process" in open(f"/proc/{k}/cmdline").read():
                return int(k)
        except OSError:
            continue
    return None


async def ttft_direct_relay_gateway(gateway: str, relay: str, worker: str, prompt: str, rounds: int,
                                    per_call_gateway: str) -> tuple[list[float], ...]:
    """Time to first token (ms) of one request at a time, interleaved, each path called the same way (a plain
    grpc.aio stub, so that no client library's own work is counted): straight to the worker, through a bare relay
    (the same call one grpc.aio hop further, a call per request), through the gateway (what the gateway adds: auth,
    validation, admission, routing, tracing, metrics, one more hop: a stream of its Multiplex call to the worker),
    through a gateway that calls the worker per request (`--no-worker-multiplex`); and over long-lived calls at
    both ends: a stream of the worker's Multiplex call against a stream of the gateway's Session."""
    import grpc

    from cotserve.bench.throughput import first_token_ms, mux_messages
    from cotserve.common.multiplex_client import MultiplexClient
    from cotserve.common.v1 import common_pb2
    from cotserve.gateway.multiplex import worker_kind
    from cotserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
    from cotserve.sdk.client import session_kind
    from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

    sampling = common_pb2.SamplingParams(max_new_tokens=1, ignore_eos=True)
    samples: tuple[list[float], ...] = ([], [], [], [], [], [])
    async with (grpc.aio.insecure_channel(worker) as wch, grpc.aio.insecure_channel(relay) as rch,
                grpc.aio.insecure_channel(gateway) as gch, grpc.aio.insecure_channel(per_call_gateway) as pch):
        wstub = worker_pb2_grpc.WorkerServiceStub(wch)
        rstub, gstub = gateway_pb2_grpc.GatewayServiceStub(rch), gateway_pb2_grpc.GatewayServiceStub(gch)
        pstub = gateway_pb2_grpc.GatewayServiceStub(pch)
        request = gateway_pb2.GenerateStreamRequest(prompt=prompt, sampling=sampling)
        wrequest = worker_pb2.GenerateRequest(prompt_text=prompt, sampling=sampling)
        worker_mux, session = MultiplexClient(worker_kind(wstub)), MultiplexClient(session_kind(gstub, None))
        paths = (lambda: first_token_ms(wstub.Generate(wrequest)),
                 lambda: first_token_ms(rstub.GenerateStream(request)),
                 lambda: first_token_ms(gstub.GenerateStream(request)),
                 lambda: first_token_ms(pstub.GenerateStream(request)),
                 lambda: first_token_ms(mux_messages(worker_mux, wrequest)),
                 lambda: first_token_ms(mux_messages(session, request)))
        for _ in range(5):  # warm every path (connections, caches)
            for path in paths:
                await path()
        for _ in range(rounds):
            for path, out in zip(paths, samples):
                out.append(await path())
    return samples


@dataclass(slots=True, frozen=True)
class Load:
    """The workload of the runs through the gateway (and, at the same batch, of the engine-only rows)."""

    concurrency: int
    prompt_tokens: int
    max_new_tokens: int
    requests: int


@dataclass(slots=True)
class GatewayRun:
    """One run through a gateway: its level, CPU seconds per process (a stack started here), the TTFT samples
    (ms, one request at a time, `ttft_paths`), and the prompt used."""

    interval: int | None
    level: Any
    cpu: dict[str, float]
    ttft: tuple[list[float], ...] | None
    prompt: str
    prompt_ids: list[int]
    session: bool = True

    @property
    def label(self) -> str:
        return run_label(self.interval, self.session)


def run_label(interval: int | None, session: bool) -> str:
    """How a run through the gateway went: its stream interval, and the client's calls when not one Session."""
    return ", ".join(([] if interval is None else [f"stream interval {interval}"]) + ([] if session else ["a call per request"]))


def run_through_gateway(model_dir: Path, address: str | None, interval: int | None, load: Load, ttft_rounds: int,
                        say: Callable[[str], None], session: bool = True) -> GatewayRun:
    """The load through `address`, or through a worker (`--stream-interval interval`) + gateway started here, from
    an SDK client with every request a stream of one Session call (`session`) or a GenerateStream call each; with
    `ttft_rounds`, then the TTFT pairs against the worker directly and a bare relay."""
    from cotserve.bench.isolation import cpu_seconds
    from cotserve.bench.throughput import prompt_of_tokens, run_level
    from cotserve.common.procs import free_port
    from cotserve.bench.warm import running
    from cotserve.common.topology import stack
    from cotserve.sdk import AsyncClient

    children = []
    gateway = address
    if gateway is None:
        children, _ = stack(model_dir, free_port(), None, full=False, worker_extra=("--stream-interval", str(interval), "--batch-stream-interval", str(interval)))
        gateway = children[-1].address
    with running(children, on_start=lambda child: say(f"starting {child.name} ...")):
        procs = service_pids(children)
        if procs:  # the load generator runs here, on the same cores: its share is part of the picture
            procs["load generator (this process)"] = os.getpid()
        cpu_before: dict[str, float] = {}

        async def measure():
            async with AsyncClient(gateway) as c:
                prompt = await prompt_of_tokens(c, load.prompt_tokens)
                ids = await c.tokenize(prompt)
                await c.generate(prompt, max_new_tokens=4)
            cpu_before.update(cpu_seconds(procs))
            return prompt, ids, await run_level(gateway, load.concurrency, prompt, load.max_new_tokens, load.requests,
                                                multiplex=session)

        label = run_label(interval, session)
        say(f"cotserve: {load.requests} requests at concurrency {load.concurrency}{', ' + label if label else ''} ...")
        prompt, ids, level = run_loop(measure())
        cpu = {name: v - cpu_before[name] for name, v in cpu_seconds(procs).items()}
        ttft = None
        if children and ttft_rounds > 0:
            say(f"TTFT: {ttft_rounds} requests one at a time each: worker direct, a bare relay, the gateway, a gateway "
                "calling the worker per request, the worker's Multiplex, the gateway's Session ...")
            ttft = ttft_paths(gateway, children[0].address, prompt, ttft_rounds)
    return GatewayRun(interval, level, cpu, ttft, prompt, ids, session)


def gateway_plan(intervals: list, session: bool, compare_per_call: bool) -> list[tuple]:
    """The runs through the gateway: (stream interval, on one Session) per interval, and with `compare_per_call`
    the first interval again with a call per request."""
    plan = [(interval, session) for interval in intervals]
    if session and compare_per_call:
        plan.insert(1, (intervals[0], False))
    return plan


def transformers_rows(model_dir: Path, ids: list[int], load: Load, single_requests: int,
                      say: Callable[[str], None]) -> tuple[BaselineResult, BaselineResult]:
    """transformers one request at a time, and in static batches of the load's concurrency."""
    say(f"transformers: {single_requests} requests one at a time ...")
    single = run_transformers(model_dir, ids, load.max_new_tokens, single_requests, 1)
    say(f"transformers: {load.requests} requests in static batches of {load.concurrency} ...")
    return single, run_transformers(model_dir, ids, load.max_new_tokens, load.requests, load.concurrency)


def mtls_cost(console, model_dir: Path, load: Load, ttft_rounds: int, runs: int, say: Callable[[str], None]) -> None:
    """What mutual TLS between the services costs under `load` (`bench/mtls.py`), printed."""
    from cotserve.bench import mtls

    mtls.print_cost(console, mtls.measure(model_dir, load.concurrency, load.prompt_tokens, load.max_new_tokens,
                                          load.requests, ttft_rounds, runs, say))


def service_pids(children: list) -> dict[str, int]:
    """The processes whose CPU time the bench reports: the worker's front, its engine process, the gateway."""
    if not children:
        return {}
    procs = {"worker (gRPC front)": children[0].proc.pid}
    engine_pid = engine_child(children[0].proc.pid)
    if engine_pid is not None:
        procs["worker (engine process)"] = engine_pid
    procs["gateway"] = children[-1].proc.pid
    return procs


def ttft_paths(gateway: str, worker: str, prompt: str, rounds: int) -> tuple[list[float], ...]:
    """TTFT (ms) straight to the worker, through a bare grpc.aio relay (`bench/relay.py`: the hop alone), through
    the gateway, through a second gateway calling the worker per request, and on long-lived calls at both ends (the
    worker's Multiplex, the gateway's Session), one request at a time, interleaved (`ttft_direct_relay_gateway`)."""
    from cotserve.common.procs import Child, free_port, grpc_ready, python_cli
    from cotserve.bench.warm import running

    relay_addr = f"127.0.0.1:{free_port()}"
    relay = Child("relay", relay_addr, [sys.executable, "-m", "cotserve.bench.relay", relay_addr, worker],
                  grpc_ready(relay_addr))
    per_call = Child("gateway-per-call", "", [], argv_for=lambda port: python_cli(  # binds port 0, reports it
        "serve", "gateway", "--port", str(port), "--worker", worker, "--no-worker-multiplex"))
    with running([relay, per_call]):
        return run_loop(ttft_direct_relay_gateway(gateway, relay_addr, worker, prompt, rounds, per_call.address))


def print_gateway_runs(console, runs: list[GatewayRun]) -> None:
    """The runs' level table, CPU ms per generated token of each process per run, and the gateway-added TTFT."""
    from rich.table import Table

    from cotserve.bench.throughput import table
    from cotserve.common.stats import percentile

    console.print(table([r.level for r in runs]))
    if runs[0].cpu:
        c = Table(title=f"CPU time per generated token ({runs[0].level.output_tokens} tokens per run)")
        c.add_column("process")
        for r in runs:
            c.add_column(f"CPU ms/token, {r.label}", justify="right")
        for name in runs[0].cpu:
            c.add_row(name, *(f"{r.cpu.get(name, 0.0) * 1000 / max(1, r.level.output_tokens):.3f}" for r in runs))
        console.print(c)
    ttft = next((r.ttft for r in runs if r.ttft is not None), None)
    if ttft is not None:
        direct, relay, via, per_call, worker_mux, session = (sorted(x) for x in ttft)
        p50 = [percentile(x, 50) for x in (direct, relay, via, per_call)]
        added = p50[2] - p50[0]
        console.print(f"TTFT p50, one request at a time: worker direct {p50[0]:.2f} ms, via a bare gRPC relay {p50[1]:.2f} ms "
                      f"(one more hop, a call per request: +{p50[1] - p50[0]:.2f} ms), via the gateway {p50[2]:.2f} ms: the "
                      f"gateway adds {added:.2f} ms (goal <= 1 ms: {'met' if added <= 1 else 'NOT met'}), "
                      f"{p50[2] - p50[1]:.2f} ms over the bare relay; calling the worker per request "
                      f"(--no-worker-multiplex) it adds {p50[3] - p50[0]:.2f} ms; p90 {percentile(direct, 90):.2f} / "
                      f"{percentile(relay, 90):.2f} / {percentile(via, 90):.2f} / {percentile(per_call, 90):.2f} ms",
                      soft_wrap=True)
        mux50, session50 = percentile(worker_mux, 50), percentile(session, 50)
        mux_added = session50 - mux50
        console.print(f"TTFT p50 over long-lived calls at both ends: the worker's Multiplex {mux50:.2f} "
                      f"ms, the gateway's Session {session50:.2f} ms: the gateway adds {mux_added:.2f} ms "
                      f"(goal <= 1 ms: {'met' if mux_added <= 1 else 'NOT met'}); p90 {percentile(worker_mux, 90):.2f} / "
                      f"{percentile(session, 90):.2f} ms", soft_wrap=True)


KERNEL_SETTINGS = (("native", "auto", "auto", "auto", True, "auto"),
                   ("native, FP8 cache", "auto", "auto", "auto", True, "fp8_e4m3"),
                   ("native, per operation", "auto", "auto", "per-op", True, "auto"),
                   ("native, torch layer ops", "auto", "reference", "auto", True, "auto"),
                   ("compiled", "reference", "reference", "auto", True, "auto"),
                   ("eager", "reference", "reference", "auto", False, "auto"))
"""The engine-only rows' CPU kernels: the default (decode attention, cache writes, the layers' multiplies and small
operations in C, a decode step's layers in one C call), the same with an FP8 KV cache, the same with each operation a
call from Python (the default before the one call), the same with the layers' operations as torch's (MKL's multiplies
and the small operations' references: the default before they were C), the torch references compiled by inductor
(the default before the C kernel), and the references eager. Each is (label, COTSERVE_KERNELS, COTSERVE_LAYER_OPS,
COTSERVE_DECODE_LAYERS, compile, kv_cache_dtype)."""


def engine_batch_rows(model_dir: Path, ids: list[int], max_new_tokens: int, batches: list[int],
                      say: Callable[[str], None]) -> list[tuple[int, str, BaselineResult]]:
    """The engine alone at each batch size under each of `KERNEL_SETTINGS`."""
    from cotserve.kernels.cpu_compile import compile_setting, env_setting

    rows = []
    for batch in batches:
        for label, kernels, layer_ops, decode_layers, compiled, kv_dtype in KERNEL_SETTINGS:
            say(f"cotserve engine only, batch {batch}, {label} kernels ...")
            with compile_setting(compiled), env_setting("COTSERVE_KERNELS", kernels), \
                    env_setting("COTSERVE_LAYER_OPS", layer_ops), env_setting("COTSERVE_DECODE_LAYERS", decode_layers):
                rows.append((batch, label, run_engine_only(model_dir, ids, max_new_tokens, max(batch, 8) * 2, batch,
                                                           kv_cache_dtype=kv_dtype)))
    return rows


def engine_table(rows: list[tuple[int, str, BaselineResult]], batches: list[int],
                 ceilings: dict[int, LinearCeiling] | None = None):
    from rich.table import Table

    threads = torch.get_num_threads()
    e = Table(title=f"engine only (this process, one loop, {threads} torch thread{'s' * (threads > 1)}): CPU kernels "
                    "in C (native: decode attention, cache writes, the layers' multiplies and small operations, a decode "
                    "step's layers in one call; with an FP8 KV cache; with each operation a call from Python; then with "
                    "the layers' operations as torch's) vs the torch references compiled by inductor and eager; the "
                    "ceiling is the model's linear layers alone, weights hot in cache")
    for col in ("batch", "native tok/s", "FP8 cache tok/s", "per operation tok/s", "torch layer ops tok/s",
                "compiled tok/s", "eager tok/s", "FP8 / native", "native / per operation", "native / torch layer ops",
                "native / compiled", "native / eager", "linears ceiling tok/s", "native / ceiling"):
        e.add_column(col, justify="right")
    by = {(b, label): r.output_tokens_per_s for b, label, r in rows}
    for batch in batches:
        n, f, t = by[batch, "native"], by[batch, "native, FP8 cache"], by[batch, "native, torch layer ops"]
        p, c, g = by[batch, "native, per operation"], by[batch, "compiled"], by[batch, "eager"]
        ceiling = (ceilings or {}).get(batch)
        e.add_row(str(batch), f"{n:.0f}", f"{f:.0f}", f"{p:.0f}", f"{t:.0f}", f"{c:.0f}", f"{g:.0f}", f"{f / n:.2f}x",
                  f"{n / p:.2f}x", f"{n / t:.2f}x", f"{n / c:.2f}x", f"{n / g:.2f}x",
                  f"{ceiling.tokens_per_s:.0f}" if ceiling else "n/a",
                  f"{n / ceiling.tokens_per_s:.0%}" if ceiling else "n/a")
    return e


def print_ratios(console, runs: list[GatewayRun], engine_as_worker: BaselineResult, engine_only: BaselineResult,
                 static: BaselineResult, worker_threads: int) -> None:
    """Each run through the gateway against the engine alone (on the worker's threads, on all) and transformers'
    static batch."""
    for run in runs:
        label = f" ({run.label})" if run.label else ""
        rate = run.level.output_tokens_per_s
        console.print(f"end to end{label} / engine only on {worker_threads} thread{'s' * (worker_threads > 1)} (as in the "
                      f"worker): {rate / engine_as_worker.output_tokens_per_s:.2f}, on all {torch.get_num_threads()}: "
                      f"{rate / engine_only.output_tokens_per_s:.2f}; / transformers static batch: "
                      f"{rate / static.output_tokens_per_s:.2f}")
    console.print("(the serving overhead's share of the engine's rate is one minus the first figure)", style="dim")


def print_summary(console, load: Load, model_dir: Path, runs: list[GatewayRun], others: list[BaselineResult]) -> None:
    """Every system's output tok/s, and the first run's rate as a ratio of each."""
    from rich.table import Table

    first = runs[0].level.output_tokens_per_s
    t = Table(title=f"{load.prompt_tokens}+{load.max_new_tokens} tokens per request, {model_dir.name}")
    for col in ("system", "requests", "output tok/s", "cotserve ratio (first row)"):
        t.add_column(col, justify="right")
    for r in runs:
        t.add_row(f"cotserve via gateway, concurrency {load.concurrency}{', ' + r.label if r.label else ''}",
                  str(r.level.num_requests),
                  f"{r.level.output_tokens_per_s:.1f}", f"{first / r.level.output_tokens_per_s:.2f}x")
    for b in others:
        t.add_row(b.name, str(b.num_requests), f"{b.output_tokens_per_s:.1f}", f"{first / b.output_tokens_per_s:.2f}x")
    console.print(t)
