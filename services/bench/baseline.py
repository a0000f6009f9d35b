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
