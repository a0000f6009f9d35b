"""Attention backends the model calls per layer: paged (serving) and dense causal (training).

The model code is written once against `attend(layer, q, k, v)` over a flat token dimension, so
the same layers serve a continuous batch of ragged sequences and train on a padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from cotserve.kernels.dispatch import KernelSet
from cotserve.kernels.kv_fp8 import FP8, dequantize_fast, pages_key_mask, write_kv_ref
from cotserve.kernels.paged_attention import attend_gathered, gather_pages
from cotserve.worker.kv_spec import KvCacheSpec, LayerCache


Expand = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class AttentionBackend(Protocol):
    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        window: int | None = None,  # the layer's sliding window (`ModelConfig.window`)
        sinks: torch.Tensor | None = None,  # [num_heads]: the layer's attention sinks (`ModelConfig.attention_sinks`)
        expand: Expand | None = None,  # latent attention (`models/mla.py`): k and v are what the cache holds, and
        # expand(k rows, v rows) -> every head's keys and values, [batch, heads, ctx, dim] each
        scale: float | None = None,  # the softmax scale, when not head_dim ** -0.5
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] (latent attention: the values' head_dim)
        ...


@dataclass(slots=True)
class DenseCausalAttention:
    """Plain causal self-attention over `batch` rows of `seq_len` tokens each (no cache)."""

    batch: int
    seq_len: int

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
               sinks: torch.Tensor | None = None, expand: Expand | None = None,
               scale: float | None = None) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        group = num_heads // k.shape[1]

        def rows(x: torch.Tensor) -> torch.Tensor:  # [b, heads, len, dim]
            return x.view(self.batch, self.seq_len, x.shape[1], x.shape[2]).transpose(1, 2)

        if window is not None or sinks is not None or expand is not None:
            lens = torch.full((self.batch,), self.seq_len, device=q.device)
            keys, values = expand(rows(k), rows(v)) if expand is not None else (rows(k), rows(v))
            out = attend_gathered(q.view(self.batch, self.seq_len, num_heads, head_dim), keys, values, lens, lens,
                                  scale or head_dim ** -0.5, window=window, sinks=sinks)
            return out.reshape(-1, num_heads, values.shape[-1])

        kk, vv = rows(k), rows(v)
        if group > 1:
            kk, vv = kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(rows(q), kk, vv, is_causal=True)
        return out.transpose(1, 2).reshape(-1, num_heads, head_dim)


@dataclass(slots=True)
class PagedBatch:
    """Where each scheduled sequence's tokens sit in the flat batch and in the cache.

    Decode rows (one query each) are attended together; prefill chunks attend together only with chunks of the same
    query and context lengths (`prefill_groups`), so no row is padded and the score tensor is bounded by its group.
    A group whose context is its query (prompts with no cached prefix, computed whole in this step) is a group of
    whole prompts of one length.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode_token_idx: torch.Tensor  # [num_decode] int64 into the flat batch
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int64
    decode_context_lens: torch.Tensor  # [num_decode] int64
    fresh_page: torch.Tensor | None = None  # [num_tokens] bool: the token is its page's first (resets page bounds)
    # every prefill row grouped by (query_len, context_len): one attention call a group, not one a row
    prefill_groups: list[PrefillGroup] = field(default_factory=list)


@dataclass(slots=True)
class PrefillGroup:
    """Prefill rows of one query length and one context length (prompts of a length continuing from cached pages of
    a length, as a shared system prompt's): attended in one call. Each row's result is what it gets alone (the same
    shapes and mask per row; the batch dimension only runs them side by side: to the bit on the CPU, tested)."""

    query_len: int
    context_len: int
    token_idx: torch.Tensor  # [rows * query_len] int64: their tokens in the flat batch, row after row
    block_tables: torch.Tensor  # [rows, blocks] int64
    context_lens: torch.Tensor  # [rows] int64, all context_len
    query_lens: torch.Tensor  # [rows] int64, all query_len

    @property
    def whole(self) -> bool:
        """Prompts computed whole in this step: their context is all in the step's own keys and values."""
        return self.context_len == self.query_len


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, qlen: int,
            scale: float) -> torch.Tensor:
    """Causal attention of the rows of `qlen` tokens at `idx` (row after row) over their own keys and values, in one
    call: [len(idx), heads, dim]. The mask and kernel are the paged path's (a row's keys up to its own position), so
    each row's result is that path's (to the bit on the CPU, tested); 32 prompts of 64 tokens, one layer: 6.5 ->
    1.8 ms."""
    rows, heads, dim = idx.numel() // qlen, q.shape[1], q.shape[2]

    def split(x: torch.Tensor) -> torch.Tensor:  # [rows, heads, qlen, dim]
        return x.index_select(0, idx).view(rows, qlen, x.shape[1], dim).transpose(1, 2)

    mask = torch.ones(qlen, qlen, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask, scale=scale,
                                         enable_gqa=heads != k.shape[1])
    return out.transpose(1, 2).reshape(-1, heads, dim)


@dataclass(slots=True)
class PagedAttention:
    """Attention that writes new K/V into the paged cache and reads through block tables."""

    caches: list[LayerCache]  # per layer
    spec: KvCacheSpec
    batch: PagedBatch  # the first KV group's (every layer's with one group)
    kernels: KernelSet
    scale: float
    group_batches: tuple[PagedBatch, ...] = ()  # the other KV groups' (`kv_spec.KvGroup`): their own block tables
    layer_groups: tuple[int, ...] = ()  # each layer's KV group, where there are several

    def _batch(self, layer: int) -> PagedBatch:
        group = self.layer_groups[layer] if self.group_batches else 0
        return self.group_batches[group - 1] if group else self.batch

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
               sinks: torch.Tensor | None = None, expand: Expand | None = None,
               scale: float | None = None) -> torch.Tensor:
        b, c = self._batch(layer), self.caches[layer]
        if expand is not None:  # a latent and a RoPE key of their own sizes: the reference writes any shape
            write_kv_ref(k, v, c.k, c.v, b.slot_mapping, c.k_scale, c.v_scale, c.k_min, c.k_max, b.fresh_page)
            return self._gathered(layer, q, window, sinks, expand, scale)
        self.kernels.write_kv(k, v, c.k, c.v, b.slot_mapping, c.k_scale, c.v_scale, c.k_min, c.k_max, b.fresh_page)
        if window is not None or sinks is not None:
            return self._gathered(layer, q, window, sinks)
        if not b.prefill_groups:  # every token a decode row, in order: no gather and scatter around the kernel
            return self._decode(layer, q)
        out = torch.empty_like(q)
        if b.decode_token_idx.numel():
            out.index_copy_(0, b.decode_token_idx, self._decode(layer, q.index_select(0, b.decode_token_idx)))
        together = self._whole_from_step(c, k)
        for g in b.prefill_groups:
            rows, qlen = g.block_tables.shape[0], g.query_len
            if together and g.whole:
                out.index_copy_(0, g.token_idx, _causal(q, k, v, g.token_idx, qlen, self.scale))
                continue
            query = q.index_select(0, g.token_idx).view(rows, qlen, *q.shape[1:])
            if c.k_scale is None:
                res = self.kernels.paged_attention(query, c.k, c.v, g.block_tables, g.context_lens, g.query_lens, self.scale)
            else:  # row by row: the compiled FP8 dequantization is warmed for one row's shapes, and a new batch size
                # would compile again in the middle of serving (seconds: engine alone at batch 8, 6k -> 3k tok/s)
                res = torch.cat([self.kernels.paged_attention_fp8(
                    query[r:r + 1], c.k, c.v, c.k_scale, c.v_scale, g.block_tables[r:r + 1], g.context_lens[r:r + 1],
                    g.query_lens[r:r + 1], self.scale) for r in range(rows)])
            out.index_copy_(0, g.token_idx, res.reshape(-1, *q.shape[1:]))
        return out

    @staticmethod
    def _whole_from_step(cache: LayerCache, k: torch.Tensor) -> bool:
        """Whether whole prompts attend over the step's own keys and values instead of reading their pages back: the
        cache holds them unchanged when it keeps the model's dtype."""
        return cache.k_scale is None and cache.k.dtype == k.dtype

    def _gathered(self, layer: int, q: torch.Tensor, window: int | None, sinks: torch.Tensor | None,
                  expand: Expand | None = None, scale: float | None = None) -> torch.Tensor:
        """Attention with a sliding window, sinks (gpt-oss) or latents to expand (DeepSeek's MLA), for every row,
        through the reference (no kernel has these yet): each row's pages gathered (FP8 dequantized), decode rows
        together as rows of one query. A decode row of a layer with top-k page selection and no window sees only its
        selected pages (a window already bounds what a row reads)."""
        b, c = self._batch(layer), self.caches[layer]
        out = None
        rows = [(b.decode_token_idx, b.decode_block_tables, b.decode_context_lens, 1)]
        rows += [(g.token_idx, g.block_tables, g.context_lens, g.query_len) for g in b.prefill_groups]
        for idx, tables, ctx, qlen in rows:
            if not idx.numel():
                continue
            if window is not None:
                tables, ctx = self._window_pages(tables, ctx, qlen, window)
            keys, values = gather_pages(c.k, tables, ctx), gather_pages(c.v, tables, ctx)
            if c.k.dtype == FP8:
                keys = dequantize_fast(keys, gather_pages(c.k_scale, tables, ctx), q.dtype)
                values = dequantize_fast(values, gather_pages(c.v_scale, tables, ctx), q.dtype)
            key_mask = None
            if qlen == 1 and window is None and not self.spec.layers[layer].dense:
                pages = self.kernels.select_pages(q.index_select(0, idx), c.k_min, c.k_max, tables, ctx,
                                                  self.spec.topk_pages, self.spec.block_size)
                key_mask = pages_key_mask(pages, ctx, self.spec.block_size)[..., :keys.shape[2]]
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            if expand is not None:
                keys, values = expand(keys, values)
            query = q.index_select(0, idx).view(-1, qlen, *q.shape[1:])
            res = attend_gathered(query, keys, values, ctx, torch.full_like(ctx, qlen), scale or self.scale, key_mask,
                                  window, sinks)
            if out is None:
                out = q.new_empty(q.shape[0], q.shape[1], res.shape[-1])
            out.index_copy_(0, idx, res.reshape(-1, q.shape[1], res.shape[-1]))
        assert out is not None, "a step has at least one token"
        return out

    def _window_pages(self, tables: torch.Tensor, ctx: torch.Tensor, qlen: int,
                      window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' block tables and context lengths cut to the pages their queries' windows reach: each row's table
        starts at the page of its first query's oldest visible key and its context counts from there. Masks are
        relative to the gathered keys and RoPE is already in them, so attention is unchanged, and a sliding layer
        reads a window's pages per step, however long the sequence."""
        bs = self.spec.block_size
        first = ((ctx - qlen - window + 1).clamp(min=0) // bs)  # [rows]
        width = int((-(-(ctx - first * bs) // bs)).max())
        cols = (first[:, None] + torch.arange(width, device=tables.device)[None]).clamp(max=tables.shape[1] - 1)
        return tables.gather(1, cols), ctx - first * bs

    def _decode(self, layer: int, dq: torch.Tensor) -> torch.Tensor:
        """Decode attention for the batch's decode rows `dq` [num_decode, heads, dim], over all their pages or, in a
        layer that is not dense, the top-k selected ones."""
        b, c = self._batch(layer), self.caches[layer]
        pages = None
        if not self.spec.layers[layer].dense:
            pages = self.kernels.select_pages(dq, c.k_min, c.k_max, b.decode_block_tables, b.decode_context_lens,
                                              self.spec.topk_pages, self.spec.block_size)
        return self.kernels.decode_attention(dq, c.k, c.v, b.decode_block_tables, b.decode_context_lens, self.scale,
                                             c.k_scale, c.v_scale, pages)
