"""The Triton KV-cache kernels against their torch references, run by Triton's interpreter on the CPU
(`TRITON_INTERPRET=1`, set by tests/conftest.py when no GPU is present): quantize-and-write with
scales and page bounds, paged decode attention with FP8 dequantized in the kernel (all pages or the
selected ones), page scoring + top-k, and block copies. Random shapes: head_dim 64 and 128, GQA
ratios 1, 2 and 4, ragged lengths, partly filled last pages, single-token rows, scattered pages."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from cotserve.kernels import triton_kv  # noqa: E402
from cotserve.kernels.kv_fp8 import (FP8, decode_attention_ref, e4m3_error_bound, select_pages_from_bounds_ref,  # noqa: E402
                                     write_kv_ref)
from cotserve.kernels.paged_attention import copy_blocks_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(64, 4, 4), (128, 8, 2), (64, 4, 2), (128, 4, 1)]  # (head_dim, heads, kv_heads): GQA ratios 1, 4, 2, 4


@triton.jit
def _encode_decode(x_ptr, bits_ptr, back_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    bits = triton_kv._e4m3_bits(tl.load(x_ptr + i, mask=m, other=0.0))
    tl.store(bits_ptr + i, bits, mask=m)
    tl.store(back_ptr + i, triton_kv._e4m3_value(bits), mask=m)


def test_e4m3_encoding_matches_torch_on_every_value_and_every_tie():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = codes[torch.isfinite(codes)].unique()  # -448 .. 448, with subnormals
    mids = (finite[1:] + finite[:-1]) / 2  # exact ties: round half to even
    x = torch.cat([finite, mids, mids + 1e-7 * mids.abs(), mids - 1e-7 * mids.abs(), torch.rand(4000) * 896 - 448,
                   torch.tensor([0.0, 2.0 ** -10, -(2.0 ** -10), 2.0 ** -9 * 1.5, 447.99, 127.9])]).contiguous().to(DEV)
    bits = torch.empty(x.shape, dtype=torch.int32, device=DEV)
    back = torch.empty_like(x)
    _encode_decode[(triton.cdiv(x.numel(), 1024),)](x, bits, back, x.numel(), BLOCK=1024)
    want = x.to(FP8).float()
    assert torch.equal(back, want), x[back != want][:8]
    assert torch.equal(bits.to(torch.uint8).view(FP8).float(), want)


def make_writes(seed: int, dim: int, kv_heads: int, block_size: int = 16, num_blocks: int = 24):
    """Ragged sequences on scattered pages: (tables, lengths, keys, values, slots, fresh) for a first
    write of each sequence's prefix and a second write that continues mid-page."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 37, 16, 70][: 2 + seed % 3]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in lengths:
        pages = -(-n // block_size)
        tables.append(perm[at : at + pages])
        at += pages
    writes = []
    for part in (0, 1):  # the first ~60% of each sequence, then the rest
        pos, slots = [], []
        for table, n in zip(tables, lengths):
            cut = (n * 3) // 5 if n > 1 else 1
            span = range(0, cut) if part == 0 else range(cut, n)
            pos += list(span)
            slots += [table[p // block_size] * block_size + p % block_size for p in span]
        t = len(slots)
        scale = torch.exp(torch.randn(t, kv_heads, 1, generator=g) * 2)  # magnitudes over several binades
        keys = torch.randn(t, kv_heads, dim, generator=g) * scale
        values = torch.randn(t, kv_heads, dim, generator=g) * scale
        writes.append((keys, values, torch.tensor(slots, dtype=torch.int64), torch.tensor([p % block_size == 0 for p in pos])))
    return tables, lengths, writes


def new_cache(dtype, num_blocks, block_size, kv_heads, dim, scale_dtype=torch.float16):
    shape = (num_blocks, block_size, kv_heads, dim)
    c = dict(k_cache=torch.zeros(shape, dtype=dtype, device=DEV), v_cache=torch.zeros(shape, dtype=dtype, device=DEV),
             k_min=torch.full(shape[:1] + shape[2:], 5.0, device=DEV), k_max=torch.full(shape[:1] + shape[2:], -5.0, device=DEV))
    if dtype == FP8:
        c["k_scale"] = torch.zeros(shape[:3], dtype=scale_dtype, device=DEV)
        c["v_scale"] = torch.zeros(shape[:3], dtype=scale_dtype, device=DEV)
    return c


def written_caches(dtype, dim, kv_heads, seed, kernel, block_size=16, num_blocks=24, scale_dtype=torch.float16):
    tables, lengths, writes = make_writes(seed, dim, kv_heads, block_size, num_blocks)
    cache = new_cache(dtype, num_blocks, block_size, kv_heads, dim, scale_dtype)
    for keys, values, slots, fresh in writes:
        kernel(keys.to(DEV), values.to(DEV), cache["k_cache"], cache["v_cache"], slots.to(DEV), cache.get("k_scale"),
               cache.get("v_scale"), cache["k_min"], cache["k_max"], fresh.to(DEV))
    return tables, lengths, writes, cache


@pytest.mark.parametrize("dim,heads,kv_heads", SHAPES)
@pytest.mark.parametrize("dtype,scale_dtype", [(FP8, torch.float16), (FP8, torch.float32), (torch.float16, None),
                                               (torch.float32, None)])
def test_write_kv_matches_reference(dim, heads, kv_heads, dtype, scale_dtype):
    seed = dim + kv_heads
    _, _, writes, got = written_caches(dtype, dim, kv_heads, seed, triton_kv.write_kv, scale_dtype=scale_dtype)
    _, _, _, want = written_caches(dtype, dim, kv_heads, seed, write_kv_ref, scale_dtype=scale_dtype)
    used = torch.cat([w[2] for w in writes])
    for name in ("k_cache", "v_cache"):
        a = got[name].view(-1, kv_heads, dim)[used].float()
        b = want[name].view(-1, kv_heads, dim)[used].float()
        assert torch.equal(a, b), name  # bit-exact payloads (as values: -0 and +0 compare equal)
    if dtype == FP8:
        for name in ("k_scale", "v_scale"):
            assert torch.equal(got[name], want[name]), name
        keys = torch.cat([w[0] for w in writes]).to(DEV)
        back = got["k_cache"].view(-1, kv_heads, dim)[used].float() * got["k_scale"].view(-1, kv_heads)[used].float()[..., None]
        assert torch.all((back - keys).abs() <= e4m3_error_bound(keys, got["k_scale"].view(-1, kv_heads)[used]) * 1.0001)
    assert torch.equal(got["k_min"], want["k_min"]) and torch.equal(got["k_max"], want["k_max"])
    pages = torch.unique(torch.div(used, 16, rounding_mode="floor"))
    assert torch.all(got["k_min"][pages] <= got["k_max"][pages])  # reset and refilled, stale +-5 gone
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[pages.cpu()] = False
    assert torch.all(got["k_min"][untouched.to(DEV)] == 5.0)


def decode_inputs(tables, lengths, heads, dim, seed):
    g = torch.Generator().manual_seed(seed)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=DEV)
    q = (torch.randn(len(lengths), heads, dim, generator=g) * 2).to(DEV)
    return q, block_tables, torch.tensor(lengths, dtype=torch.int64, device=DEV)


@pytest.mark.parametrize("dim,heads,kv_heads", SHAPES)
@pytest.mark.parametrize("dtype", [FP8, torch.float16, torch.float32])
@pytest.mark.parametrize("topk", [0, 2, 3])
def test_decode_attention_matches_reference(dim, heads, kv_heads, dtype, topk):
    seed = 7 * dim + heads + kv_heads
    tables, lengths, _, cache = written_caches(dtype, dim, kv_heads, seed, write_kv_ref)
    q, block_tables, ctx = decode_inputs(tables, lengths, heads, dim, seed)
    scales = (cache.get("k_scale"), cache.get("v_scale"))
    pages = None
    if topk:
        pages = select_pages_from_bounds_ref(q, cache["k_min"], cache["k_max"], block_tables, ctx, topk, 16)
        assert pages.shape == (len(lengths), kv_heads, topk)
    got = triton_kv.decode_attention(q, cache["k_cache"], cache["v_cache"], block_tables, ctx, dim ** -0.5, *scales, pages)
    want = decode_attention_ref(q, cache["k_cache"], cache["v_cache"], block_tables, ctx, dim ** -0.5, *scales, pages)
    assert got.shape == q.shape
    tol = (2e-3 if dtype == torch.float16 else 2e-5) * float(want.abs().max().clamp(min=1))  # values reach ~50
    assert (got - want).abs().max() <= tol, (got - want).abs().max()
    if topk and max(lengths) > 16 * topk:  # the kernel skipped pages: with flat attention the full answer differs
        flat = q * 1e-3
        args = (cache["k_cache"], cache["v_cache"], block_tables, ctx, dim ** -0.5, *scales)
        selected = triton_kv.decode_attention(flat, *args, pages)
        assert torch.allclose(selected, decode_attention_ref(flat, *args, pages), atol=1e-4)
        assert not torch.allclose(selected, decode_attention_ref(flat, *args), atol=1e-3)


@pytest.mark.parametrize("dim,heads,kv_heads", SHAPES)
@pytest.mark.parametrize("topk", [2, 3, 4, 6, 8])
def test_select_pages_matches_reference(dim, heads, kv_heads, topk):
    seed = 3 * dim + heads + topk
    tables, lengths, _, cache = written_caches(FP8, dim, kv_heads, seed, write_kv_ref)
    q, block_tables, ctx = decode_inputs(tables, lengths, heads, dim, seed)
    got = triton_kv.select_pages(q, cache["k_min"], cache["k_max"], block_tables, ctx, topk, 16)
    want = select_pages_from_bounds_ref(q, cache["k_min"], cache["k_max"], block_tables, ctx, topk, 16)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="k: 1"):
        triton_kv.select_pages(q, cache["k_min"], cache["k_max"], block_tables, ctx, 1, 16)
    for row, n in enumerate(lengths):
        pages = -(-n // 16)
        for h in range(kv_heads):
            chosen = got[row, h].tolist()
            assert chosen[0] == 0 and pages - 1 in chosen  # the sink and the most recent page
            assert len(set(chosen)) == min(pages, topk)


@pytest.mark.parametrize("dtype", [FP8, torch.float16, torch.float32])
def test_copy_blocks_matches_reference(dtype):
    _, _, _, cache = written_caches(dtype, 64, 2, 11, write_kv_ref)
    twin = {k: v.clone() for k, v in cache.items()}
    src = torch.tensor([3, 0, 17, 5], dtype=torch.int64, device=DEV)
    dst = torch.tensor([20, 21, 2, 23], dtype=torch.int64, device=DEV)
    triton_kv.copy_blocks(list(cache.values()), src, dst)
    copy_blocks_ref(list(twin.values()), src, dst)
    for name in cache:
        a, b = cache[name], twin[name]
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b), name
        assert torch.equal((a.view(torch.uint8) if a.dtype == FP8 else a)[20], (a.view(torch.uint8) if a.dtype == FP8 else a)[3])


def test_dispatch_picks_triton_on_cuda_and_the_cpu_set_elsewhere(monkeypatch):
    from cotserve.kernels import cpu_native, dispatch

    monkeypatch.delenv("COTSERVE_KERNELS", raising=False)
    cpu = dispatch.kernels_for(torch.device("cpu"))  # the references, decode attention in C (built here)
    assert cpu.name == "cpu-native" and cpu.decode_attention is cpu_native.decode_attention
    cuda = dispatch.kernels_for(torch.device("cuda"))
    assert cuda.name == "triton" and cuda.decode_attention is triton_kv.decode_attention
    assert cuda.write_kv is triton_kv.write_kv and cuda.select_pages is triton_kv.select_pages
    monkeypatch.setenv("COTSERVE_KERNELS", "reference")
    assert dispatch.kernels_for(torch.device("cuda")) is dispatch.REFERENCE
    assert dispatch.kernels_for(torch.device("cpu")) is dispatch.REFERENCE
    monkeypatch.setenv("COTSERVE_KERNELS", "fast")
    with pytest.raises(ValueError, match="COTSERVE_KERNELS: 'fast', allowed auto, reference, triton, native"):
        dispatch.kernels_for(torch.device("cpu"))
