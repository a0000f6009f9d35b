"""The FP8 KV page format and query-aware page selection (torch references): round-trip error within
E4M3's bound, writes into scattered pages with their scales and min/max metadata, page scores that
bound every key's score, and top-k selection that keeps the sink and the recent page."""

from __future__ import annotations

import pytest
import torch

from cotserve.kernels.kv_fp8 import (FP8, dequantize_ref, e4m3_error_bound, page_scores_ref, quantize_ref,
                                     select_pages_ref, write_fp8_ref)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0, 1e4])
def test_round_trip_error_is_within_e4m3_bound(head_dim, magnitude):
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(37, 4, head_dim, generator=g) * magnitude
    x[3, 1] = 0.0  # an all-zero vector stays exactly zero
    q, s = quantize_ref(x)
    assert q.dtype == FP8 and s.shape == (37, 4)
    back = dequantize_ref(q, s)
    assert torch.all((back - x).abs() <= e4m3_error_bound(x, s) + 1e-12 * magnitude)
    assert torch.equal(back[3, 1], torch.zeros(head_dim)) and s[3, 1] == 1.0
    assert torch.allclose(back.abs().amax(-1)[s != 1], x.abs().amax(-1)[s != 1], rtol=1e-6)  # the largest lands on 448 exactly


def paged_setup(block_size=16, heads=2, dim=64, num_blocks=12):
    shape = (num_blocks, block_size, heads, dim)
    return dict(k_cache=torch.zeros(shape, dtype=FP8), v_cache=torch.zeros(shape, dtype=FP8),
                k_scale=torch.zeros(shape[:3]), v_scale=torch.zeros(shape[:3]),
                k_min=torch.zeros(num_blocks, heads, dim), k_max=torch.zeros(num_blocks, heads, dim))


def write_sequence(cache, table: list[int], keys: torch.Tensor, values: torch.Tensor, start: int = 0, block_size: int = 16):
    pos = torch.arange(start, start + keys.shape[0])
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in pos.tolist()])
    write_fp8_ref(keys, values, **cache, slot_mapping=slots, fresh_page=(pos % block_size == 0))
    return slots


def test_writes_land_in_scattered_pages_with_scales_and_page_min_max():
    torch.manual_seed(0)
    cache = paged_setup()
    table = [7, 2, 10]  # pages scattered in the pool; the last one partly filled
    keys, values = torch.randn(40, 2, 64) * 3, torch.randn(40, 2, 64)
    write_sequence(cache, table, keys[:23], values[:23])
    slots = write_sequence(cache, table, keys[23:], values[23:], start=23)  # a second chunk, mid-page
    flat_k = cache["k_cache"].view(-1, 2, 64)
    qk, sk = quantize_ref(keys)
    all_slots = torch.cat([torch.tensor([table[p // 16] * 16 + p % 16 for p in range(23)]), slots])
    assert torch.equal(flat_k[all_slots].view(torch.uint8), qk.view(torch.uint8))
    assert torch.equal(cache["k_scale"].view(-1, 2)[all_slots], sk)
    deq = dequantize_ref(qk, sk)
    for i, page in enumerate(table):
        in_page = deq[i * 16:(i + 1) * 16]
        assert torch.equal(cache["k_min"][page], in_page.amin(0)) and torch.equal(cache["k_max"][page], in_page.amax(0))


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_page_score_bounds_every_key_and_is_exact_for_a_single_key(heads, kv_heads):
    torch.manual_seed(heads)
    block_size, dim, n = 16, 64, 70  # 5 pages, the last with 6 tokens
    cache = paged_setup(block_size, kv_heads, dim, num_blocks=9)
    table = [8, 0, 3, 5, 1]
    keys = torch.randn(n, kv_heads, dim)
    write_sequence(cache, table, keys, torch.randn(n, kv_heads, dim))
    deq = dequantize_ref(*quantize_ref(keys))
    q = torch.randn(3, heads, dim)
    scores = page_scores_ref(q, cache["k_min"], cache["k_max"], torch.tensor([table] * 3))
    assert scores.shape == (3, kv_heads, 5)
    group = heads // kv_heads
    for b in range(3):
        for h in range(heads):
            kvh = h // group
            for p in range(5):
                page_keys = deq[p * block_size:min(n, (p + 1) * block_size), kvh]
                assert scores[b, kvh, p] >= (page_keys @ q[b, h]).max() - 1e-4
    single = paged_setup(block_size, kv_heads, dim, num_blocks=2)
    write_sequence(single, [1], keys[:1], keys[:1])
    s1 = page_scores_ref(q[:1, :group], single["k_min"][:, :1], single["k_max"][:, :1], torch.tensor([[1]]))
    assert torch.allclose(s1[0, 0, 0], (deq[0, 0] @ q[0, :group].T).max(), atol=1e-4)


def test_top_k_keeps_sink_and_recent_page_and_the_best_of_the_rest():
    scores = torch.tensor([[[5.0, 9.0, 1.0, 8.0, 2.0, 7.0, 0.0, 0.0]],   # 6 pages in use
                           [[0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]]])  # 3 pages: fewer than k, all kept
    picked = select_pages_ref(scores, torch.tensor([6, 3]), k=4)
    assert picked[0, 0].tolist() == [0, 1, 3, 5]  # sink 0, recent 5, then the best two: 1 (9.0), 3 (8.0)
    assert sorted(set(picked[1, 0].tolist())) == [0, 1, 2]
    brute = torch.rand(2, 3, 20)
    got = select_pages_ref(brute, torch.tensor([20, 11]), k=6)
    for b, used in enumerate((20, 11)):
        for h in range(3):
            rest = brute[b, h, 1:used - 1].topk(4).indices + 1
            assert got[b, h].tolist() == sorted([0, used - 1, *rest.tolist()])


def test_fp16_scales_round_trip_within_the_bound_at_any_magnitude():
    x = torch.randn(50, 2, 64) * torch.logspace(-6, 4, 50)[:, None, None]  # amax/448 below fp16's smallest normal too
    q, s = quantize_ref(x, torch.float16)
    assert s.dtype == torch.float16 and torch.isfinite(q.float()).all()
    assert torch.all((dequantize_ref(q, s) - x).abs() <= e4m3_error_bound(x, s) + 1e-30)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (8, 2, 128)])
def test_fp8_paged_attention_is_attention_over_the_dequantized_pages(heads, kv_heads, head_dim):
    from cotserve.kernels.kv_fp8 import paged_attention_fp8_ref
    from cotserve.kernels.paged_attention import paged_attention_ref

    torch.manual_seed(head_dim)
    block_size, num_blocks = 16, 20
    cache = paged_setup(block_size, kv_heads, head_dim, num_blocks)
    cache["k_scale"], cache["v_scale"] = cache["k_scale"].half(), cache["v_scale"].half()
    tables = [[3, 17, 9], [0], [12, 5]]
    lens = [40, 1, 23]  # ragged; a single token; a partly filled last page
    for table, n in zip(tables, lens):
        write_sequence(cache, table, torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim))
    deq_k = dequantize_ref(cache["k_cache"], cache["k_scale"])
    deq_v = dequantize_ref(cache["v_cache"], cache["v_scale"])
    block_tables = torch.tensor([t + [0] * (3 - len(t)) for t in tables])
    q = torch.randn(3, 1, heads, head_dim)
    args = (block_tables, torch.tensor(lens), torch.ones(3, dtype=torch.int64), head_dim ** -0.5)
    got = paged_attention_fp8_ref(q, cache["k_cache"], cache["v_cache"], cache["k_scale"], cache["v_scale"], *args)
    want = paged_attention_ref(q, deq_k, deq_v, *args)
    assert torch.allclose(got, want, atol=1e-5)


def test_selected_pages_are_whole_pages_and_attention_sees_only_them():
    from cotserve.kernels.kv_fp8 import decode_attention_ref, pages_key_mask, select_pages_from_bounds_ref, update_page_bounds_ref

    torch.manual_seed(3)
    bs, kv_heads, heads, dim, n = 16, 2, 4, 64, 90  # 6 pages, the last partly filled
    k_cache, v_cache = torch.randn(10, bs, kv_heads, dim), torch.randn(10, bs, kv_heads, dim)
    k_min, k_max = torch.full((10, kv_heads, dim), 7.0), torch.full((10, kv_heads, dim), 7.0)  # stale: reset by fresh pages
    table = [9, 4, 0, 7, 2, 5]
    pos = torch.arange(n)
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in pos.tolist()])
    update_page_bounds_ref(k_cache.view(-1, kv_heads, dim)[slots], k_min, k_max, slots, pos % bs == 0, bs)
    for i, page in enumerate(table):
        used = min(bs, n - i * bs)
        assert torch.equal(k_min[page], k_cache[page, :used].amin(0)) and torch.equal(k_max[page], k_cache[page, :used].amax(0))
    q = torch.randn(1, heads, dim)
    ctx, tables = torch.tensor([n]), torch.tensor([table])
    everything = select_pages_from_bounds_ref(q, k_min, k_max, tables, ctx, k=8, block_size=bs)
    assert everything[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 5, 5]  # fewer pages than k: all of them, padded with the last
    assert pages_key_mask(everything, ctx, bs).all()
    chosen = select_pages_from_bounds_ref(q, k_min, k_max, tables, ctx, k=3, block_size=bs)
    mask = pages_key_mask(chosen, ctx, bs)
    for h in range(kv_heads):
        pages = sorted({int(p) // bs for p in torch.nonzero(mask[0, h]).flatten()})
        assert len(pages) == 3 and pages[0] == 0 and pages[-1] == 5
        assert mask[0, h].sum() == sum(min(bs, n - p * bs) for p in pages)  # whole pages
    got = decode_attention_ref(q, k_cache, v_cache, tables, ctx, dim ** -0.5, pages=chosen)
    for h in range(heads):  # brute force: softmax over the kept positions only
        kvh = h // (heads // kv_heads)
        keep = torch.nonzero(mask[0, kvh]).flatten()
        keys = torch.stack([k_cache[table[p // bs], p % bs, kvh] for p in keep.tolist()])
        vals = torch.stack([v_cache[table[p // bs], p % bs, kvh] for p in keep.tolist()])
        w = torch.softmax(keys @ q[0, h] * dim ** -0.5, dim=0)
        assert torch.allclose(got[0, h], w @ vals, atol=1e-5)


def test_compiled_cpu_dequantization_is_bit_identical_to_the_reference():
    from cotserve.kernels.kv_fp8 import dequantize_fast

    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    codes = codes[torch.isfinite(codes.float())]
    for shape in ((1, 2, codes.numel() // 2), (3, 2, codes.numel() // 2)):  # one row, several rows
        payload = codes[: shape[2] * 2].repeat(shape[0]).view(shape[0], 2, shape[2])[..., None].expand(*shape, 64).contiguous()
        scale = torch.rand(shape, dtype=torch.float16) + 0.01
        assert torch.equal(dequantize_fast(payload, scale), dequantize_ref(payload, scale))
        assert torch.equal(dequantize_ref(payload, scale), payload.float() * scale.float()[..., None])  # torch's own cast


def test_decode_attention_reads_pages_in_place_compiled_and_matches_the_gathering_reference():
    """The CPU decode path (`decode_all_pages`, compiled by inductor) against `paged_attention_ref` (pages
    gathered, torch's SDPA): plain and FP8 caches, GQA, one row, one page, padded block tables."""
    from cotserve.kernels.kv_fp8 import decode_all_pages, decode_attention_ref
    from cotserve.kernels.paged_attention import paged_attention_ref

    torch.manual_seed(5)
    bs, dim = 16, 64
    for batch, heads, kv_heads, width in ((6, 4, 2, 5), (1, 3, 3, 1), (3, 3, 3, 2), (1, 8, 1, 4)):
        k_cache, v_cache = torch.randn(40, bs, kv_heads, dim), torch.randn(40, bs, kv_heads, dim)
        tables = torch.randperm(40)[: batch * width].view(batch, width)
        ctx = torch.randint(1, width * bs + 1, (batch,))
        ctx[0] = width * bs
        q = torch.randn(batch, heads, dim)
        ones = torch.ones(batch, dtype=torch.int64)
        want = paged_attention_ref(q.unsqueeze(1), k_cache, v_cache, tables, ctx, ones, dim ** -0.5).squeeze(1)
        got = decode_attention_ref(q, k_cache, v_cache, tables, ctx, dim ** -0.5)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
        kq, ks = quantize_ref(k_cache, torch.float16)
        vq, vs = quantize_ref(v_cache, torch.float16)
        want8 = paged_attention_ref(q.unsqueeze(1), dequantize_ref(kq, ks), dequantize_ref(vq, vs), tables, ctx, ones,
                                    dim ** -0.5).squeeze(1)
        assert torch.allclose(decode_attention_ref(q, kq, vq, tables, ctx, dim ** -0.5, ks, vs), want8, atol=1e-5)
    assert decode_all_pages._compiled is not None and not decode_all_pages._failed  # the compiled code ran, no fallback
