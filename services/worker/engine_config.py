"""What an engine runs with (`EngineConfig`), and the checks a request must pass before any engine queues it (the
engine process's front runs them too, so that a bad submit fails at once, not one round trip later)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cotserve.common.sampling import ReasoningParams
from cotserve.worker.block_manager import capacity_tokens
from cotserve.worker.config import WorkerConfig
from cotserve.worker.kv_spec import KvCacheSpec
from cotserve.worker.sequence import SamplingParams


_WORKER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """What the engine runs with, resolved for one loaded model (`sizing.engine_config`). Every setting but the
    pool's size and the context length is a WorkerConfig field, whose default and help are the only ones."""

    num_blocks: int
    block_size: int = _WORKER_DEFAULTS["block_size"]
    max_num_seqs: int = _WORKER_DEFAULTS["max_num_seqs"]
    max_num_batched_tokens: int = _WORKER_DEFAULTS["max_num_batched_tokens"]
    max_model_len: int = 2048  # resolved: the worker's max_model_len, or the model's context when that is none
    batch_min_share: float = _WORKER_DEFAULTS["batch_min_share"]
    scheduling: str = _WORKER_DEFAULTS["scheduling"]
    max_batch_tokens_when_urgent: int = _WORKER_DEFAULTS["max_batch_tokens_when_urgent"]
    kv_cache_dtype: str = _WORKER_DEFAULTS["kv_cache_dtype"]
    kv_topk_pages: int = _WORKER_DEFAULTS["kv_topk_pages"]
    kv_skip_layers: tuple[int, ...] = _WORKER_DEFAULTS["kv_skip_layers"]
    kv_topk_dense_layers: tuple[int, ...] = _WORKER_DEFAULTS["kv_topk_dense_layers"]
    enable_prefix_caching: bool = _WORKER_DEFAULTS["enable_prefix_caching"]
    kv_group_windows: tuple[int | None, ...] = (None,)  # resolved: each KV group's sliding window (`kv_spec.KvGroup`)


def kv_spec_of(config: EngineConfig, loaded) -> KvCacheSpec:
    """The KV cache format `config`'s settings describe for this model (a `models.loader.LoadedModel`)."""
    return KvCacheSpec.resolve(loaded.config, loaded.dtype, config.kv_cache_dtype, config.block_size, config.kv_skip_layers,
                               config.kv_topk_pages, config.kv_topk_dense_layers)


def check_submit(config: EngineConfig, has_reasoning: bool, prompt_len: int, params: SamplingParams,
                 budget: ReasoningParams) -> None:
    """ValueError for a request this engine can never serve: longer than the whole KV pool, more samples than a
    batch holds, or budgets for a model without reasoning markers."""
    capacity = capacity_tokens(config.num_blocks, config.block_size, config.kv_group_windows,
                               config.max_num_batched_tokens)
    if prompt_len + params.max_new_tokens > capacity:
        raise ValueError(f"prompt_tokens + max_new_tokens = {prompt_len + params.max_new_tokens} exceeds the KV cache "
                         f"({capacity} tokens)")
    if params.n > config.max_num_seqs:
        raise ValueError(f"sampling.n: {params.n} samples, this worker batches at most {config.max_num_seqs} "
                         f"sequences (--max-num-seqs)")
    vote = budget.self_consistency
    if vote is not None and vote.min_samples > config.max_num_seqs:
        raise ValueError(f"reasoning.self_consistency.min_samples: {vote.min_samples} samples run together, this "
                         f"worker batches at most {config.max_num_seqs} sequences (--max-num-seqs)")
    if budget.is_set and not has_reasoning:
        raise ValueError("reasoning: this model has no reasoning markers (start the worker with "
                         "--reasoning-start and --reasoning-end)")


def needs_engine_text(params: SamplingParams, budget: ReasoningParams) -> bool:
    """Whether the engine must detokenize this request as it runs: a vote counts answers (and must see a sample
    end on its stop string at once), and a budget or early exit by reasoning steps counts the step delimiter in the
    text. Any other request's text, reasoning/answer split and stop strings can be handled by the caller from the
    token ids (`FrontText`, with `stop_sample`)."""
    ee = budget.early_exit
    return budget.self_consistency is not None or budget.max_thinking_steps is not None or (
        ee is not None and ee.probe_every_steps is not None)
