"""Triton kernels for the paged KV cache: the CUDA side of `kv_fp8` and `paged_attention`.

Four kernels, each the same function as a plain-torch reference (tests compare them under
`TRITON_INTERPRET=1` on the CPU):

- `write_kv`: quantize-and-write new keys/values into their slots (E4M3 payload + one scale per
  token per KV head, or a plain-dtype copy) and fold the keys into their pages' channel-wise
  min/max (`kv_fp8.write_fp8_ref`, `paged_attention.reshape_and_cache_ref`);
- `decode_attention`: one query token per row over that row's pages, FP8 dequantized inside the
  kernel (scales applied to the loaded tile; no copy of the cache is made), over every page or only
  the selected ones (`kv_fp8.decode_attention_ref`);
- `select_pages`: page scores (the query-aware upper bound) and the top-k selection, sink and
  most recent page forced in (`kv_fp8.select_pages_from_bounds_ref`);
- `copy_blocks`: block-to-block copies over every cache tensor, for copy-on-write forks and page
  compaction in the block manager (`paged_attention.copy_blocks_ref`).

E4M3 is encoded with integer arithmetic rather than a float cast: round-to-nearest-even, exact,
and identical to `torch.float8_e4m3fn` on every backend (the interpreter's float cast rounds some
values differently).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cotserve.kernels.kv_fp8 import E4M3_MAX, FP8, reset_fresh_pages


@triton.jit
def _e4m3_bits(y):
    """float32 y with |y| <= 448 -> E4M3 bit pattern (int32, 0..255), round to nearest even."""
    a = tl.abs(y)
    raw = a.to(tl.int32, bitcast=True)
    e = tl.maximum(((raw >> 23) & 0xFF) - 127, -6)  # floor(log2 a), subnormals share exponent -6
    mult = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)  # 2^(3-e), exact
    k = a * mult  # in [0, 16): mantissa with 3 fraction bits in the integer part
    r = (k + 8388608.0) - 8388608.0  # round half to even at integer precision
    bits = (e + 6) * 8 + r.to(tl.int32)  # a carry into the next exponent falls out of the sum
    return tl.where(y < 0, bits | 0x80, bits)


@triton.jit
def _e4m3_value(bits):
    """E4M3 bit pattern (int32) -> float32."""
    ef = (bits >> 3) & 0xF
    m = (bits & 7) + tl.where(ef > 0, 8, 0)
    p = ((tl.maximum(ef, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)
    v = m.to(tl.float32) * p
    return tl.where((bits & 0x80) != 0, -v, v)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, k_min_ptr, k_max_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr, SCALE_FP16: tl.constexpr, HAS_BOUNDS: tl.constexpr, SCALE_TINY: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    k = tl.load(key_ptr + tok * stride_kt + head * stride_kh + d, mask=dmask, other=0.0).to(tl.float32)
    v = tl.load(value_ptr + tok * stride_vt + head * stride_vh + d, mask=dmask, other=0.0).to(tl.float32)
    dst = (slot * NUM_KV_HEADS + head) * HEAD_DIM + d
    if IS_FP8:
        k_amax = tl.max(tl.abs(k), axis=0)
        v_amax = tl.max(tl.abs(v), axis=0)
        ks = tl.where(k_amax > 0, k_amax / 448.0, 1.0)
        vs = tl.where(v_amax > 0, v_amax / 448.0, 1.0)
        ks = tl.maximum(ks, SCALE_TINY)
        vs = tl.maximum(vs, SCALE_TINY)
        if SCALE_FP16:  # the payload is computed with the scale as stored
            ks = ks.to(tl.float16).to(tl.float32)
            vs = vs.to(tl.float16).to(tl.float32)
        kb = _e4m3_bits(tl.minimum(tl.maximum(k / ks, -448.0), 448.0))
        vb = _e4m3_bits(tl.minimum(tl.maximum(v / vs, -448.0), 448.0))
        tl.store(k_cache_ptr + dst, kb.to(tl.uint8), mask=dmask)
        tl.store(v_cache_ptr + dst, vb.to(tl.uint8), mask=dmask)
        tl.store(k_scale_ptr + slot * NUM_KV_HEADS + head, ks.to(k_scale_ptr.dtype.element_ty))
        tl.store(v_scale_ptr + slot * NUM_KV_HEADS + head, vs.to(v_scale_ptr.dtype.element_ty))
        k_read = _e4m3_value(kb) * ks  # the key as attention will read it
    else:
        kc = k.to(k_cache_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + dst, kc, mask=dmask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=dmask)
        k_read = kc.to(tl.float32)
    if HAS_BOUNDS:
        page = slot // BLOCK_SIZE
        b = (page * NUM_KV_HEADS + head) * HEAD_DIM + d
        tl.atomic_min(k_min_ptr + b, k_read, mask=dmask)
        tl.atomic_max(k_max_ptr + b, k_read, mask=dmask)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]: float8_e4m3fn or a plain dtype
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp16/fp32, FP8 caches only
    v_scale: torch.Tensor | None = None,
    k_min: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, head_dim] float32, or None
    k_max: torch.Tensor | None = None,
    fresh_page: torch.Tensor | None = None,  # [num_tokens] bool: resets the token's page bounds first
) -> None:
    num_tokens, heads, dim = key.shape
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    is_fp8 = k_cache.dtype == FP8
    has_bounds = k_min is not None
    if has_bounds:
        reset_fresh_pages(k_min, k_max, torch.div(slot_mapping, block_size, rounding_mode="floor"), fresh_page)
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    kc = k_cache.view(torch.uint8) if is_fp8 else k_cache
    vc = v_cache.view(torch.uint8) if is_fp8 else v_cache
    dummy = slot_mapping  # never dereferenced when the constexpr flag is off
    scale_dtype = k_scale.dtype if is_fp8 else torch.float32
    _write_kv_kernel[(num_tokens, heads)](
        key, value, kc, vc,
        k_scale if is_fp8 else dummy, v_scale if is_fp8 else dummy, slot_mapping,
        k_min if has_bounds else dummy, k_max if has_bounds else dummy,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=heads, HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_SIZE=block_size,
        IS_FP8=is_fp8, SCALE_FP16=scale_dtype == torch.float16, HAS_BOUNDS=has_bounds,
        SCALE_TINY=torch.finfo(scale_dtype).tiny,
    )


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, ctx_ptr, pages_ptr, out_ptr,
    sm_scale, stride_qb, stride_qh, stride_tb, stride_pb, stride_ph, num_selected,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr, SELECTED: tl.constexpr,
):
    row = tl.program_id(0)
    kv = tl.program_id(1)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_SIZE)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kv * GROUP + g
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    ctx = tl.load(ctx_ptr + row)
    num_pages = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    if SELECTED:
        n_iter = tl.minimum(num_pages, num_selected)
    else:
        n_iter = num_pages
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
    for i in range(0, n_iter):
        if SELECTED:
            page = tl.load(pages_ptr + row * stride_pb + kv * stride_ph + i)
        else:
            page = i
        block = tl.load(table_ptr + row * stride_tb + page).to(tl.int64)
        pos = page * BLOCK_SIZE + t
        tmask = pos < ctx
        slots = block * BLOCK_SIZE + t
        off = (slots[:, None] * NUM_KV_HEADS + kv) * HEAD_DIM + d[None, :]
        lmask = tmask[:, None] & dmask[None, :]
        if IS_FP8:  # dequantize the loaded tile: payload bits times the token's scale
            ks = tl.load(k_scale_ptr + slots * NUM_KV_HEADS + kv, mask=tmask, other=0.0).to(tl.float32)
            vs = tl.load(v_scale_ptr + slots * NUM_KV_HEADS + kv, mask=tmask, other=0.0).to(tl.float32)
            k = _e4m3_value(tl.load(k_cache_ptr + off, mask=lmask, other=0).to(tl.int32)) * ks[:, None]
            v = _e4m3_value(tl.load(v_cache_ptr + off, mask=lmask, other=0).to(tl.int32)) * vs[:, None]
        else:
            k = tl.load(k_cache_ptr + off, mask=lmask, other=0.0).to(tl.float32)
            v = tl.load(v_cache_ptr + off, mask=lmask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * sm_scale  # [GROUP_P, BLOCK_SIZE]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gmask[:, None] & dmask[None, :])


def decode_attention(
    query: torch.Tensor,  # [batch, num_heads, head_dim]: one decode token per row
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int64
    context_lens: torch.Tensor,  # [batch] int64, the query's own token included
    scale: float,
    k_scale: torch.Tensor | None = None,  # FP8 caches: [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None = None,
    pages: torch.Tensor | None = None,  # [batch, num_kv_heads, k] selected page indexes into each row's table
) -> torch.Tensor:  # [batch, num_heads, head_dim]
    batch, num_heads, dim = query.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    query = query.contiguous()
    out = torch.empty_like(query)
    if batch == 0:
        return out
    is_fp8 = k_cache.dtype == FP8
    group = num_heads // kv_heads
    tables = block_tables.contiguous()
    dummy = context_lens
    _decode_attention_kernel[(batch, kv_heads)](
        query, k_cache.view(torch.uint8) if is_fp8 else k_cache, v_cache.view(torch.uint8) if is_fp8 else v_cache,
        k_scale if is_fp8 else dummy, v_scale if is_fp8 else dummy, tables, context_lens,
        pages if pages is not None else dummy, out,
        scale, query.stride(0), query.stride(1), tables.stride(0),
        pages.stride(0) if pages is not None else 0, pages.stride(1) if pages is not None else 0,
        pages.shape[2] if pages is not None else 0,
        NUM_KV_HEADS=kv_heads, GROUP=group, GROUP_P=max(triton.next_power_of_2(group), 2), HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_SIZE=block_size, IS_FP8=is_fp8, SELECTED=pages is not None,
    )
    return out


@triton.jit
def _select_pages_kernel(
    q_ptr, k_min_ptr, k_max_ptr, table_ptr, ctx_ptr, scores_ptr, out_ptr,
    stride_qb, stride_qh, stride_tb, max_pages, k_sel,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, MAX_P: tl.constexpr,
):
    row = tl.program_id(0)
    kv = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    ctx = tl.load(ctx_ptr + row)
    num_pages = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    srow = scores_ptr + (row * NUM_KV_HEADS + kv) * max_pages
    # 1. each page's bound: max over the group's heads of sum_c max(q_c min_c, q_c max_c)
    for start in range(0, num_pages, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        pmask = p < num_pages
        block = tl.load(table_ptr + row * stride_tb + p, mask=pmask, other=0).to(tl.int64)
        off = (block[:, None] * NUM_KV_HEADS + kv) * HEAD_DIM + d[None, :]
        lm = pmask[:, None] & dmask[None, :]
        lo = tl.load(k_min_ptr + off, mask=lm, other=0.0)
        hi = tl.load(k_max_ptr + off, mask=lm, other=0.0)
        best = tl.full([BLOCK_P], float("-inf"), tl.float32)
        for gi in range(GROUP):
            qv = tl.load(q_ptr + row * stride_qb + (kv * GROUP + gi) * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
            bound = tl.sum(tl.maximum(qv[None, :] * lo, qv[None, :] * hi), axis=1)
            best = tl.maximum(best, bound)
        tl.store(srow + p, best, mask=pmask)
    tl.debug_barrier()
    # 2. top-k: sort (score, page) packed into one int64 key; the sink and the last page score +inf
    p = tl.arange(0, MAX_P)
    valid = p < num_pages
    s = tl.load(srow + p, mask=valid, other=float("-inf"))
    s = tl.where((p == 0) | (p == num_pages - 1), float("inf"), s)
    s = tl.where(valid, s, float("-inf"))
    bits = s.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone in the float's order
    key = (ordered.to(tl.int64) << 32) | (MAX_P - 1 - p).to(tl.int64)  # ties: the lower page first
    top = tl.sort(key, descending=True)
    page = (MAX_P - 1) - (top & 0xFFFFFFFF).to(tl.int32)
    n_sel = tl.minimum(num_pages, k_sel)
    page = tl.where(p < n_sel, page, MAX_P)  # keep the first n_sel, then ascending order
    page = tl.sort(page)
    last = tl.maximum(num_pages - 1, 0)
    page = tl.where(p < n_sel, page, last)
    tl.store(out_ptr + (row * NUM_KV_HEADS + kv) * k_sel + p, page.to(tl.int64), mask=p < k_sel)


def select_pages(
    query: torch.Tensor,  # [batch, num_heads, head_dim]
    k_min: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim] float32
    k_max: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int64
    context_lens: torch.Tensor,  # [batch] int64
    k: int,
    block_size: int,
) -> torch.Tensor:  # [batch, num_kv_heads, k] int64, ascending; rows with <= k pages padded with their last page
    if k < 2:
        raise ValueError(f"k: {k}, must be >= 2 (the first and the most recent page are always read)")
    batch, num_heads, dim = query.shape
    kv_heads = k_min.shape[1]
    max_pages = block_tables.shape[1]
    out = torch.empty(batch, kv_heads, k, dtype=torch.int64, device=query.device)
    if batch == 0:
        return out
    query = query.contiguous()
    tables = block_tables.contiguous()
    scores = torch.empty(batch, kv_heads, max_pages, dtype=torch.float32, device=query.device)
    max_p = max(triton.next_power_of_2(max(max_pages, k)), 2)
    _select_pages_kernel[(batch, kv_heads)](
        query, k_min, k_max, tables, context_lens, scores, out,
        query.stride(0), query.stride(1), tables.stride(0), max_pages, k,
        NUM_KV_HEADS=kv_heads, GROUP=num_heads // kv_heads, HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_SIZE=block_size, BLOCK_P=16, MAX_P=max_p,
    )
    return out


@triton.jit
def _copy_blocks_kernel(cache_ptr, src_ptr, dst_ptr, block_numel, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    off = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = off < block_numel
    tl.store(cache_ptr + dst * block_numel + off, tl.load(cache_ptr + src * block_numel + off, mask=mask), mask=mask)


def copy_blocks(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """For every tensor (its first dimension is the block), block dst[i] := block src[i]. The
    destinations must be distinct and none of them a source (the block manager copies into free blocks)."""
    if src.numel() == 0:
        return
    for cache in caches:
        flat = cache.view(torch.uint8) if cache.dtype == FP8 else cache
        flat = flat.view(cache.shape[0], -1)
        numel = flat.shape[1]
        block = min(1024, triton.next_power_of_2(numel))
        _copy_blocks_kernel[(src.numel(), triton.cdiv(numel, block))](flat, src, dst, numel, BLOCK=block)


__all__ = ["E4M3_MAX", "copy_blocks", "decode_attention", "select_pages", "write_kv"]
