"""The worker's settings (`cotserve serve worker` is generated from them): light to import, no torch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from cotserve.common.config import Cli, legacy_env
from cotserve.common.tls import TlsSettings
from cotserve.common.tools import PARSERS as TOOL_PARSERS
from cotserve.worker.scheduling import POLICIES

DEMO_MODEL = Path(__file__).parent / "demo" / "cotserve-demo"


@dataclass(slots=True)
class WorkerConfig(TlsSettings):
    """Everything `cotserve serve worker` takes: each field is one setting (`common.config`), its docstring the help."""

    model: Path = DEMO_MODEL
    """Hugging Face checkpoint folder, or the repo id (org/name) of a snapshot in the local Hugging Face cache
    (default: the bundled demo model)."""
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 50061
    """Port to bind (0 picks a free one)."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (CUDA when available)."""
    dtype: str = "auto"
    """Weights' compute dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16."""
    kv_cache_bytes: int | None = None
    """KV pool size in bytes; default: 5% of available RAM on CPU, 90% of free GPU memory on CUDA."""
    kv_cache_dtype: str = "auto"
    """KV cache element type: auto (the model's dtype), fp8_e4m3 (per-token, per-head scales), fp16, bf16, fp32."""
    kv_topk_pages: int = 0
    """Decode reads only this many KV pages per KV head (query-aware bound; first and last page always kept); 0: all."""
    kv_skip_layers: tuple[int, ...] = ()
    """With fp8_e4m3: layers whose cache keeps the model's dtype (the most sensitive ones)."""
    kv_topk_dense_layers: tuple[int, ...] = ()
    """With kv_topk_pages: layers that read every page."""
    reasoning_parser: str = "auto"
    """How the model marks its reasoning: auto (harmony for gpt-oss's tokenizer, else think where the tokenizer has
    <think> and </think>, else none), think (text between --reasoning-start and --reasoning-end: Qwen3, Phi-4-reasoning,
    DeepSeek-R1), harmony (gpt-oss's analysis and final channels) or none."""
    tool_call_parser: str = "auto"
    """How the model writes tool calls: auto (hermes when its chat template writes <tool_call>, else none: requests
    with tools are refused), hermes (<tool_call>{"name", "arguments"}</tool_call>: Qwen2.5, Qwen3, Hermes) or none."""
    reasoning_start: str | None = None
    """Text that opens the model's thinking (default: <think> when the tokenizer has it and </think>)."""
    reasoning_end: str | None = None
    """Text that closes the model's thinking (default: </think>, with <think>)."""
    reasoning_step: str | None = None
    """Text that ends one reasoning step, for max_thinking_steps (none: steps are not counted)."""
    answer_regex: str | None = None
    """Regular expression that extracts the answer from the text after the end marker (group 1, else the
    match; default: that text, stripped)."""
    enable_prefix_caching: bool = True
    """Keep full KV blocks of finished and preempted sequences and reuse them for new sequences with the same
    leading tokens and cache salt (LRU eviction)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_num_seqs: int = 64
    """Sequences in one batch at most."""
    max_num_batched_tokens: int = 2048
    """Tokens per engine step at most (bounds prefill chunks)."""
    max_model_len: int | None = None
    """Longest sequence served (default: the model's context)."""
    served_model_name: tuple[str, ...] = ()
    """Names clients use: the first is the model's name in responses, spans and metrics, the others are accepted
    too (default: the checkpoint's: its folder's name, or its repo id when it is a Hugging Face cache snapshot)."""
    batch_min_share: float = 0.1
    """Share of each step's token budget kept for BATCH work when there is any (0..1)."""
    metrics_port: int = 0
    """Port for Prometheus /metrics on `host` (0 = off)."""
    scheduling: str = "tenant-fair"
    """Scheduling policy: tenant-fair (as priority-yield, and within a class each tenant a fair share of the steps and
    of the seats: one tenant's backlog or long-running samples do not make another's requests wait behind them),
    priority-yield (SLA class, then arrival; a step that computes a REALTIME/INTERACTIVE prompt runs no BATCH work, at
    most every other step, so an urgent first token waits on urgent work only), priority (SLA class, then arrival,
    BATCH decoding beside urgent prompts) or fifo (arrival only; a baseline for benchmarks)."""
    max_batch_tokens_when_urgent: int = 256
    """BATCH tokens per step at most while REALTIME/INTERACTIVE work is present (BATCH's share still holds)."""
    redis_url: str | None = None
    """Redis of the MoE control plane (an MoE model then follows its routing policy there)."""
    worker_id: str | None = None
    """This worker's name in Redis keys (default: its address)."""
    torch_threads: int | None = None
    """CPU threads for torch (default on CPU: all cores but one, which is left to the gRPC side)."""
    grace_s: float = 5.0
    """Seconds to drain in-flight streams on SIGTERM."""
    stream_interval: int = 1
    """Tokens a stream holds before writing them as one message (the first token and the end are written at once);
    1 writes every step's token. Larger values cut the serving CPU per token on both hops (one gRPC message per
    N tokens of each sample) at the cost of burstier streams (as vLLM's and SGLang's --stream-interval)."""
    batch_stream_interval: int = 8
    """The stream interval of BATCH requests (at least stream_interval): their inter-token target is a second, so
    their tokens go out N at a time, and the CPU a flood of them costs on every hop (this worker's front, the
    gateway, the client) is left to the urgent classes; 1 streams them token by token."""
    stream_stagger: bool = True
    """Spread held streams' writes over the steps: each stream's first held message waits 1..interval tokens (dealt
    round-robin), so streams that started together do not all write in the same step; an urgent stream's token
    then never queues behind a burst of them on any hop."""
    engine_process: bool = True
    """Run the engine (model, KV cache, scheduler) in a process of its own, so that serving work in this one
    never shares a GIL with the model's steps; False: a thread of this process (for debugging)."""

    @property
    def model_names(self) -> dict:
        """`name` and `aliases` for the loaders, from served_model_name (no name: the checkpoint's own)."""
        names = self.served_model_name
        return {"name": names[0] if names else None, "aliases": tuple(names[1:])}

    @property
    def cpu_threads(self) -> int:
        """torch's threads: `torch_threads`, else (on the CPU) all cores but one, left to the gRPC side."""
        return self.torch_threads if self.torch_threads is not None else max(1, (os.cpu_count() or 2) - 1)

    CLI: ClassVar[dict[str, Cli]] = {
        **legacy_env("model", "host", "device", "dtype", "kv_cache_bytes", "kv_cache_dtype", "kv_topk_pages", "kv_skip_layers",
                     "kv_topk_dense_layers", "reasoning_start", "reasoning_end", "reasoning_step", "answer_regex", "block_size",
                     "max_num_seqs", "max_num_batched_tokens", "max_model_len", "served_model_name", "batch_min_share",
                     "scheduling", "max_batch_tokens_when_urgent", "redis_url", "worker_id", "torch_threads", "grace_s",
                     "stream_interval", "batch_stream_interval"),
        "enable_prefix_caching": Cli(flag="--prefix-caching/--no-prefix-caching", env=("COTSERVE_PREFIX_CACHING",)),
        "engine_process": Cli(flag="--engine-process/--engine-thread", env=("COTSERVE_ENGINE_PROCESS",)),
    }

    def validate(self) -> None:
        self.check_tls()
        from cotserve.worker.kv_spec import KV_CACHE_DTYPES  # (torch: imported when a config is checked, not named)
        from cotserve.worker.reasoning import PARSERS  # (tokenizers: likewise)
        from cotserve.worker.models.loader import DTYPES

        checks = [
            (self.block_size >= 1, f"block_size: {self.block_size}, must be >= 1"),
            (self.max_num_seqs >= 1, f"max_num_seqs: {self.max_num_seqs}, must be >= 1"),
            (self.max_num_batched_tokens >= 1, f"max_num_batched_tokens: {self.max_num_batched_tokens}, must be >= 1"),
            (self.kv_cache_bytes is None or self.kv_cache_bytes > 0, "kv_cache_bytes: must be > 0"),
            (self.dtype in ("auto", *DTYPES), f"dtype: {self.dtype!r}, allowed: auto, {', '.join(DTYPES)}"),
            (self.kv_topk_pages == 0 or self.kv_topk_pages >= 2, f"kv_topk_pages: {self.kv_topk_pages}, must be 0 (off) or >= 2"),
            (not self.kv_topk_dense_layers or self.kv_topk_pages > 0, "kv_topk_dense_layers: only with --kv-topk-pages > 0"),
            (not self.kv_skip_layers or self.kv_cache_dtype == "fp8_e4m3",
             "kv_skip_layers: only with --kv-cache-dtype fp8_e4m3 (other caches are full precision already)"),
            (self.kv_cache_dtype in ("auto", *KV_CACHE_DTYPES),
             f"kv_cache_dtype: {self.kv_cache_dtype!r}, allowed: auto, {', '.join(KV_CACHE_DTYPES)}"),
            (0 <= self.port <= 65535, f"port: {self.port}, allowed 0..65535"),
            (self.scheduling in POLICIES, f"scheduling: {self.scheduling!r}, allowed: {', '.join(POLICIES)}"),
            (self.reasoning_parser in PARSERS, f"reasoning_parser: {self.reasoning_parser!r}, allowed: {', '.join(PARSERS)}"),
            (self.tool_call_parser in ("auto", "none", *TOOL_PARSERS),
             f"tool_call_parser: {self.tool_call_parser!r}, allowed: auto, none, {', '.join(TOOL_PARSERS)}"),
            (self.max_batch_tokens_when_urgent >= 1,
             f"max_batch_tokens_when_urgent: {self.max_batch_tokens_when_urgent}, must be >= 1"),
            (0.0 <= self.batch_min_share <= 1.0, f"batch_min_share: {self.batch_min_share}, allowed 0..1"),
            (self.torch_threads is None or self.torch_threads >= 1, f"torch_threads: {self.torch_threads}, must be >= 1"),
            (self.stream_interval >= 1, f"stream_interval: {self.stream_interval}, must be >= 1"),
            (self.batch_stream_interval >= 1, f"batch_stream_interval: {self.batch_stream_interval}, must be >= 1"),
            (all(n.strip() for n in self.served_model_name), "served_model_name: names must not be empty"),
            (len(set(self.served_model_name)) == len(self.served_model_name),
             f"served_model_name: {list(self.served_model_name)} names a model twice"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
