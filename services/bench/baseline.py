"""`cotserve bench baseline`: the same workload with transformers' `generate` on the same checkpoint.

Needs the dev extra (transformers). Runs transformers one request at a time and statically
batched, then the same load through cotserve's gateway, and prints cotserve's throughput as a
ratio of each. Every prompt has the same length, so static batching needs no padding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch


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
                    batch_size: int, threads: int | None = None) -> BaselineResult:
    """cotserve's engine alone, in this process (no gRPC, no gateway, no worker front): `num_requests` greedy
    requests, all submitted at once, batched `batch_size` at a time by the scheduler (continuous batching), on
    `threads` torch threads (default: as this process has them)."""
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        result = _run_engine_only(model_dir, prompt_ids, max_new_tokens, num_requests, batch_size)
    finally:
        torch.set_num_threads(saved)
    if threads is None:
        return result
    return BaselineResult(f"{result.name}, {threads} torch thread{'s' * (threads > 1)}", result.num_requests,
                          result.seconds, result.output_tokens)


def _run_engine_only(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, num_requests: int,
                     batch_size: int) -> BaselineResult:
    from cotserve.common.sampling import SamplingParams
    from cotserve.worker.engine import Engine
    from cotserve.worker.models.loader import load_model
    from cotserve.worker.config import WorkerConfig
    from cotserve.worker.sizing import engine_config

    loaded = load_model(model_dir)
    engine = Engine(loaded, engine_config(WorkerConfig(model=model_dir, max_num_seqs=batch_size), loaded))
    engine.runner.warmed.wait(600)  # the CPU kernels compiled: measure what a warmed-up worker runs
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    counts = {"tokens": 0, "finished": 0}
    start = 0.0

    def sink(out) -> None:  # on the engine's loop, which runs on this thread (as in the engine process)
        nonlocal start
        if out.request_id == "warm-up":
            if out.is_last:  # warmed up: the measured requests, all at once
                start = time.perf_counter()
                for i in range(num_requests):
                    engine.submit(f"r{i}", prompt_ids, params, sink)
            return
        counts["tokens"] += 1
        if out.is_last or out.error:
            counts["finished"] += 1
            if counts["finished"] == num_requests:
                engine.stop()

    engine.submit("warm-up", prompt_ids, SamplingParams(max_new_tokens=2, ignore_eos=True), sink)
    engine.run()
    seconds = time.perf_counter() - start
    return BaselineResult(f"cotserve engine only, batch {batch_size}", num_requests, seconds, counts["tokens"])


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


async def ttft_direct_and_via_gateway(gateway: str, worker: str, prompt: str, rounds: int) -> tuple[list[float], list[float]]:
    """Time to first token (ms) of one request at a time, alternating: straight to the worker over gRPC, and
    through the gateway with the SDK (what the gateway adds: auth, validation, admission, routing, one more hop)."""
    import grpc

    from cotserve.bench.throughput import first_token_ms
    from cotserve.common.v1 import common_pb2
    from cotserve.sdk import AsyncClient
    from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

    sampling = common_pb2.SamplingParams(max_new_tokens=1, ignore_eos=True)
    direct: list[float] = []
    via: list[float] = []
    async with AsyncClient(gateway) as client, grpc.aio.insecure_channel(worker) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)

        def one_direct():
            return first_token_ms(stub.Generate(worker_pb2.GenerateRequest(prompt_text=prompt, sampling=sampling)))

        def one_via():
            return first_token_ms(client.stream(prompt, max_new_tokens=1, ignore_eos=True))

        for _ in range(5):  # warm both paths (connections, caches)
            await one_direct()
            await one_via()
        for _ in range(rounds):
            direct.append(await one_direct())
            via.append(await one_via())
    return direct, via
