"""Paged attention over a block-table KV cache.

Layout of one layer's cache: `[num_blocks, block_size, num_kv_heads, head_dim]` for keys and for
values. A sequence's tokens live in the blocks its block table lists, in order; token `p` of a
sequence sits at slot `block_table[p // block_size] * block_size + p % block_size`.

This module holds the plain-torch references; `cotserve.kernels.triton_kv` has the Triton kernels
for CUDA and `cotserve.kernels.dispatch` picks the implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write each new token's key and value into its slot (keys and values may differ in size: latent attention's)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def paged_attention_ref(
    query: torch.Tensor,  # [batch, max_query_len, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks] int64, padded with any valid block id
    context_lens: torch.Tensor,  # [batch] int64: tokens in the cache, the queries' own included
    query_lens: torch.Tensor,  # [batch] int64: real queries per row (<= max_query_len)
    scale: float,
    key_mask: torch.Tensor | None = None,  # [batch, num_kv_heads, max_ctx] bool: keys allowed (top-k pages)
) -> torch.Tensor:  # [batch, max_query_len, num_heads, head_dim]
    """Causal attention of each row's queries over that row's cached keys.

    Query `i` of row `b` sits at position `context_lens[b] - query_lens[b] + i` and attends to
    cache positions `0..` that position inclusive. Padding rows (i >= query_lens[b]) return
    finite values that the caller discards.
    """
    keys = gather_pages(k_cache, block_tables, context_lens).to(query.dtype)
    values = gather_pages(v_cache, block_tables, context_lens).to(query.dtype)
    return attend_gathered(query, keys, values, context_lens, query_lens, scale, key_mask)


def gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, ...] -> [batch, kv_heads, max_ctx, ...] through the block tables."""
    batch, block_size = block_tables.shape[0], cache.shape[1]
    max_ctx = int(context_lens.max())
    num_blocks = (max_ctx + block_size - 1) // block_size
    pages = cache[block_tables[:, :num_blocks]]  # [batch, blocks, block_size, kv_heads, ...]
    return pages.reshape(batch, num_blocks * block_size, *cache.shape[2:])[:, :max_ctx].transpose(1, 2)


def attend_gathered(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_lens: torch.Tensor,
                    query_lens: torch.Tensor, scale: float, key_mask: torch.Tensor | None = None,
                    window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Masked causal SDPA of [batch, max_q, heads, dim] queries over [batch, kv_heads, max_ctx, dim]
    keys/values; `key_mask` [batch, kv_heads, max_ctx] (optional) further limits the keys each KV
    head's queries may see (top-k page selection). With a `window` a query sees only the keys of the last `window`
    positions up to its own; with `sinks` [heads] each head's softmax has one more logit, which takes its share of
    the probability and no value (gpt-oss): computed in float32, outside SDPA, which has no such term."""
    batch, max_q, num_heads, head_dim = query.shape
    num_kv_heads, max_ctx = keys.shape[1], keys.shape[2]
    key_pos = torch.arange(max_ctx, device=query.device)
    q_pos = (context_lens - query_lens)[:, None] + torch.arange(max_q, device=query.device)[None]
    mask = ((key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < context_lens[:, None, None]))[:, None]
    if window is not None:
        mask = mask & (key_pos[None, None, :] > q_pos[:, :, None] - window)[:, None]
    if key_mask is not None:  # [batch, kv_heads, max_ctx] -> every query head of the group
        mask = mask & key_mask.repeat_interleave(num_heads // num_kv_heads, dim=1)[:, :, None, :]
    if sinks is not None:
        return _attend_with_sinks(query, keys, values, mask, scale, sinks)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [batch, heads, max_q, head_dim]
    return out.transpose(1, 2)


def _attend_with_sinks(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                       sinks: torch.Tensor) -> torch.Tensor:
    """`attend_gathered`'s attention with one sink logit per head in each softmax: [batch, max_q, heads, dim]."""
    batch, max_q, num_heads, _ = query.shape
    group = num_heads // keys.shape[1]
    k, v = keys.float().repeat_interleave(group, dim=1), values.float().repeat_interleave(group, dim=1)
    scores = (query.transpose(1, 2).float() @ k.transpose(-1, -2)) * scale  # [batch, heads, max_q, max_ctx]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, num_heads, 1, 1).expand(batch, num_heads, max_q, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ v).transpose(1, 2).to(query.dtype)


def copy_blocks_ref(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """For every tensor (first dimension = block), block dst[i] := block src[i] (copy-on-write forks,
    page compaction). All sources are read before any destination is written."""
    if src.numel() == 0:
        return
    for cache in caches:
        cache[dst] = cache[src]
