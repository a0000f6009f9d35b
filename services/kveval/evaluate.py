"""`cotserve kv eval` and `cotserve kv calibrate`: what a compressed KV cache costs in quality.

The same tokens go through the worker's own model runner (paged cache, the kernels the worker
would use) once per cache configuration: the first `context - eval_tokens` tokens as a chunked
prefill, then one decode step per remaining token, fed the true next token (teacher forcing), so
every decode step reads the cache the way serving does, top-k page selection included. Each
configuration is compared with the full-precision cache on the same tokens: perplexity and its
relative change, mean per-token KL(full || config), top-1 next-token agreement, and the bytes of
KV a decode step reads: the pages it attends to (all, or the top-k selected ones) in the cache's
format, scales included, plus with top-k the page key min/max it scores every page with (float32).
That is what the decode kernel moves; the CPU reference also gathers only the selected pages.
Several windows of the text (`windows`) are measured and pooled, so agreement is not decided by a
few dozen tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cotserve.common.sampling import SamplingParams
from cotserve.worker.kv_spec import KvCacheSpec
from cotserve.worker.model_runner import ModelRunner
from cotserve.worker.models.loader import LoadedModel
from cotserve.worker.scheduler import ScheduledBatch, ScheduledSeq
from cotserve.worker.sequence import Sequence


@dataclass(slots=True, frozen=True)
class CacheConfig:
    name: str
    kv_dtype: torch.dtype | None  # None: the model's dtype
    topk_pages: int = 0
    skip_layers: frozenset[int] = frozenset()
    topk_dense_layers: frozenset[int] = frozenset()  # layers that read every page despite top-k


@dataclass(slots=True, frozen=True)
class EvalRow:
    config: str
    context: int
    tokens: int
    perplexity: float
    ppl_change: float       # relative to the full-precision cache
    mean_kl: float
    top1_agreement: float
    bytes_per_step: float   # KV bytes one decode step reads, averaged over the evaluated steps
    bytes_fraction: float   # of the full-precision cache's


def decode_logprobs(loaded: LoadedModel, tokens: list[int], prefill: int, cfg: CacheConfig, block_size: int = 16,
                    chunk: int = 512) -> tuple[torch.Tensor, float]:
    """([len(tokens) - prefill, vocab] log-probabilities of each next token, mean KV bytes read per decode step)."""
    blocks = -(-len(tokens) // block_size) + 1
    spec = KvCacheSpec.resolve(loaded.config, loaded.dtype, cfg.kv_dtype or loaded.dtype, block_size, cfg.skip_layers,
                               cfg.topk_pages, cfg.topk_dense_layers)
    runner = ModelRunner(loaded, blocks, spec)
    runner.warmed.wait(600)  # every configuration on the same (compiled) kernels: comparisons see only the cache format
    seq = Sequence("kv-eval", prompt_ids=list(tokens[:prefill]), params=SamplingParams())
    seq.block_table = list(range(blocks))
    out, read = [], []
    layer_pages = [block_size * b for b in spec.layer_bytes_per_token()]
    sparse = [not layer.dense for layer in spec.layers]
    bounds_bytes = spec.page_bounds_bytes  # one layer's page key min/max: read for every page scored
    while seq.num_computed_tokens < prefill:
        n = min(chunk, prefill - seq.num_computed_tokens)
        logits = runner.execute(ScheduledBatch([ScheduledSeq(seq, n)]))
        seq.num_computed_tokens += n
    out.append(torch.log_softmax(logits[0].float(), -1))
    for t in range(prefill, len(tokens) - 1):
        seq.output_ids.append(tokens[t])
        logits = runner.execute(ScheduledBatch([ScheduledSeq(seq, 1)]))
        seq.num_computed_tokens += 1
        out.append(torch.log_softmax(logits[0].float(), -1))
        pages = -(-(t + 1) // block_size)
        read.append(sum(pb * min(pages, cfg.topk_pages) + bounds_bytes * pages if sp else pb * pages
                        for pb, sp in zip(layer_pages, sparse)))
    return torch.stack(out), (sum(read) / len(read) if read else 0.0)


def compare(full: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float, float]:
    """(perplexity of full, perplexity of other, mean KL(full || other), top-1 agreement)."""
    nll_full = -full.gather(1, targets[:, None]).mean().item()
    nll_other = -other.gather(1, targets[:, None]).mean().item()
    kl = (full.exp() * (full - other)).sum(-1).mean().item()
    agree = (full.argmax(-1) == other.argmax(-1)).float().mean().item()
    return math.exp(nll_full), math.exp(nll_other), kl, agree


def standard_configs(pages: int, dense_layers: frozenset[int] = frozenset()) -> list[CacheConfig]:
    """Full precision, fp8, and fp8 + top-k at 1/8, 1/4 and 1/2 of the context's pages (at least 2),
    the top-k ones with `dense_layers` reading every page."""
    fp8 = torch.float8_e4m3fn
    dense = f", layers {','.join(map(str, sorted(dense_layers)))} dense" if dense_layers else ""
    return [CacheConfig("full precision", None), CacheConfig("fp8", fp8)] + [
        CacheConfig(f"fp8 + top-{max(2, pages // d)} pages (1/{d}){dense}", fp8, max(2, pages // d), topk_dense_layers=dense_layers)
        for d in (8, 4, 2)]


def windows_of(tokens: list[int], context: int, windows: int) -> list[list[int]]:
    """`windows` windows of `context` tokens, evenly spaced over the text (overlapping only when the
    text is shorter than windows x context)."""
    if context > len(tokens):
        raise ValueError(f"context: {context} tokens asked, the text has {len(tokens)}")
    last = len(tokens) - context
    starts = sorted({round(i * last / max(1, windows - 1)) for i in range(windows)}) if windows > 1 else [0]
    return [tokens[s : s + context] for s in starts]


def evaluate_cache(loaded: LoadedModel, tokens: list[int], contexts: list[int], eval_tokens: int, block_size: int = 16,
                   configs_for=standard_configs, progress=lambda msg: None, windows: int = 1) -> list[EvalRow]:
    rows = []
    for context in contexts:
        if context > loaded.config.max_context:
            raise ValueError(f"context: {context} exceeds the model's {loaded.config.max_context} tokens")
        n_eval = min(eval_tokens, context - 1)
        spans = windows_of(tokens, context, windows)
        targets = torch.cat([torch.tensor(w[context - n_eval:]) for w in spans])
        results = {}
        for cfg in configs_for(-(-context // block_size)):
            progress(f"context {context}: {cfg.name}, {len(spans)} window(s) ...")
            parts = [decode_logprobs(loaded, w, context - n_eval, cfg, block_size) for w in spans]
            results[cfg.name] = (torch.cat([lp for lp, _ in parts]), sum(b for _, b in parts) / len(parts))
        full_lp, full_bytes = next(iter(results.values()))
        for name, (lp, nbytes) in results.items():
            ppl_full, ppl, kl, agree = compare(full_lp, lp, targets)
            rows.append(EvalRow(name, context, len(targets), ppl, ppl / ppl_full - 1, kl, agree, nbytes,
                                nbytes / full_bytes if full_bytes else math.nan))
    return rows


def calibrate(loaded: LoadedModel, tokens: list[int], context: int, eval_tokens: int, block_size: int = 16) -> list[tuple[int, float]]:
    """(layer, mean KL(full || only this layer in FP8)) for every layer, most sensitive first."""
    layers = range(loaded.config.num_layers)
    window = tokens[:context]
    n_eval = min(eval_tokens, context - 1)
    full, _ = decode_logprobs(loaded, window, context - n_eval, CacheConfig("full", None), block_size)
    out = []
    for layer in layers:
        only = CacheConfig(f"fp8 layer {layer}", torch.float8_e4m3fn, skip_layers=frozenset(set(layers) - {layer}))
        lp, _ = decode_logprobs(loaded, window, context - n_eval, only, block_size)
        out.append((layer, compare(full, lp, torch.tensor(window[context - n_eval:]))[2]))
    return sorted(out, key=lambda lk: -lk[1])
