"""FP8 KV pages and query-aware page selection: the plain-torch references (issue 4's format).

Format of one layer's compressed cache (keys and values alike):
- payload `[num_blocks, block_size, num_kv_heads, head_dim]` in `torch.float8_e4m3fn` (OCP E4M3,
  largest finite value 448);
- scales `[num_blocks, block_size, num_kv_heads]` (float32 here; the cache may store fp16): each
  token's vector of each KV head is divided by its own scale `amax / 448` when written, so the
  largest element lands on 448 and nothing is clipped. No calibration; an all-zero vector gets
  scale 1 (it stays exactly zero);
- for keys only, per page and KV head, the channel-wise minimum and maximum of the keys written so
  far, `[num_blocks, num_kv_heads, head_dim]` each: the metadata page selection scores.

Page selection (Quest-style): for a query q of one KV head's group, a page's score
`sum_c max(q_c * min_c, q_c * max_c)` is an upper bound of `q . k` for every key k in the page, so
pages whose bound is low can be skipped. The first page (attention sink) and the last page (the
recent tokens) are always kept.

`cotserve.kernels.triton_kv` implements the same functions as Triton kernels for CUDA; these
references are what they are tested against, and what the worker runs on the CPU.
"""

from __future__ import annotations

import torch

from cotserve.kernels.cpu_compile import CompiledOnCpu

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn


def quantize_ref(x: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] -> (E4M3 payload [..., head_dim], scales [...] in `scale_dtype`) with one
    scale per vector. The payload is computed with the scale as stored (rounded to `scale_dtype`,
    at least its smallest normal number), and clamped to +-448 in case rounding made it smaller."""
    amax = x.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scale = scale.clamp(min=torch.finfo(scale_dtype).tiny).to(scale_dtype)
    return (x.float() / scale.float()[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def dequantize_ref(payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """payload * scale. E4M3 bits shifted into an fp16 bit pattern give value / 256 exactly (the
    exponent biases differ by 8; subnormals land on fp16 subnormals), so the factor 256 folds into
    the scale: exact for every finite E4M3 value and faster on the CPU than torch's float8 cast."""
    b = payload.view(torch.uint8).to(torch.int16)
    half = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).view(torch.float16)
    return (half.float() * (scale.float() * 256.0)[..., None]).to(dtype)


dequantize_fast = CompiledOnCpu(dequantize_ref)
"""`dequantize_ref` compiled by inductor on the CPU: the bit shuffling, the conversion and the scaling
fused into one vectorised loop (several times faster than eager, same results bit for bit)."""


def e4m3_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest round-trip error allowed per element of `x`: half a unit in the last place of E4M3
    at |x / scale| (3 mantissa bits: ulp = 2^(e - 3) for normals, 2^-9 for subnormals), times scale."""
    y = (x.float() / scale.float()[..., None]).abs()
    exp = torch.floor(torch.log2(torch.clamp(y, min=2.0 ** -6)))
    return 0.5 * torch.pow(2.0, exp - 3) * scale.float()[..., None]


def write_fp8_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] float8_e4m3fn
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,  # [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_min: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, head_dim]; None: no page metadata kept
    k_max: torch.Tensor | None = None,
    fresh_page: torch.Tensor | None = None,  # [num_tokens] bool: the token's slot is the first written in its page
) -> None:
    """Quantize and write new tokens into their slots, and fold their keys into their pages' min/max
    (reset first for pages that start with this write). Uses the dequantized keys, so the bound
    holds for what attention will actually read."""
    block_size, heads = k_cache.shape[1], k_cache.shape[2]
    kq, ks = quantize_ref(key, k_scale.dtype)
    vq, vs = quantize_ref(value, v_scale.dtype)
    k_cache.view(-1, heads, k_cache.shape[3])[slot_mapping] = kq
    v_cache.view(-1, heads, v_cache.shape[3])[slot_mapping] = vq  # (values may be of another size than keys)
    k_scale.view(-1, heads)[slot_mapping] = ks
    v_scale.view(-1, heads)[slot_mapping] = vs
    if k_min is not None:
        update_page_bounds_ref(dequantize_ref(kq, ks), k_min, k_max, slot_mapping, fresh_page, block_size)


def reset_fresh_pages(k_min: torch.Tensor, k_max: torch.Tensor, pages: torch.Tensor, fresh_page: torch.Tensor | None) -> None:
    """Empty the bounds (min +inf, max -inf) of the pages (`pages`, one per token) whose first slot
    this write fills, before the new keys are folded in."""
    if fresh_page is not None:
        fresh = pages[fresh_page]
        k_min[fresh] = float("inf")
        k_max[fresh] = float("-inf")


def update_page_bounds_ref(keys: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor, slot_mapping: torch.Tensor,
                           fresh_page: torch.Tensor, block_size: int) -> None:
    """Fold keys (as attention will read them) [num_tokens, kv_heads, dim] into their pages' channel-wise
    min/max, resetting pages whose first slot this write fills."""
    heads, dim = k_min.shape[1], k_min.shape[2]
    pages = torch.div(slot_mapping, block_size, rounding_mode="floor")
    reset_fresh_pages(k_min, k_max, pages, fresh_page)
    flat = keys.to(k_min.dtype).reshape(len(pages), heads * dim)
    index = pages[:, None].expand(-1, heads * dim)
    k_min.view(-1, heads * dim).scatter_reduce_(0, index, flat, "amin")
    k_max.view(-1, heads * dim).scatter_reduce_(0, index, flat, "amax")


def select_pages_from_bounds_ref(query: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor, k: int, block_size: int) -> torch.Tensor:
    """One decode query per row ([batch, heads, dim]) -> [batch, kv_heads, k] indexes into each row's
    block table of the pages to read: `page_scores_ref` then `select_pages_ref`."""
    if k < 2:
        raise ValueError(f"k: {k}, must be >= 2 (the first and the most recent page are always read)")
    max_pages = -(-int(context_lens.max()) // block_size) if context_lens.numel() else 0
    num_pages = torch.div(context_lens + block_size - 1, block_size, rounding_mode="floor")
    return select_pages_ref(page_scores_ref(query, k_min, k_max, block_tables[:, :max_pages]), num_pages, k)


def pages_key_mask(pages: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """[batch, kv_heads, k] selected pages -> [batch, kv_heads, max_ctx] True on their positions."""
    max_ctx = int(context_lens.max())
    max_pages = -(-max_ctx // block_size)
    keep = torch.zeros(pages.shape[0], pages.shape[1], max_pages, dtype=torch.bool, device=pages.device)
    keep.scatter_(2, pages.clamp(max=max_pages - 1), True)
    return keep.repeat_interleave(block_size, dim=2)[:, :, :max_ctx]


def page_scores_ref(
    query: torch.Tensor,  # [batch, num_heads, head_dim]
    k_min: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim]
    k_max: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int64
) -> torch.Tensor:  # [batch, num_kv_heads, max_blocks]
    """Upper bound of q.k per page, the most optimistic head of each KV head's query group."""
    batch, num_heads, dim = query.shape
    kv_heads = k_min.shape[1]
    q = query.float().view(batch, kv_heads, num_heads // kv_heads, 1, dim)
    lo = k_min[block_tables].float().permute(0, 2, 1, 3).unsqueeze(2)  # [batch, kv_heads, 1, blocks, dim]
    hi = k_max[block_tables].float().permute(0, 2, 1, 3).unsqueeze(2)
    bound = torch.maximum(q * lo, q * hi).sum(-1)  # [batch, kv_heads, group, blocks]
    return bound.amax(dim=2)


def select_pages_ref(scores: torch.Tensor, num_pages: torch.Tensor, k: int) -> torch.Tensor:
    """[batch, kv_heads, max_blocks] scores, [batch] pages in use -> [batch, kv_heads, k] page
    indexes (into each row's block table), sorted, always holding page 0 and the last page;
    rows with at most k pages keep all of them (padded with their last page)."""
    batch, kv_heads, max_blocks = scores.shape
    idx = torch.arange(max_blocks, device=scores.device)
    valid = idx[None, :] < num_pages[:, None]
    s = scores.masked_fill(~valid[:, None, :], float("-inf")).clone()
    last = (num_pages - 1).clamp(min=0)
    s[:, :, 0] = float("inf")
    s.scatter_(2, last.view(batch, 1, 1).expand(batch, kv_heads, 1), float("inf"))
    if k > max_blocks:  # always k wide: the padding below fills the extra columns with the last page
        s = torch.cat([s, s.new_full((batch, kv_heads, k - max_blocks), float("-inf"))], dim=2)
    top = s.topk(k, dim=-1).indices
    top = torch.where(top < num_pages.view(batch, 1, 1), top, last.view(batch, 1, 1))
    return top.sort(dim=-1).values


def paged_attention_fp8_ref(
    query: torch.Tensor,  # [batch, max_query_len, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] float8_e4m3fn
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,  # [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int64
    context_lens: torch.Tensor,  # [batch] int64
    query_lens: torch.Tensor,  # [batch] int64
    scale: float,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_ref` over FP8 pages: the reference dequantizes only the pages each row's
    block table names (the Triton kernel will dequantize inside the kernel, never a whole copy)."""
    from cotserve.kernels.paged_attention import attend_gathered, gather_pages

    keys = dequantize_fast(gather_pages(k_cache, block_tables, context_lens), gather_pages(k_scale, block_tables, context_lens), query.dtype)
    values = dequantize_fast(gather_pages(v_cache, block_tables, context_lens), gather_pages(v_scale, block_tables, context_lens), query.dtype)
    return attend_gathered(query, keys, values, context_lens, query_lens, scale, key_mask)


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 k_min: torch.Tensor | None = None, k_max: torch.Tensor | None = None,
                 fresh_page: torch.Tensor | None = None) -> None:
    """Write new keys/values into any cache format: FP8 pages with their scales, or a plain-dtype
    copy; with `k_min`/`k_max`, fold the keys (as stored) into their pages' bounds."""
    from cotserve.kernels.paged_attention import reshape_and_cache_ref

    if k_cache.dtype == FP8:
        write_fp8_ref(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, k_min, k_max, fresh_page)
        return
    reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping)
    if k_min is not None:
        update_page_bounds_ref(key.to(k_cache.dtype), k_min, k_max, slot_mapping, fresh_page, k_cache.shape[1])


def decode_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None, pages: torch.Tensor | None = None) -> torch.Tensor:
    """One decode query per row ([batch, heads, dim]) over its pages, all of them or only the
    selected `pages` [batch, kv_heads, k]; FP8 pages are dequantized as they are gathered, and with
    a selection only the selected pages are gathered (what the kernel reads, and on the CPU what
    makes top-k cheaper)."""
    if query.shape[0] == 0:
        return torch.empty_like(query)
    if pages is None:
        return _decode_all_pages_padded(query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    batch, num_heads, dim = query.shape
    block_size, kv_heads, k = k_cache.shape[1], k_cache.shape[2], pages.shape[2]
    blocks = block_tables.gather(1, pages.reshape(batch, kv_heads * k)).view(batch, kv_heads, k, 1)
    heads = torch.arange(kv_heads, device=query.device).view(1, kv_heads, 1, 1)
    tok = torch.arange(block_size, device=query.device).view(1, 1, 1, block_size)

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [batch, kv_heads, k * block_size, ...]
        x = cache[blocks, tok, heads]  # [batch, kv_heads, k, block_size, ...]
        return x.reshape(batch, kv_heads, k * block_size, *x.shape[4:])

    keys, values = gather(k_cache), gather(v_cache)
    if k_cache.dtype == FP8:
        keys, values = dequantize_fast(keys, gather(k_scale)), dequantize_fast(values, gather(v_scale))
    pos = (pages[..., None] * block_size + tok[0]).reshape(batch, kv_heads, k * block_size)
    num_pages = torch.div(context_lens + block_size - 1, block_size, rounding_mode="floor")
    first_copy = (torch.arange(k, device=query.device) < num_pages[:, None]).repeat_interleave(block_size, dim=1)  # padding repeats
    valid = (pos < context_lens[:, None, None]) & first_copy[:, None, :]
    q = query.float().view(batch, kv_heads, num_heads // kv_heads, dim)
    scores = (q @ keys.float().transpose(-1, -2)) * scale  # [batch, kv_heads, group, k * block_size]
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values.float()
    return out.reshape(batch, num_heads, dim).to(query.dtype)


def decode_all_pages_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One decode query per row ([batch, heads, dim]) over every page of its block table
    ([batch, max_blocks], padded with any valid block), written to be read in place: token t of row b
    is slot (block_tables[b, t // block_size], t % block_size), keys at or past the row's context
    length are masked, FP8 pages are dequantized as they are read. Compiled (`decode_all_pages`),
    this is one loop nest over the cache; eager, it gathers the pages like any reference."""
    batch, num_heads, dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    t = torch.arange(block_tables.shape[1] * block_size, device=query.device)
    blocks = block_tables[:, t // block_size]  # [batch, T]
    offsets = (t % block_size).expand_as(blocks)
    keys, values = k_cache[blocks, offsets], v_cache[blocks, offsets]  # [batch, T, kv_heads, dim]
    if k_cache.dtype == FP8:
        keys, values = dequantize_ref(keys, k_scale[blocks, offsets]), dequantize_ref(values, v_scale[blocks, offsets])
    q = query.float().view(batch, 1, kv_heads, num_heads // kv_heads, dim)
    scores = (keys.float()[:, :, :, None, :] * q).sum(-1) * scale  # [batch, T, kv_heads, group]
    scores = scores.masked_fill((t[None, :] >= context_lens[:, None])[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs[..., None] * values.float()[:, :, :, None, :]).sum(1)  # [batch, kv_heads, group, dim]
    return out.reshape(batch, num_heads, dim).to(query.dtype)


decode_all_pages = CompiledOnCpu(decode_all_pages_ref)
"""`decode_all_pages_ref` compiled by inductor on the CPU (what the worker runs there for decode rows)."""


def _decode_all_pages_padded(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                             context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None,
                             v_scale: torch.Tensor | None) -> torch.Tensor:
    """`decode_all_pages` on at least two rows of at least two pages: torch specialises sizes of 1, so
    one row or one page would each compile a variant of their own (seconds each) where padding costs
    a row of a few pages. Padding rows attend to one key of block 0; their outputs are dropped."""
    batch, width = block_tables.shape
    if batch < 2 or width < 2:
        rows, cols = max(0, 2 - batch), max(0, 2 - width)
        query = torch.nn.functional.pad(query, (0, 0, 0, 0, 0, rows))
        block_tables = torch.nn.functional.pad(block_tables, (0, cols, 0, rows))
        context_lens = torch.nn.functional.pad(context_lens, (0, rows), value=1)
    out = decode_all_pages(query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    return out[:batch]
