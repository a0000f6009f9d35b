"""Attention backends the model calls per layer: paged (serving) and dense causal (training).

The model code is written once against `attend(layer, q, k, v)` over a flat token dimension, so
the same layers serve a continuous batch of ragged sequences and train on a padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from cotserve.kernels.dispatch import KernelSet


class AttentionBackend(Protocol):
    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


@dataclass(slots=True)
class DenseCausalAttention:
    """Plain causal self-attention over `batch` rows of `seq_len` tokens each (no cache)."""

    batch: int
    seq_len: int

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        group = num_heads // k.shape[1]

        def rows(x: torch.Tensor) -> torch.Tensor:  # [b, heads, len, dim]
            return x.view(self.batch, self.seq_len, x.shape[1], head_dim).transpose(1, 2)

        kk, vv = rows(k), rows(v)
        if group > 1:
            kk, vv = kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(rows(q), kk, vv, is_causal=True)
        return out.transpose(1, 2).reshape(-1, num_heads, head_dim)


@dataclass(slots=True)
class PagedBatch:
    """Where each scheduled sequence's tokens sit in the flat batch and in the cache.

    Decode rows (one query each) are attended together; each prefill chunk attends on its own,
    which bounds the padded score tensor by one chunk rather than the whole batch.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode_token_idx: torch.Tensor  # [num_decode] int64 into the flat batch
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int64
    decode_context_lens: torch.Tensor  # [num_decode] int64
    prefill_rows: list[tuple[int, int, torch.Tensor, int]]  # (start, query_len, block_table [1, n], context_len)
    fresh_page: torch.Tensor | None = None  # [num_tokens] bool: the token is its page's first (resets page bounds)


@dataclass(slots=True)
class PagedAttention:
    """Attention that writes new K/V into the paged cache and reads through block tables."""

    kv_caches: list[tuple]  # per layer: (k, v) [num_blocks, block_size, kv_heads, dim], or FP8 (k, v, k_scale, v_scale)
    batch: PagedBatch
    kernels: KernelSet
    scale: float
    page_bounds: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: key min/max [num_blocks, kv_heads, dim]
    topk_pages: int = 0  # decode reads only this many pages per KV head (0: all)
    dense_layers: frozenset[int] = frozenset()  # layers that read every page even with topk_pages

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        entry = self.kv_caches[layer]
        k_cache, v_cache = entry[0], entry[1]
        k_scale, v_scale = (entry[2], entry[3]) if len(entry) == 4 else (None, None)
        bounds = self.page_bounds[layer] if self.page_bounds else (None, None)
        self.kernels.write_kv(k, v, k_cache, v_cache, b.slot_mapping, k_scale, v_scale, *bounds, b.fresh_page)
        out = torch.empty_like(q)
        if b.decode_token_idx.numel():
            dq = q.index_select(0, b.decode_token_idx)  # [num_decode, heads, dim]
            pages = None
            if self.topk_pages and self.page_bounds and layer not in self.dense_layers:
                pages = self.kernels.select_pages(dq, *bounds, b.decode_block_tables, b.decode_context_lens,
                                                  self.topk_pages, k_cache.shape[1])
            res = self.kernels.decode_attention(dq, k_cache, v_cache, b.decode_block_tables, b.decode_context_lens,
                                                self.scale, k_scale, v_scale, pages)
            out.index_copy_(0, b.decode_token_idx, res)
        for start, qlen, table, ctx in b.prefill_rows:
            dev = q.device
            ctx_t, qlen_t = torch.tensor([ctx], device=dev), torch.tensor([qlen], device=dev)
            query = q[start : start + qlen].unsqueeze(0)
            if k_scale is not None:
                res = self.kernels.paged_attention_fp8(query, k_cache, v_cache, k_scale, v_scale, table, ctx_t, qlen_t, self.scale)
            else:
                res = self.kernels.paged_attention(query, k_cache, v_cache, table, ctx_t, qlen_t, self.scale)
            out[start : start + qlen] = res[0]
        return out
