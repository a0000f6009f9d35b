"""The C kernels for the CPU (`cpu_native`) against the torch references they replace. Decode attention: fp32 and FP8
pages, GQA, one row, partial last pages, padded block tables, top-k page selection, several OpenMP threads. Cache
writes into FP8 and fp32 pages: payload, scales and page bounds bit for bit, every E4M3 rounding. And the fallbacks
(a dtype they do not take, no C compiler) run the references. The layer's small operations: test_layer_ops.py."""

from __future__ import annotations

import pytest
import torch

from cotserve.kernels import cpu_native
from cotserve.kernels.dispatch import REFERENCE, kernels_for, layer_ops_for
from cotserve.kernels.kv_fp8 import FP8, decode_attention_ref, quantize_ref, select_pages_from_bounds_ref
from cotserve.kernels.layer_ops import REFERENCE_OPS

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
    assert cpu.write_kv is cpu_native.write_kv  # decode attention and FP8 writes are replaced, nothing else
    assert cpu.select_pages is REFERENCE.select_pages and cpu.paged_attention is REFERENCE.paged_attention


@pytest.mark.parametrize("batch,heads,kv_heads,width,dim", [(6, 4, 2, 5, DIM), (1, 3, 3, 1, DIM), (3, 3, 3, 2, DIM),
                                                            (5, 8, 1, 4, DIM), (9, 6, 3, 7, DIM), (3, 272, 17, 3, 8),
                                                            (4, 8, 2, 3, 128), (2, 2, 1, 2, 80)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_reference_on_fp32_and_fp8_pages(batch, heads, kv_heads, width, dim, threads):
    """GQA groups of 1 to 8 query heads per KV head, 272 query heads; head sizes 64 and 128 (each compiled with the size
    a constant) and 8 and 80 (any other)."""
    q, k_cache, v_cache, tables, ctx = _case(batch, heads, kv_heads, width, seed=batch * 7 + heads, dim=dim)
    kq, ks = quantize_ref(k_cache, torch.float16)
    vq, vs = quantize_ref(v_cache, torch.float16)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for args in ((k_cache, v_cache, tables, ctx, dim ** -0.5), (kq, vq, tables, ctx, dim ** -0.5, ks, vs)):
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


@pytest.mark.parametrize("heads", [1, 2])
def test_fp8_special_codes_decode_as_torch_does(heads):
    """Every finite E4M3 code through the kernel's decoding: one token per page, so the output is that token's value;
    the two NaN codes decode to NaN. One query head per KV head reads the codes in place, two decode the page into a
    buffer first: both ways."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    codes = codes[torch.isfinite(codes.float())]  # 254: both NaN codes left out, two zeros fill the last row
    codes = torch.cat([codes, torch.zeros(4 * DIM - codes.numel(), dtype=FP8)]).view(4, DIM)
    n = codes.shape[0]
    k8 = torch.zeros(n, BS, 1, DIM, dtype=FP8)
    v8 = torch.zeros(n, BS, 1, DIM, dtype=FP8)
    v8[:, 0, 0] = codes
    scale = torch.full((n, BS, 1), 0.5, dtype=torch.float16)
    tables = torch.arange(n).view(n, 1)
    out = cpu_native.decode_attention(torch.randn(n, heads, DIM), k8, v8, tables, torch.ones(n, dtype=torch.int64), 0.125,
                                      scale, scale)
    for head in range(heads):
        assert torch.equal(out[:, head], codes.float() * 0.5)
    v8[0, 0, 0, 0] = torch.tensor([0x7F], dtype=torch.uint8).view(FP8)  # E4M3's NaN (it has no infinity) stays NaN
    v8[1, 0, 0, 0] = torch.tensor([0xFF], dtype=torch.uint8).view(FP8)
    out = cpu_native.decode_attention(torch.randn(n, heads, DIM), k8, v8, tables, torch.ones(n, dtype=torch.int64), 0.125,
                                      scale, scale)
    assert out[:2, :, 0].isnan().all() and not out[2:, :, 0].isnan().any()


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
    assert layer_ops_for(torch.device("cpu"), torch.float32) is REFERENCE_OPS
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


def _fp8_pages(blocks: int, kv_heads: int, dim: int = DIM, bounds: bool = True, dtype: torch.dtype = FP8):
    """[k, v, k_scale, v_scale, k_min, k_max] of a cache in `dtype` (scales only for FP8)."""
    k, v = torch.zeros(blocks, BS, kv_heads, dim, dtype=dtype), torch.zeros(blocks, BS, kv_heads, dim, dtype=dtype)
    ks, vs = (torch.zeros(blocks, BS, kv_heads, dtype=torch.float16) for _ in range(2)) if dtype == FP8 else (None, None)
    lo = torch.full((blocks, kv_heads, dim), 7.0) if bounds else None
    hi = torch.full((blocks, kv_heads, dim), -7.0) if bounds else None
    return [k, v, ks, vs, lo, hi]


def _bytes(tensors) -> list:
    return [t.view(torch.uint8) if t.dtype == FP8 else t for t in tensors if t is not None]


@pytest.mark.parametrize("dtype", [FP8, torch.float32], ids=["fp8", "fp32"])
@pytest.mark.parametrize("bounds", [True, False])
def test_writes_are_the_references_bit_for_bit(bounds, dtype):
    """Payload, scales and page bounds as `write_kv_ref` makes them, into FP8 and fp32 pages: a prefill of 37 tokens
    over three pages (the first fresh) and then decode writes, values over every E4M3 range (subnormal, normal, past
    448 before scaling, an all-zero vector, negative zero)."""
    from cotserve.kernels.kv_fp8 import write_kv_ref

    g = torch.Generator().manual_seed(3)
    ref, got = _fp8_pages(8, 2, bounds=bounds, dtype=dtype), _fp8_pages(8, 2, bounds=bounds, dtype=dtype)
    scales = torch.tensor([1e-6, 1e-3, 1.0, 30.0, 1e4]).repeat_interleave(8)[:37, None, None]
    key = torch.randn(37, 2, DIM, generator=g) * scales
    value = torch.randn(37, 2, DIM, generator=g) * scales.flip(0)
    key[5, 1] = 0.0
    key[6, 0, :3] = -0.0
    value[7, 0, 0] = 1e-30  # a tiny element beside large ones: rounds to a subnormal or zero
    slots = torch.arange(3 * BS, 3 * BS + 37)  # pages 3, 4 and 5
    fresh = slots % BS == 0
    for fn, t in ((write_kv_ref, ref), (cpu_native.write_kv, got)):
        k, v, ks, vs, lo, hi = t
        fn(key, value, k, v, slots, ks, vs, lo, hi, fresh)
    for a, b in zip(_bytes(ref), _bytes(got)):
        assert torch.equal(a, b)
    step = torch.tensor([3 * BS + 37, 6 * BS])  # decode: one token into page 5, one starting page 6
    key2, value2 = torch.randn(2, 2, DIM, generator=g) * 5, torch.randn(2, 2, DIM, generator=g)
    for fn, t in ((write_kv_ref, ref), (cpu_native.write_kv, got)):
        k, v, ks, vs, lo, hi = t
        fn(key2, value2, k, v, step, ks, vs, lo, hi, step % BS == 0)
    for a, b in zip(_bytes(ref), _bytes(got)):
        assert torch.equal(a, b)
    if bounds:  # the pages written hold real bounds; page 0 was never written and keeps what it had
        assert torch.isfinite(got[4][3:7]).all() and (got[4][0] == 7.0).all()
    if dtype == torch.float32:  # a copy: the keys as given
        assert torch.equal(got[0].view(-1, 2, DIM)[slots], key) and torch.equal(got[1].view(-1, 2, DIM)[step], value2)


def test_every_float_rounds_to_the_e4m3_code_torch_gives():
    """Each E4M3 value, the midpoints between neighbours (ties to even) and points just either side of them, both
    signs, written as one vector with scale 1 (its max is 448): the codes are torch's float8_e4m3fn cast."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # every finite non-negative value
    mids = (codes[:-1] + codes[1:]) / 2
    xs = torch.cat([codes, mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids + 1)])
    xs = torch.cat([xs, -xs])
    n = xs.numel()
    rows = -(-n // 63)
    flat = torch.zeros(rows * 63)
    flat[:n] = xs
    x = torch.cat([flat.view(rows, 63), torch.full((rows, 1), 448.0)], dim=1).view(rows, 1, 64)  # max 448: scale 1
    k, v, ks, vs, _, _ = _fp8_pages(-(-rows // BS), 1, bounds=False)
    cpu_native.write_kv(x, x, k, v, torch.arange(rows), ks, vs)
    assert (ks.view(-1)[:rows] == 1.0).all()
    want = x.clamp(-448, 448).to(FP8).view(torch.uint8)
    assert torch.equal(k.view(-1, 1, 64)[:rows].view(torch.uint8), want)


@pytest.mark.parametrize("dtype", [FP8, torch.float32], ids=["fp8", "fp32"])
def test_a_write_outside_the_cache_raises_and_writes_nothing(dtype):
    k, v, ks, vs, lo, hi = _fp8_pages(2, 1, dtype=dtype)
    before = [t.clone() for t in _bytes([k, v, ks, vs, lo, hi])]
    x = torch.randn(3, 1, DIM)
    with pytest.raises(IndexError, match=r"token 2's slot 32 is outside the cache \(2 blocks of 16\)"):
        cpu_native.write_kv(x, x, k, v, torch.tensor([0, 1, 2 * BS]), ks, vs, lo, hi, torch.tensor([True, False, True]))
    assert all(torch.equal(a, b) for a, b in zip(before, _bytes([k, v, ks, vs, lo, hi])))


def test_writes_the_c_kernel_does_not_take_run_the_reference():
    """A bfloat16 cache, or bfloat16 keys: the reference writes them (same result as calling it)."""
    from cotserve.kernels.kv_fp8 import write_kv_ref

    x = torch.randn(2, 1, DIM)
    a, b = torch.zeros(2, BS, 1, DIM, dtype=torch.bfloat16), torch.zeros(2, BS, 1, DIM, dtype=torch.bfloat16)
    cpu_native.write_kv(x, x, a, b, torch.tensor([0, 17]))
    assert torch.equal(a[0, 0], x[0].bfloat16()) and torch.equal(b[1, 1], x[1].bfloat16())
    ref, got = _fp8_pages(2, 1, bounds=False), _fp8_pages(2, 1, bounds=False)
    xb = x.bfloat16()
    write_kv_ref(xb, xb, ref[0], ref[1], torch.tensor([0, 17]), ref[2], ref[3])
    cpu_native.write_kv(xb, xb, got[0], got[1], torch.tensor([0, 17]), got[2], got[3])
    assert all(torch.equal(p, q) for p, q in zip(_bytes(ref), _bytes(got)))
