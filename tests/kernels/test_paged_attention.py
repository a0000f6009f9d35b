"""Paged attention reference vs plain causal attention over contiguous K/V."""

from __future__ import annotations

import pytest
import torch

from cotserve.kernels.paged_attention import paged_attention_ref, reshape_and_cache_ref


def naive(q, k, v, start):  # q [n, h, d] at positions start.., k/v [ctx, kvh, d]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    qpos = torch.arange(q.shape[0])[:, None] + start
    scores = scores.masked_fill(torch.arange(k.shape[0])[None] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_matches_contiguous_attention_on_ragged_scattered_pages(head_dim, heads, kv_heads):
    gen = torch.Generator().manual_seed(head_dim + heads)
    block_size, num_blocks = 16, 40
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    # (context length, queries): one token, a partly filled last page, exactly full pages, a chunk
    rows = [(1, 1), (17, 1), (32, 1), (45, 5), (70, 70)]
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # pages scattered through the pool
    tables, kvs = [], []
    for ctx, _ in rows:
        nb = -(-ctx // block_size)
        table = [perm.pop() for _ in range(nb)]
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        reshape_and_cache_ref(k, v, k_cache, v_cache, slots)
        tables.append(table)
        kvs.append((k, v))
    max_q, width = max(q for _, q in rows), max(len(t) for t in tables)
    query = torch.randn(len(rows), max_q, heads, head_dim, generator=gen)
    out = paged_attention_ref(
        query, k_cache, v_cache,
        torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        torch.tensor([c for c, _ in rows]), torch.tensor([q for _, q in rows]), head_dim ** -0.5,
    )
    for b, ((ctx, nq), (k, v)) in enumerate(zip(rows, kvs)):
        expected = naive(query[b, :nq], k, v, ctx - nq)
        torch.testing.assert_close(out[b, :nq], expected, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(out[b]).all()


def test_reshape_and_cache_writes_exactly_the_given_slots():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros_like(k_cache)
    k = torch.arange(6.0).view(2, 1, 3)
    reshape_and_cache_ref(k, -k, k_cache, v_cache, torch.tensor([5, 0]))
    assert k_cache.view(-1, 3)[5].tolist() == [0.0, 1.0, 2.0]
    assert k_cache.view(-1, 3)[0].tolist() == [3.0, 4.0, 5.0]
    assert v_cache.view(-1, 3)[0].tolist() == [-3.0, -4.0, -5.0]
    assert k_cache.view(-1, 3)[[1, 2, 3, 4, 6, 7]].abs().sum() == 0
