"""The C decode-attention kernel for the CPU (`cpu_native`) against the torch reference it replaces: fp32 and FP8
pages, GQA, one row, partial last pages, padded block tables, top-k page selection, several OpenMP threads; and the
fallbacks (a dtype it does not take, no C compiler) run the reference."""

from __future__ import annotations

import pytest
import torch

from cotserve.kernels import cpu_native
from cotserve.kernels.dispatch import REFERENCE, kernels_for
from cotserve.kernels.kv_fp8 import FP8, decode_attention_ref, quantize_ref, select_pages_from_bounds_ref

BS, DIM = 16, 64


def _case(batch: int, heads: int, kv_heads: int, width: int, seed: int, dim: int = DIM):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(64, BS, kv_heads, dim, generator=g), torch.randn(64, BS, kv_heads, dim, generator=g)
    tables = torch.randperm(64, generator=g)[: batch * width].view(batch, width)
    ctx = torch.randint(1, width * BS + 1, (batch,), generator=g)
    ctx[0] = width * BS  # one row fills its table; the others end inside a page
    q = torch.randn(batch, heads, dim, generator=g) * 3
    return q, k_cache, v_cache, tables, ctx


def test_the_kernel_builds_here_and_the_cpu_kernel_set_uses_it():
    assert cpu_native.available()
    cpu = kernels_for(torch.device("cpu"))
    assert cpu.name == "cpu-native" and cpu.decode_attention is cpu_native.decode_attention
    assert cpu.write_kv is REFERENCE.write_kv  # only decode attention is replaced


@pytest.mark.parametrize("batch,heads,kv_heads,width", [(6, 4, 2, 5), (1, 3, 3, 1), (3, 3, 3, 2), (5, 8, 1, 4), (9, 6, 3, 7)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_reference_on_fp32_and_fp8_pages(batch, heads, kv_heads, width, threads):
    q, k_cache, v_cache, tables, ctx = _case(batch, heads, kv_heads, width, seed=batch * 7 + heads)
    kq, ks = quantize_ref(k_cache, torch.float16)
    vq, vs = quantize_ref(v_cache, torch.float16)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for args in ((k_cache, v_cache, tables, ctx, DIM ** -0.5), (kq, vq, tables, ctx, DIM ** -0.5, ks, vs)):
            want = decode_attention_ref(q, *args)
            got = cpu_native.decode_attention(q, *args)
            assert got.shape == want.shape and got.dtype == torch.float32
            assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("topk", [2, 3, 8])
def test_top_k_pages_match_the_reference_and_rows_with_fewer_pages_read_each_page_once(topk):
    q, k_cache, v_cache, tables, ctx = _case(7, 4, 2, 6, seed=topk)
    ctx[1] = 5  # a row of one page: the selection pads with its last page, which must count once
    ctx[2] = BS * 2  # exactly two full pages
    k_min = torch.minimum(k_cache.amin(1), k_cache.amax(1)) - 0.5
    k_max = k_cache.amax(1) + 0.5
    pages = select_pages_from_bounds_ref(q, k_min, k_max, tables, ctx, topk, BS)
    kq, ks = quantize_ref(k_cache, torch.float16)
    vq, vs = quantize_ref(v_cache, torch.float16)
    for args in ((k_cache, v_cache, tables, ctx, 0.125, None, None, pages), (kq, vq, tables, ctx, 0.125, ks, vs, pages)):
        want = decode_attention_ref(q, *args)
        got = cpu_native.decode_attention(q, *args)
        assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)
    with_all = cpu_native.decode_attention(q, k_cache, v_cache, tables, ctx, 0.125)
    assert torch.allclose(with_all[1:3], cpu_native.decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, None, None,
                                                                     pages)[1:3], atol=2e-6)  # <= k pages: all of them


def test_fp8_special_codes_decode_as_torch_does():
    """Every finite E4M3 code through the kernel's table: one token per page, so the output is that token's value."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    codes = codes[torch.isfinite(codes.float())]  # 254: both NaN codes left out, two zeros fill the last row
    codes = torch.cat([codes, torch.zeros(4 * DIM - codes.numel(), dtype=FP8)]).view(4, DIM)
    n = codes.shape[0]
    k8 = torch.zeros(n, BS, 1, DIM, dtype=FP8)
    v8 = torch.zeros(n, BS, 1, DIM, dtype=FP8)
    v8[:, 0, 0] = codes
    scale = torch.full((n, BS, 1), 0.5, dtype=torch.float16)
    tables = torch.arange(n).view(n, 1)
    out = cpu_native.decode_attention(torch.randn(n, 1, DIM), k8, v8, tables, torch.ones(n, dtype=torch.int64), 0.125,
                                      scale, scale)
    assert torch.equal(out[:, 0], codes.float() * 0.5)


def test_shapes_it_does_not_take_run_the_reference():
    q, k_cache, v_cache, tables, ctx = _case(3, 4, 2, 3, seed=1)
    q16, k16, v16 = q.to(torch.bfloat16), k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    assert not cpu_native.supports(q16, k16, v16, None, None)
    assert torch.equal(cpu_native.decode_attention(q16, k16, v16, tables, ctx, 0.125),
                       decode_attention_ref(q16, k16, v16, tables, ctx, 0.125))
    wide = _case(2, 2, 1, 2, seed=2, dim=640)  # head_dim over the kernel's 512
    assert not cpu_native.supports(wide[0], wide[1], wide[2], None, None)
    assert torch.allclose(cpu_native.decode_attention(*wide, 0.1), decode_attention_ref(*wide, 0.1))
    assert cpu_native.decode_attention(q[:0], k_cache, v_cache, tables[:0], ctx[:0], 0.125).shape == (0, 4, DIM)


def test_without_a_c_compiler_the_cpu_runs_the_reference(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built before
    assert not cpu_native.available()
    assert kernels_for(torch.device("cpu")) is REFERENCE
    q, k_cache, v_cache, tables, ctx = _case(2, 2, 2, 2, seed=3)
    assert torch.equal(cpu_native.decode_attention(q, k_cache, v_cache, tables, ctx, 0.125),
                       decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.125))


def test_a_row_that_would_read_outside_its_table_or_the_cache_raises_instead():
    q, k_cache, v_cache, tables, ctx = _case(3, 4, 2, 3, seed=4)
    bad = tables.clone()
    bad[1, 0] = k_cache.shape[0]  # a block id past the cache
    with pytest.raises(IndexError, match="row 1 reads outside"):
        cpu_native.decode_attention(q, k_cache, v_cache, bad, ctx, 0.125)
    long = ctx.clone()
    long[2] = tables.shape[1] * BS + 1  # a context longer than the row's table
    with pytest.raises(IndexError, match="row 2 reads outside"):
        cpu_native.decode_attention(q, k_cache, v_cache, tables, long, 0.125)
    pages = torch.zeros(3, 2, 2, dtype=torch.int64)
    pages[0, 1, 1] = tables.shape[1]  # a selected page past the table
    with pytest.raises(IndexError, match="row 0 reads outside"):
        cpu_native.decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, None, None, pages)
    empty = cpu_native.decode_attention(q, k_cache, v_cache, tables, torch.zeros(3, dtype=torch.int64), 0.125)
    assert torch.equal(empty, torch.zeros_like(q))  # nothing to attend to: zeros, not NaN
