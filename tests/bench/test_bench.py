"""The benchmarks run end to end and print their tables (speed itself is never asserted)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import pytest

from cotserve.bench.throughput import prompt_of_tokens, run_level
from cotserve.sdk import AsyncClient


def test_prompt_has_exactly_the_asked_token_count_and_levels_count_every_token(demo_gateway):
    async def main():
        async with AsyncClient(demo_gateway) as c:
            prompt = await prompt_of_tokens(c, 64)
            n = len(await c.tokenize(prompt))
        level = await run_level(demo_gateway, 3, prompt, 5, 4)
        return n, level

    n, level = asyncio.run(main())
    assert n == 64
    assert level.num_requests == 4 and level.output_tokens == 20
    assert len(level.ttft_ms) == 4 and len(level.itl_ms) == 16


def test_throughput_command_prints_a_row_per_level(demo_gateway):
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "bench", "throughput", "--address", demo_gateway,
                          "--concurrency", "1,2", "--requests-per-level", "2", "--max-new-tokens", "4"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["1", "2"]
    assert "TTFT p50/p95/p99 ms" in out.stdout and "ITL p50/p95/p99 ms" in out.stdout


def test_baseline_command_prints_ratios_against_transformers():
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "bench", "baseline", "--concurrency", "2",
                          "--requests", "2", "--single-requests", "1", "--max-new-tokens", "4", "--prompt-tokens", "16",
                          "--engine-batches", "3", "--ttft-rounds", "3", "--stream-intervals", "1,2",
                          "--internal-tls-runs", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "transformers one-at-a-time" in out.stdout and "transformers static batch of 2" in out.stdout
    # what mutual TLS between the services costs: both stacks measured, the cost against its goals
    assert "plaintext (--insecure-internal)" in out.stdout and "mutual TLS (the default)" in out.stdout
    assert re.search(r"mutual TLS costs [+-][\d.]+% of end-to-end tokens/s \(goal <= 5%: (met|NOT met)\) and "
                     r"[+-][\d.]+ ms of TTFT through the gateway", out.stdout), out.stdout
    import os

    worker_threads = max(1, (os.cpu_count() or 2) - 1)  # a worker's engine process takes all cores but one
    assert f"cotserve engine only, batch 2, {worker_threads} torch thread" in out.stdout
    for interval in (1, 2):  # a run through the gateway per stream interval, compared with the engine alone
        assert f"cotserve via gateway, concurrency 2, stream interval {interval}" in out.stdout
        assert re.search(rf"end to end \(stream interval {interval}\) / engine only on \d+ threads? \(as in the worker\): "
                         r"[\d.]+, on all \d+: [\d.]+; / transformers static batch: [\d.]+", out.stdout), out.stdout
    # the first interval again with a GenerateStream call per request (the others from one Session call)
    assert "cotserve via gateway, concurrency 2, stream interval 1, a call per request" in out.stdout
    assert re.search(r"end to end \(stream interval 1, a call per request\) / engine only", out.stdout), out.stdout
    # seven ratio cells (three gateway runs, the engine on all cores and on the worker's, transformers twice),
    # and FP8 / native, native / per operation, native / torch layer ops, native / compiled, native / eager of the
    # engine at batch 3
    assert out.stdout.count("x │") == 12
    assert "CPU ms/token, stream interval 1" in out.stdout and "CPU ms/token, stream interval 2" in out.stdout
    assert "CPU ms/token, stream interval 1, a call per request" in out.stdout
    # engine only, batch 3: each kernel setting, and the linear layers' ceiling
    assert re.search(r"│\s+3 │\s+\d+ │\s+\d+ │\s+\d+ │\s+\d+ │\s+\d+ │\s+\d+ │\s+[\d.]+x │\s+[\d.]+x │\s+[\d.]+x │\s+[\d.]+x │"
                     r"\s+[\d.]+x │\s+\d+ │"
                     r"\s+\d+% │",
                     out.stdout), out.stdout
    assert re.search(r"the model's linear layers alone \(its weight shapes, hot in cache, nothing else\) on \d+ threads?: "
                     r"[\d,]+ tok/s at \d+ GFLOP/s; the engine alone as the worker runs it reaches \d+% of that ceiling",
                     out.stdout), out.stdout
    # the TTFT the gateway adds, against a bare relay (one more grpc.aio hop alone) and a gateway calling per request
    assert re.search(r"TTFT p50, one request at a time: worker direct [\d.]+ ms, via a bare gRPC relay [\d.]+ ms "
                     r"\(one more hop, a call per request: \+-?[\d.]+ ms\), via the gateway [\d.]+ ms: the gateway adds "
                     r"-?[\d.]+ ms \(goal <= 1 ms: (met|NOT met)\), -?[\d.]+ ms over the bare relay; calling the worker "
                     r"per request \(--no-worker-multiplex\) it adds -?[\d.]+ ms", out.stdout), out.stdout
    # and with both ends on long-lived calls: the worker's Multiplex against the gateway's Session
    assert re.search(r"TTFT p50 over long-lived calls at both ends: the worker's Multiplex [\d.]+ ms, the gateway's "
                     r"Session [\d.]+ ms: the gateway adds -?[\d.]+ ms \(goal <= 1 ms: (met|NOT met)\)", out.stdout), out.stdout
    for process in ("worker (gRPC front)", "worker (engine process)", "gateway", "load generator (this process)"):
        assert process in out.stdout


def test_engine_only_reports_an_engine_failure_instead_of_waiting_forever(monkeypatch):
    """A step that fails fails its requests; the engine-only run raises with the reason (it used to wait for the
    warm-up request to finish, forever)."""
    from cotserve.bench.baseline import run_engine_only
    from cotserve.worker.config import DEMO_MODEL
    from cotserve.worker.model_runner import ModelRunner

    def broken(self, batch):
        raise RuntimeError("boom in the step")

    monkeypatch.setattr(ModelRunner, "execute", broken)
    with pytest.raises(RuntimeError, match="engine only, batch 2: the engine failed .*boom in the step"):
        run_engine_only(DEMO_MODEL, list(range(5, 21)), 4, 4, 2)


def test_linear_ceiling_counts_every_multiply_of_the_workload():
    """The ceiling's rate and FLOPs agree with the model's shapes: per output token, every layer's weights once per
    prompt and new token and the LM head once per new token, two FLOPs a multiply-add."""
    from cotserve.bench.baseline import linear_ceilings
    from cotserve.worker.config import DEMO_MODEL
    from cotserve.worker.models.config import ModelConfig

    cfg = ModelConfig.from_file(DEMO_MODEL / "config.json")
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = h * (q + 2 * kv) + q * h + h * 2 * i + i * h  # q/k/v, o, gate/up, down
    prompt, new = 16, 4
    flops_per_token = 2 * (cfg.num_layers * layer * (prompt + new) + h * cfg.vocab_size * new) / new
    c = linear_ceilings(DEMO_MODEL, prompt, new, [2])[2]
    assert c is not None and c.threads == 1 and c.tokens_per_s > 0
    assert c.gflops * 1e9 / c.tokens_per_s == pytest.approx(flops_per_token, rel=1e-9)


def test_isolation_drive_records_every_tenant_b_request(demo_gateway):
    from cotserve.bench.isolation import cpu_table, drive, goals, summarize
    from cotserve.common.sampling import SlaClass

    run = asyncio.run(drive(demo_gateway, duration_s=1.0, flood_concurrency=2, interactive_rps=4.0, realtime_rps=2.0))
    assert run.flood_tokens > 0 and run.seconds >= 1.0
    for cls in (SlaClass.INTERACTIVE, SlaClass.REALTIME):
        assert run.by_class[cls], cls
        assert all(r.error is None and r.tokens == (32 if cls == SlaClass.INTERACTIVE else 16) for r in run.by_class[cls])
    assert run.total_tokens_per_s > 0
    # both clients' CPU in B's window is measured (this process and the flood's)
    assert set(run.cpu_s) == {"tenant B's client", "tenant A's flood client"}
    assert run.cpu_s["tenant B's client"] > 0 and run.cpu_s["tenant A's flood client"] > 0
    summarize([run])
    cpu_table([run])
    assert len(goals(run, run, run)) == 3


def test_a_flood_of_votes_runs_as_its_tenant_and_reaches_the_worker_as_samples(demo_gateway):
    """The tenant-fairness mode's flood: INTERACTIVE votes (its tokens counted, many samples each), beside tenant B."""
    from cotserve.bench.isolation import drive, fairness_goals
    from cotserve.common.sampling import SlaClass

    run = asyncio.run(drive(demo_gateway, duration_s=1.0, flood_concurrency=1, interactive_rps=4.0, realtime_rps=2.0,
                            flood_votes=8))
    assert run.flood_tokens > 0 and run.by_class[SlaClass.INTERACTIVE]
    assert all(r.error is None for r in run.by_class[SlaClass.INTERACTIVE])
    (line,) = fairness_goals(run, run, run)
    assert line.startswith("tenant B's INTERACTIVE p99 TTFT under tenant A's votes / alone: 1.00x with fair shares")


def test_moe_benches_run_end_to_end():
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "bench", "moe", "--workers", "2", "--updates", "5"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "propagation to all 2 workers over 5 updates: p50" in out.stdout
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "bench", "moe-balance", "--timeout-s", "3"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "before: balancedness per layer" in out.stdout and "mean KL(unbiased || balanced)" in out.stdout


def test_telemetry_bench_sends_every_span_to_both_receivers():
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "bench", "telemetry", "--batches", "5"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "2520 spans in batches of 504" in out.stdout and "null-receiver" in out.stdout and "1.00x" in out.stdout
    # 6 exports (one warm-up) of 56 request traces each, every one aggregated, none malformed
    assert "{'spans_received': 3024, 'spans_malformed': 0, 'requests_aggregated': 336}" in out.stdout


def test_kv_bench_runs_every_cache_under_one_budget():
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "bench", "kv", "--contexts", "64", "--requests", "8",
                          "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr + out.stdout
    rows = {line.split("│")[2].strip(): line for line in out.stdout.splitlines() if line.startswith("│")}
    assert set(rows) == {"full precision", "fp16", "fp8", "fp8 + top-4 pages"}
    held = {name: int(line.split("│")[4]) for name, line in rows.items()}
    assert held["full precision"] == 16 and held["fp16"] == 32 and held["fp8"] == 62  # (64 + 2) vs 256 bytes per element
    assert "3.88x" in rows["fp8"]


def test_reasoning_bench_runs_every_method_and_prints_its_goals():
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "bench", "reasoning", "--problems", "6", "--concurrency", "3"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    for row in ("greedy", "maj@8 (baseline)", "budget 25% of median", "budget 75% of median", "early exit",
                "adaptive SC (window)", "adaptive SC (posterior)", "adaptive SC + early exit"):
        assert row in out.stdout, row
    assert out.stdout.count("met: ") == 3  # "met: " or "NOT met: ", one line per goal


def test_faults_bench_kills_a_worker_and_reports_its_table():
    """A SIGKILLed worker is restarted by the stack's supervisor; only requests in flight on it fail, none hangs,
    nothing leaks (the figures themselves are the closing note's, not asserted beyond that)."""
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "bench", "faults", "--targets", "worker,redis",
                          "--modes", "kill", "--settle-s", "1"], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in out.stdout.splitlines() if line.startswith("│")}
    assert set(rows) == {"worker", "redis"}
    for target, (fault, requests, failed, unexpected, never, again, kv, leases) in rows.items():
        assert fault == "SIGKILL" and int(requests) > 0 and unexpected == "0" and never == "0" and kv == "0"
        assert again != "never"
    assert "goals: never answered = 0: True; unexpected failures = 0: True; no leaks: True" in out.stdout


def test_families_command_runs_every_registered_architecture():
    """`bench families` makes a checkpoint of each family the worker registers and prints the engine against
    transformers for each (a small shape: the command's behaviour, not its figures)."""
    from cotserve.worker.models.registry import supported

    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "bench", "families", "--hidden", "64", "--layers", "1",
                          "--heads", "4", "--intermediate", "128", "--batches", "1,2", "--prompt-tokens", "8",
                          "--max-new-tokens", "4"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr + out.stdout
    from cotserve.bench.families import Shape, family_configs

    made = {type(c).__name__.replace("Config", "ForCausalLM") for c in family_configs(Shape(64, 1, 4, 2, 128)).values()}
    assert made == set(supported()) - {"MistralForCausalLM"}  # Mistral is Llama's code with a sliding window
    for family in ("Llama", "Qwen2", "Qwen3", "Phi3 (partial rotary 0.75)", "Mixtral", "Qwen3-MoE"):
        assert re.search(rf"│ {re.escape(family)} +│ +\d+M │ +[\d,]+ │ +[\d,]+ │ +[\d,]+ │ +[\d.]+x │", out.stdout), out.stdout
