"""`cotserve bench kv`: the same load under the same KV memory budget, once per cache configuration.

The engine runs in this process (no gRPC, so the cache is what differs): `requests` requests of
`context` tokens each (prompt + generated, end-of-sequence ignored) are all submitted at once;
the engine steps until every one is done. Reported per configuration: the sequences of that length
the budget holds at once, the preemptions the run needed, output tokens/s over the run and the mean
inter-token latency (mean step time while every running sequence decodes), as ratios against the
full-precision cache. On CPU the FP8 cache runs the torch reference (dequantization compiled by
torch.compile; with top-k only the selected pages are gathered). A CPU running a small model is
compute-bound, so a bigger batch buys little throughput there: the memory effect shows, the
bandwidth effect a GPU kernel gets from reading fewer bytes does not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cotserve.common.sampling import SamplingParams
from cotserve.worker.engine import Engine
from cotserve.worker.engine_config import EngineConfig
from cotserve.worker.kv_spec import KvCacheSpec
from cotserve.worker.models.loader import LoadedModel


@dataclass(slots=True, frozen=True)
class KvRun:
    config: str
    context: int
    num_blocks: int
    fit: int            # sequences of `context` tokens the pool holds at once
    preemptions: int    # sequences evicted (and recomputed) because the pool ran out
    tokens_per_s: float
    itl_ms: float
    seconds: float


def budget_for(loaded: LoadedModel, sequences: int, context: int, block_size: int = 16) -> int:
    """Bytes of a full-precision (fp32) cache that hold `sequences` sequences of `context` tokens."""
    blocks = -(-context // block_size) * sequences
    return blocks * block_size * KvCacheSpec.resolve(loaded.config, loaded.dtype, "fp32", block_size).bytes_per_token


def run_one(loaded: LoadedModel, name: str, kv_dtype: str, topk: int, kv_bytes: int, context: int, requests: int,
            prompt_ids: list[int], block_size: int = 16) -> KvRun:
    num_blocks = kv_bytes // KvCacheSpec.resolve(loaded.config, loaded.dtype, kv_dtype, block_size, topk_pages=topk).bytes_per_block
    cfg = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=requests,
                       max_num_batched_tokens=2048, max_model_len=loaded.config.max_context, kv_cache_dtype=kv_dtype,
                       kv_topk_pages=topk)
    engine = Engine(loaded, cfg)
    engine.runner.warmed.wait(600)  # measure the compiled kernels, not the seconds while they compile
    new_tokens = context - len(prompt_ids)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    generated = [0]

    def sink(out) -> None:
        generated[0] += 1

    for i in range(requests):
        engine.submit(f"r{i}", prompt_ids, params, sink)
    engine.drain_inbox(block=False)
    decode_steps, decode_s = 0, 0.0
    start = time.perf_counter()
    while engine.scheduler.has_work():
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        running = len(engine.scheduler.running)
        if running and all(s.num_computed_tokens >= len(s.prompt_ids) for s in engine.scheduler.running):
            decode_steps += 1
            decode_s += dt
    seconds = time.perf_counter() - start
    fit = num_blocks // -(-context // block_size)
    return KvRun(name, context, num_blocks, fit, engine.stats().num_preemptions_total, generated[0] / seconds,
                 1000 * decode_s / max(1, decode_steps), seconds)
