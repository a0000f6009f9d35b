"""Decode attention, cache writes, a decoder layer's small operations and its linear layers on the CPU as small C
kernels (`cpu_decode.c`), built at first use and called through ctypes.

Why not the reference compiled by inductor (`cpu_compile`): a decode step's attention is a memory-bound read of every
row's pages, and the loop nest inductor makes of `decode_all_pages_ref` reads them several times over, the value
reduction one scalar at a time; on FP8 pages it is slower still (the bit-shuffling dequantization does not vectorise
there).

Attention goes one (row, KV head) at a time, a page at a time: the page's keys and values for that head are read once
for every query head of its group (from the cache's f32 pages in place, or dequantized into a page buffer), with an
online softmax whose exponentials are one vectorised pass over the page's scores, each query head's accumulator in
registers over the page (the head size a compile-time constant for 64 and 128), four tokens' dot products reduced to
their scores together, never a token past the row's context, and nothing copied. E4M3 is decoded by placing its bits
in a float's exponent and mantissa and multiplying by 2^120 (exact, and it vectorises, which a table's gathers do
not); with one query head per KV head the FP8 pages are read in place (each token's scale multiplies its score or its
softmax weight once), a larger group dequantizes the page into a buffer once for all its heads. (row, KV head) pairs
are spread over torch's thread count with OpenMP when the build has it: torch's own OpenMP runtime, loaded once per
process, so the two share one thread team.

FP8 writes (`write_kv`): the reference quantizes a layer's new keys and values, writes payload and scales and folds the
keys into their pages' bounds in about twenty torch operations, each a pass over the tokens and a dispatch; the C
write does it in one pass per token and head, bit for bit the reference's (round to nearest even, as torch's
float8_e4m3fn cast). fp32 pages are written by the same pass (a copy, and the page bounds folded in).

The layer's small operations (`layer_ops`: RMSNorm with the residual add, RoPE while splitting q/k/v, SiLU times up)
are one pass each instead of 3-12 torch operations; SiLU's exponential is plain arithmetic (`exp_approx`), not a libm
call per element.

The linear layers (`linear`, `cotserve_linear`): MKL's sgemm packs the weight into its own panel format on every call,
a large share of each multiply at a decode step's few rows. The served model stores each weight transposed ([in, out]
contiguous, the parameter a transposed view of it: `layer_ops.store_transposed`), whose rows already are panels, and a
6-row x 64-column tile keeps its accumulators in vector registers over the whole input. Up to `LINEAR_MAX_ROWS` rows;
beyond, MKL on the same transposed weight.

It is plain C (no torch headers), so building it takes a fraction of a second with the system's C compiler: `cc -O3
-march=native -fopenmp`, cached under `~/.cache/cotserve/kernels` by the source, the flags and the CPU's features.
What each kernel gained over the reference it replaced is in docs/benchmarks/cpu-kernels.md.

Where they do not apply (a query or keys that are not float32, another cache dtype, no C compiler) the references
run, as they do under `COTSERVE_KERNELS=reference`; `cotserve.kernels.dispatch` makes the choice once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cotserve.common.paths import cache_dir
from cotserve.kernels import kv_fp8, layer_ops

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
KV_KINDS = {torch.float32: 0, kv_fp8.FP8: 1}
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, flags: list[str]) -> Path:
    """The shared library for `flags`, from the cache or compiled into it (written to a temporary name, then renamed,
    so concurrent builders never load a half-written file)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *flags, _cpu_features()]).encode()).hexdigest()[:16]
    target = cache_dir("kernels") / f"cpu_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp, target.name)
        subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", str(out), str(SOURCE), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(out, target)
    return target


def library() -> ctypes.CDLL | None:
    """The built kernel, or None where there is no C compiler or every build failed (logged once)."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            log.warning("no C compiler: CPU decode attention runs the torch reference")
            return None
        errors = []
        for flags in FLAG_SETS:
            try:
                lib = ctypes.CDLL(str(_build(compiler, flags)))
                break
            except (OSError, subprocess.SubprocessError) as exc:
                errors.append(f"{' '.join(flags)}: {getattr(exc, 'stderr', b'') or exc}")
        else:
            log.warning("CPU decode kernel did not build, running the torch reference: %s", "; ".join(map(str, errors)))
            return None
        fn = lib.cotserve_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
                       + [ctypes.c_void_p] + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int])
        fn = lib.cotserve_write_kv
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 5
        lib.cotserve_rms_norm.restype = None
        lib.cotserve_rms_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
        lib.cotserve_rope_split.restype = None
        lib.cotserve_rope_split.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4
        lib.cotserve_linear.restype = None
        lib.cotserve_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.cotserve_silu_mul.restype = None
        lib.cotserve_silu_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        lib.cotserve_decode_layer_fields.restype = ctypes.c_int64
        lib.cotserve_decode_layers.restype = ctypes.c_int
        lib.cotserve_decode_layers.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 11
                                               + [ctypes.c_int64] * 9 + [ctypes.c_float] * 2 + [ctypes.c_int])
        _lib = lib
        return lib


def available() -> bool:
    return library() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
             v_scale: torch.Tensor | None) -> bool:
    """The shapes and dtypes the C kernel takes: float32 queries on the CPU over fp32 pages or FP8 pages with fp16
    scales, head_dim <= 512, block size <= 64, query heads per KV head <= 16."""
    if query.device.type != "cpu" or query.dtype != torch.float32 or k_cache.dtype not in KV_KINDS:
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if k_cache.dtype == kv_fp8.FP8 and not all(s is not None and s.dtype == torch.float16 and s.is_contiguous()
                                                for s in (k_scale, v_scale)):
        return False
    heads, kv_heads, dim = query.shape[1], k_cache.shape[2], query.shape[2]
    return dim <= 512 and k_cache.shape[1] <= 64 and heads % kv_heads == 0 and heads // kv_heads <= 16


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, pages: torch.Tensor | None = None) -> torch.Tensor:
    """`kv_fp8.decode_attention_ref`'s contract, run by the C kernel where it applies (else by the reference)."""
    lib = library()
    if lib is None or not supports(query, k_cache, v_cache, k_scale, v_scale) or query.shape[0] == 0:
        return kv_fp8.decode_attention_ref(query, k_cache, v_cache, block_tables, context_lens, scale, k_scale,
                                           v_scale, pages)
    batch, heads, dim = query.shape
    query, tables = query.contiguous(), block_tables.to(torch.int64).contiguous()
    ctx = context_lens.to(torch.int64).contiguous()
    if pages is not None:
        pages = pages.to(torch.int64).contiguous()
    out = torch.empty_like(query)
    quantized = k_cache.dtype == kv_fp8.FP8
    rc = lib.cotserve_decode_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_scale.data_ptr() if quantized else None, v_scale.data_ptr() if quantized else None, KV_KINDS[k_cache.dtype],
        tables.data_ptr(), ctx.data_ptr(), pages.data_ptr() if pages is not None else None,
        pages.shape[2] if pages is not None else 0, out.data_ptr(), batch, heads, k_cache.shape[2], dim,
        k_cache.shape[1], tables.shape[1], k_cache.shape[0], scale, torch.get_num_threads())
    if rc == -1:
        raise ValueError(f"decode attention: shapes out of the CPU kernel's range (query {tuple(query.shape)}, "
                         f"cache {tuple(k_cache.shape)})")
    if rc != 0:
        row = -2 - rc
        raise IndexError(f"decode attention: row {row} reads outside its block table or the cache (context length "
                         f"{int(ctx[row])}, table width {tables.shape[1]}, {k_cache.shape[0]} blocks)")
    return out


def _writes_natively(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, k_min: torch.Tensor | None,
                     k_max: torch.Tensor | None) -> bool:
    """What the C write takes: float32 keys and values on the CPU into a cache `_native_cache` takes, head_dim <= 512."""
    if key.device.type != "cpu" or key.dtype != torch.float32 or value.dtype != torch.float32 or key.shape[-1] > 512:
        return False
    return _native_cache(k_cache, v_cache, k_scale, v_scale, k_min, k_max)


def _native_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None, k_min: torch.Tensor | None, k_max: torch.Tensor | None) -> bool:
    """Contiguous float32 pages, or FP8 pages with fp16 scales (and float32 page bounds, if any)."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in KV_KINDS:
        return False
    scales = [k_scale, v_scale] if k_cache.dtype == kv_fp8.FP8 else []
    tensors = [k_cache, v_cache, *scales] + ([k_min, k_max] if k_min is not None else [])
    if any(t is None or not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        return False
    bounds_ok = k_min is None or (k_max is not None and k_min.dtype == k_max.dtype == torch.float32)
    return bounds_ok and all(s.dtype == torch.float16 for s in scales)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             k_min: torch.Tensor | None = None, k_max: torch.Tensor | None = None,
             fresh_page: torch.Tensor | None = None) -> None:
    """`kv_fp8.write_kv_ref`'s contract, run by the C kernel for float32 and FP8 pages (quantization, scales and page
    bounds in one pass over the new tokens, instead of a score of torch operations per layer; a float32 write is a copy
    and the bounds in the same pass), other caches by the reference. Bit for bit the reference's."""
    lib = library()
    if lib is None or not _writes_natively(key, value, k_cache, v_cache, k_scale, v_scale, k_min, k_max) \
            or key.shape[0] == 0:
        kv_fp8.write_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_min, k_max, fresh_page)
        return
    key, value = key.contiguous(), value.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    fresh = fresh_page.to(torch.bool).contiguous() if fresh_page is not None and k_min is not None else None
    blocks, block_size, kv_heads, dim = k_cache.shape
    quantized = k_cache.dtype == kv_fp8.FP8
    rc = lib.cotserve_write_kv(
        KV_KINDS[k_cache.dtype], key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_scale.data_ptr() if quantized else None, v_scale.data_ptr() if quantized else None,
        slots.data_ptr(), fresh.data_ptr() if fresh is not None else None,
        k_min.data_ptr() if k_min is not None else None, k_max.data_ptr() if k_max is not None else None,
        key.shape[0], kv_heads, dim, block_size, blocks)
    if rc != 0:
        token = -2 - rc
        raise IndexError(f"write_kv: token {token}'s slot {int(slots[token])} is outside the cache "
                         f"({blocks} blocks of {block_size})")


def _f32_rows(*tensors: torch.Tensor | None) -> bool:
    """Every tensor given is a contiguous float32 CPU tensor (what the small operations' C takes)."""
    for t in tensors:
        if t is not None and not (t.dtype is torch.float32 and t.is_cpu and t.is_contiguous()):
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer_ops.rms_norm_ref`'s contract in one pass of C; the residual stream is summed into `residual` in place
    (the caller's stream, which the reference would replace by a new tensor)."""
    lib = _lib or library()  # built once: the lock only until then
    hidden = x.shape[-1]
    if lib is None or not _f32_rows(x, weight, residual) or weight.numel() != hidden \
            or (residual is not None and residual.shape != x.shape):
        return layer_ops.rms_norm_ref(x, weight, eps, residual)
    out = torch.empty_like(x)
    lib.cotserve_rms_norm(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                          out.data_ptr(), x.numel() // max(hidden, 1), hidden, eps, torch.get_num_threads())
    return out, x if residual is None else residual


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`layer_ops.rope_split_ref`'s contract in one pass of C (the same rounding: bit for bit)."""
    lib = _lib or library()  # built once: the lock only until then
    n = qkv.shape[0]
    if lib is None or not _f32_rows(qkv, cos, sin) or qkv.shape[-1] != (heads + 2 * kv_heads) * dim or dim % 2 \
            or cos.shape != (n, dim) or sin.shape != (n, dim):
        return layer_ops.rope_split_ref(qkv, cos, sin, heads, kv_heads, dim)
    q = qkv.new_empty(n, heads, dim)
    k, v = qkv.new_empty(n, kv_heads, dim), qkv.new_empty(n, kv_heads, dim)
    lib.cotserve_rope_split(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                            n, heads, kv_heads, dim)
    return q, k, v


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`layer_ops.silu_mul_ref`'s contract in one pass of C."""
    lib = _lib or library()  # built once: the lock only until then
    if lib is None or not _f32_rows(gate_up) or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        return layer_ops.silu_mul_ref(gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    lib.cotserve_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
    return out


LINEAR_MAX_ROWS = 4096
"""Rows (tokens) up to which `linear` runs the C multiply (a step's default token budget is 2048): the demo model's
multiplies at 256 / 512 / 2048 rows ran 1.05-1.18x MKL's over the same transposed weights, on one thread and on two
(two runs, a quiet machine); beyond, untried, MKL."""


def transposed(weight: torch.Tensor) -> bool:
    """Whether `weight` [out, in] is a transposed view of a contiguous [in, out] tensor (`layer_ops.store_transposed`)."""
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`'s contract; in one pass of C (`cotserve_linear`) for float32 rows on the CPU with the weight stored
    transposed, up to `LINEAR_MAX_ROWS` rows."""
    lib = _lib or library()  # built once: the lock only until then
    rows = x.numel() // max(x.shape[-1], 1)
    takes = transposed(weight) and weight.dtype == torch.float32 and weight.is_cpu and _f32_rows(x, bias) \
        and x.shape[-1] == weight.shape[1] and (bias is None or bias.shape == (weight.shape[0],))
    if lib is None or rows > LINEAR_MAX_ROWS or not takes:
        return F.linear(x, weight, bias)
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    lib.cotserve_linear(x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(),
                        rows, weight.shape[0], weight.shape[1], torch.get_num_threads())
    return out


LAYER_FIELDS = 17
"""A layer's row in `cotserve_decode_layers`' table: ten weights and biases, six cache tensors, the cache's kind."""


@dataclass(slots=True, frozen=True)
class DecodeLayer:
    """One decoder layer's tensors as `DecodeLayers` takes them: norms' weights, the fused q/k/v and gate/up weights
    and the output and down projections (each stored transposed, `layer_ops.store_transposed`; biases or None), and
    its cache (`worker.kv_spec.LayerCache`: keys, values, FP8 scales or None, page bounds or None)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    cache: Any

    def addresses(self) -> list[int]:
        """The C function's row for this layer (`cotserve_decode_layers`' LAYER_FIELDS order), its cache's kind last."""
        c = self.cache
        return [0 if t is None else t.data_ptr() for t in (
            self.input_norm, self.qkv, self.qkv_bias, self.o, self.o_bias, self.post_norm, self.gate_up,
            self.gate_up_bias, self.down, self.down_bias, c.k, c.v, c.k_scale, c.v_scale, c.k_min,
            c.k_max)] + [KV_KINDS[c.k.dtype]]


class DecodeLayers:
    """A step's decoder layers in one C call (`cotserve_decode_layers`): every layer's norm, multiplies, RoPE, cache
    write and attention over all pages, then the final norm, each the C operation the per-operation path calls
    (`rms_norm`, `linear`, `rope_split`, `write_kv`, `decode_attention`, `silu_mul`) with the same arguments, so for a
    step of decode rows the results are that path's bit for bit (tested). A prompt chunk's tokens are rows too: each
    attends over its sequence's pages up to its own position (its key and value written first), which is causal
    attention a token at a time (the per-operation path's batched prompt attention rounds differently: within 1e-5,
    tested). Why: on the demo model a third of a decode step at batch 32 was the Python between those operations
    (module calls, a tensor per result, ctypes' conversions of ten calls a layer); `cotserve bench baseline`'s engine
    rows run both (`COTSERVE_DECODE_LAYERS=per-op`).

    Build it with `build`, which says None for anything the C operations do not all take; the tensors' addresses are
    read once there, so the weights and caches must stay where they are (they do: loaded once, allocated once)."""

    def __init__(self, layers: list[DecodeLayer], final_norm: torch.Tensor, eps: float, heads: int, kv_heads: int,
                 dim: int, scale: float) -> None:
        self.layers = layers  # holds the tensors whose addresses `table` has
        self.final_norm, self.eps, self.scale = final_norm, eps, scale
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.hidden, self.inter = final_norm.numel(), layers[0].down.shape[1]
        self.block_size, self.num_blocks = layers[0].cache.k.shape[1], layers[0].cache.k.shape[0]
        self.row_floats = 2 * self.hidden + 2 * (heads + 2 * kv_heads) * dim + heads * dim + 3 * self.inter
        self.table = torch.tensor([layer.addresses() for layer in layers], dtype=torch.int64)

    @classmethod
    def build(cls, layers: list[DecodeLayer], final_norm: torch.Tensor, eps: float, heads: int, kv_heads: int,
              dim: int, scale: float) -> "DecodeLayers | None":
        """The stack, or None where the C library is not here or a tensor is not one the C operations take."""
        lib = library()
        if lib is None or not layers or lib.cotserve_decode_layer_fields() != LAYER_FIELDS:
            return None
        if dim % 2 or dim > 512 or heads % kv_heads or heads // kv_heads > 16 or not _f32_rows(final_norm):
            return None
        hidden, inter = final_norm.numel(), layers[0].down.shape[1]
        shapes = {"qkv": ((heads + 2 * kv_heads) * dim, hidden), "o": (hidden, heads * dim),
                  "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        first = layers[0].cache.k
        for layer in layers:
            for name, shape in shapes.items():
                weight, bias = getattr(layer, name), getattr(layer, f"{name}_bias")
                if not (transposed(weight) and weight.dtype == torch.float32 and weight.is_cpu
                        and tuple(weight.shape) == shape and _f32_rows(bias)
                        and (bias is None or bias.shape == (shape[0],))):
                    return None
            if not (_f32_rows(layer.input_norm, layer.post_norm) and layer.input_norm.numel() == hidden
                    and layer.post_norm.numel() == hidden):
                return None
            c = layer.cache
            if c.k.shape != first.shape or first.shape[1] > 64 or first.shape[2:] != (kv_heads, dim) \
                    or not _native_cache(c.k, c.v, c.k_scale, c.v_scale, c.k_min, c.k_max):
                return None
        return cls(layers, final_norm, eps, heads, kv_heads, dim, scale)

    def takes(self, rows: int) -> bool:
        """Whether a step of `rows` tokens runs here: the per-operation multiply leaves C beyond LINEAR_MAX_ROWS."""
        return 0 < rows <= LINEAR_MAX_ROWS

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 fresh: torch.Tensor | None, tables: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] the embedded tokens (used as the residual stream: overwritten), cos/sin [n, dim], and per token
        its slot, its page table [n, width] and its context length (a decode row's, or a prompt token's: its position
        + 1) -> the final norm's output [n, hidden]."""
        n = x.shape[0]
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        if x.shape != (n, self.hidden) or cos.shape != (n, self.dim) or sin.shape != (n, self.dim) \
                or not _f32_rows(x, cos, sin):
            raise ValueError(f"decode layers: x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: want "
                             f"float32 [{n}, {self.hidden}] and [{n}, {self.dim}]")
        slots, tables, ctx = (t.to(torch.int64).contiguous() for t in (slots, tables, ctx))
        fresh = fresh.to(torch.bool).contiguous() if fresh is not None else None
        work = x.new_empty(n * self.row_floats)
        out, err = x.new_empty(n, self.hidden), torch.zeros(2, dtype=torch.int64)
        rc = _lib.cotserve_decode_layers(
            self.table.data_ptr(), len(self.layers), self.final_norm.data_ptr(), x.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), fresh.data_ptr() if fresh is not None else None, tables.data_ptr(),
            ctx.data_ptr(), work.data_ptr(), out.data_ptr(), err.data_ptr(), n, self.hidden, self.heads,
            self.kv_heads, self.dim, self.inter, self.block_size, tables.shape[1], self.num_blocks, self.eps,
            self.scale, torch.get_num_threads())
        if rc != 0:
            op, code = int(err[0]), int(err[1])
            if code == -1:
                raise ValueError(f"decode layers: shapes out of the CPU kernels' range (dim {self.dim})")
            row = -2 - code
            if op == 0:
                raise IndexError(f"write_kv: token {row}'s slot {int(slots[row])} is outside the cache "
                                 f"({self.num_blocks} blocks of {self.block_size})")
            raise IndexError(f"decode attention: row {row} reads outside its block table or the cache (context "
                             f"length {int(ctx[row])}, table width {tables.shape[1]}, {self.num_blocks} blocks)")
        return out
