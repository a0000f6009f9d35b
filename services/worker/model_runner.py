"""Owns the model and the KV tensors; turns a `ScheduledBatch` into logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cotserve.kernels.dispatch import kernels_for
from cotserve.kernels.kv_fp8 import FP8
from cotserve.worker.models.attention import PagedAttention, PagedBatch
from cotserve.worker.models.config import ModelConfig
from cotserve.worker.models.loader import LoadedModel
from cotserve.worker.scheduler import ScheduledBatch


FP8_SCALE_DTYPE = torch.float16
KV_CACHE_DTYPES = {"fp8_e4m3": FP8, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype`: auto (the model's dtype), fp8_e4m3, fp16, bf16 or fp32."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {name!r}, allowed auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def layer_kv_dtypes(cfg: ModelConfig, kv_dtype: torch.dtype, model_dtype: torch.dtype, skip_layers=()) -> list[torch.dtype]:
    """Each layer's cache dtype: FP8 layers listed in `skip_layers` keep the model's dtype."""
    return [model_dtype if kv_dtype == FP8 and layer in skip_layers else kv_dtype for layer in range(cfg.num_layers)]


def layer_kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype, model_dtype: torch.dtype | None = None,
                             skip_layers=()) -> list[int]:
    """Keys and values of one token in each layer; for FP8 the per-token, per-head scales included."""
    out = []
    for dtype in layer_kv_dtypes(cfg, kv_dtype, model_dtype or kv_dtype, skip_layers):
        per_head = cfg.head_dim * torch.empty((), dtype=dtype).element_size()
        if dtype == FP8:
            per_head += torch.empty((), dtype=FP8_SCALE_DTYPE).element_size()
        out.append(2 * cfg.num_kv_heads * per_head)
    return out


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype, model_dtype: torch.dtype | None = None, skip_layers=()) -> int:
    """Keys and values of one token across all layers."""
    return sum(layer_kv_bytes_per_token(cfg, kv_dtype, model_dtype, skip_layers))


PAGE_BOUNDS_DTYPE = torch.float32  # per-page key min/max that top-k page selection scores


def page_bounds_bytes(cfg: ModelConfig) -> int:
    """One layer's key min and max of one page, every KV head."""
    return 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=PAGE_BOUNDS_DTYPE).element_size()


def kv_bytes_per_block(cfg: ModelConfig, kv_dtype: torch.dtype, block_size: int, model_dtype: torch.dtype | None = None,
                       skip_layers=(), topk_pages: int = 0) -> int:
    """One KV block across all layers: its tokens' keys, values and FP8 scales, plus with top-k page
    selection the page's key min/max in every layer."""
    bounds = cfg.num_layers * page_bounds_bytes(cfg) if topk_pages else 0
    return block_size * kv_bytes_per_token(cfg, kv_dtype, model_dtype, skip_layers) + bounds


@dataclass(slots=True)
class PreparedInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    paged: PagedBatch
    sample_rows: torch.Tensor  # [num_sampled] index of each sampling sequence's last token


class ModelRunner:
    """Runs one forward pass for a batch of ragged sequences over the paged KV cache."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None,
                 topk_pages: int = 0, skip_layers: frozenset[int] = frozenset(), topk_dense_layers: frozenset[int] = frozenset()) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.block_size = block_size
        self.kv_dtype = kv_dtype or loaded.dtype
        self.kernels = kernels_for(self.device)
        cfg = self.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)

        def zeros(s: tuple, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(s, dtype=dtype, device=self.device)

        self.skip_layers = skip_layers
        self.kv_caches = []  # per layer: (k, v), or for FP8 (k, v, k_scale, v_scale)
        for dtype in layer_kv_dtypes(cfg, self.kv_dtype, loaded.dtype, skip_layers):
            if dtype == FP8:
                self.kv_caches.append((zeros(shape, FP8), zeros(shape, FP8), zeros(shape[:3], FP8_SCALE_DTYPE),
                                       zeros(shape[:3], FP8_SCALE_DTYPE)))
            else:
                self.kv_caches.append((zeros(shape, dtype), zeros(shape, dtype)))
        self.scale = cfg.head_dim ** -0.5
        if self.device.type == "cpu":
            self._warm_up_kernels(loaded.dtype)
        self.topk_pages = topk_pages
        self.topk_dense_layers = topk_dense_layers  # layers that read every page despite top-k (Quest: the first two)
        # per-page key min/max, kept only when decode selects pages ([num_blocks, kv_heads, dim] x2 per layer)
        self.page_bounds = [(zeros(shape[:1] + shape[2:], PAGE_BOUNDS_DTYPE), zeros(shape[:1] + shape[2:], PAGE_BOUNDS_DTYPE))
                            for _ in range(cfg.num_layers)] if topk_pages else None

    def prepare_inputs(self, batch: ScheduledBatch) -> PreparedInputs:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        fresh: list[bool] = []
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_ctx: list[int] = []
        prefill_rows: list[tuple[int, int, torch.Tensor, int]] = []
        sample_rows: list[int] = []
        bs = self.block_size
        for item in batch.items:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_tokens
            offset = len(ids)
            tokens = seq.all_token_ids[start : start + n]
            ids.extend(tokens)
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            fresh.extend(p % bs == 0 for p in range(start, start + n))
            ctx = start + n
            if n == 1:
                decode_idx.append(offset)
                decode_tables.append(table[: (ctx + bs - 1) // bs])
                decode_ctx.append(ctx)
            else:
                t = torch.tensor([table[: (ctx + bs - 1) // bs]], dtype=torch.int64, device=self.device)
                prefill_rows.append((offset, n, t, ctx))
            if item.samples:
                sample_rows.append(offset + n - 1)
        width = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        dev = self.device

        def as_long(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=dev)

        paged = PagedBatch(
            slot_mapping=as_long(slots),
            decode_token_idx=as_long(decode_idx),
            decode_block_tables=as_long(padded).view(len(padded), width),
            decode_context_lens=as_long(decode_ctx),
            prefill_rows=prefill_rows,
            fresh_page=torch.tensor(fresh, dtype=torch.bool, device=dev),
        )
        return PreparedInputs(as_long(ids), as_long(positions), paged, as_long(sample_rows))

    @torch.inference_mode()
    def _warm_up_kernels(self, model_dtype: torch.dtype) -> None:
        """Compile the CPU kernels now (seconds; inductor caches the code on disk, so a restart is quicker)
        rather than in the first requests: decode attention once per cache format in use (every shape
        reuses that code), FP8 dequantization for one and for several rows (torch specialises a size of 1)."""
        from cotserve.kernels.kv_fp8 import dequantize_fast

        cfg = self.config
        done: set[torch.dtype] = set()
        for entry in self.kv_caches:
            if entry[0].dtype in done:
                continue
            done.add(entry[0].dtype)
            scales = (entry[2], entry[3]) if len(entry) == 4 else (None, None)
            query = torch.zeros(2, cfg.num_heads, cfg.head_dim, dtype=model_dtype, device=self.device)
            tables = torch.zeros(2, 3, dtype=torch.int64, device=self.device)
            ones = torch.ones(2, dtype=torch.int64, device=self.device)
            self.kernels.decode_attention(query, entry[0], entry[1], tables, ones, self.scale, *scales)
            if len(entry) == 4:
                for rows in (1, 2):
                    shape = (rows, cfg.num_kv_heads, 3)
                    dequantize_fast(torch.zeros(*shape, cfg.head_dim, dtype=FP8), torch.ones(shape, dtype=FP8_SCALE_DTYPE))

    def cache_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block: payloads, FP8 scales, page bounds."""
        out = [t for entry in self.kv_caches for t in entry]
        return out + [t for pair in self.page_bounds for t in pair] if self.page_bounds else out

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Execute the block manager's planned copies in order (copy-on-write, compaction): copies
        go to the kernel in waves in which no destination is also a source."""
        tensors = self.cache_tensors()
        i = 0
        while i < len(copies):
            srcs, dsts = set(), set()
            j = i
            while j < len(copies) and copies[j][0] not in dsts and copies[j][1] not in srcs | dsts:
                srcs.add(copies[j][0])
                dsts.add(copies[j][1])
                j += 1
            wave = torch.tensor(copies[i:j], dtype=torch.int64, device=self.device)
            self.kernels.copy_blocks(tensors, wave[:, 0].contiguous(), wave[:, 1].contiguous())
            i = j

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:  # [num_sampled, vocab] float32
        if batch.block_copies:
            self.copy_blocks(batch.block_copies)
        inputs = self.prepare_inputs(batch)
        attn = PagedAttention(self.kv_caches, inputs.paged, self.kernels, self.scale, self.page_bounds, self.topk_pages,
                              self.topk_dense_layers)
        hidden = self.model(inputs.input_ids, inputs.positions, attn)
        return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows)).float()
