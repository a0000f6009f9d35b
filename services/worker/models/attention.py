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
from cotserve.worker.kv_spec import KvCacheSpec, LayerCache


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

    caches: list[LayerCache]  # per layer
    spec: KvCacheSpec
    batch: PagedBatch
    kernels: KernelSet
    scale: float

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, c = self.batch, self.caches[layer]
        self.kernels.write_kv(k, v, c.k, c.v, b.slot_mapping, c.k_scale, c.v_scale, c.k_min, c.k_max, b.fresh_page)
        if not b.prefill_rows:  # every token a decode row, in order: no gather and scatter around the kernel
            return self._decode(layer, q)
        out = torch.empty_like(q)
        if b.decode_token_idx.numel():
            out.index_copy_(0, b.decode_token_idx, self._decode(layer, q.index_select(0, b.decode_token_idx)))
        for start, qlen, table, ctx in b.prefill_rows:
            dev = q.device
            ctx_t, qlen_t = torch.tensor([ctx], device=dev), torch.tensor([qlen], device=dev)
            query = q[start : start + qlen].unsqueeze(0)
            if c.k_scale is not None:
                res = self.kernels.paged_attention_fp8(query, c.k, c.v, c.k_scale, c.v_scale, table, ctx_t, qlen_t, self.scale)
            else:
                res = self.kernels.paged_attention(query, c.k, c.v, table, ctx_t, qlen_t, self.scale)
            out[start : start + qlen] = res[0]
        return out

    def _decode(self, layer: int, dq: torch.Tensor) -> torch.Tensor:
        """Decode attention for the batch's decode rows `dq` [num_decode, heads, dim], over all their pages or, in a
        layer that is not dense, the top-k selected ones."""
        b, c = self.batch, self.caches[layer]
        pages = None
        if not self.spec.layers[layer].dense:
            pages = self.kernels.select_pages(dq, c.k_min, c.k_max, b.decode_block_tables, b.decode_context_lens,
                                              self.spec.topk_pages, self.spec.block_size)
        return self.kernels.decode_attention(dq, c.k, c.v, b.decode_block_tables, b.decode_context_lens, self.scale,
                                             c.k_scale, c.v_scale, pages)
