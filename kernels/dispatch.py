"""The one place that chooses a kernel implementation for a device.

Triton on CUDA; on the CPU the plain-torch references (compiled by inductor, `cpu_compile`) with decode attention,
the bulk of a decode step, and cache writes run by a small C kernel (`cpu_native`) where a C compiler builds it
(DESIGN.md, Conventions: Kernels). The small operations between a layer's multiplies (`layer_ops`: RMSNorm, RoPE,
SwiGLU) and the dense multiplies themselves (over weights stored transposed) run in C there too, for float32 models.
`COTSERVE_KERNELS=reference` forces the references everywhere (a debugging switch, and the baseline the benches compare
against); `COTSERVE_LAYER_OPS=reference` only the layer operations' (torch's and MKL's: what the benches measure the C
ones against).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable

import torch

from cotserve.kernels import kv_fp8, layer_ops, paged_attention


@dataclass(slots=True, frozen=True)
class KernelSet:
    """The KV-cache kernels one worker uses, fixed at start-up."""

    name: str
    # new keys/values into their slots: FP8 with per-token, per-head scales, or a plain copy; page key min/max
    write_kv: Callable[..., None]
    # one decode query per row over its pages (all, or the selected ones), FP8 dequantized as read
    decode_attention: Callable[..., torch.Tensor]
    # query-aware page scores and top-k selection (sink and last page always kept)
    select_pages: Callable[..., torch.Tensor]
    # block dst := block src over every cache tensor (copy-on-write forks, compaction)
    copy_blocks: Callable[..., None]
    # prefill chunks (several queries per row): exact attention over the row's pages
    paged_attention: Callable[..., torch.Tensor] = paged_attention.paged_attention_ref
    paged_attention_fp8: Callable[..., torch.Tensor] = kv_fp8.paged_attention_fp8_ref


REFERENCE = KernelSet(
    name="torch-reference",
    write_kv=kv_fp8.write_kv_ref,
    decode_attention=kv_fp8.decode_attention_ref,
    select_pages=kv_fp8.select_pages_from_bounds_ref,
    copy_blocks=paged_attention.copy_blocks_ref,
)


def triton_kernels() -> KernelSet:
    from cotserve.kernels import triton_kv

    return KernelSet(
        name="triton",
        write_kv=triton_kv.write_kv,
        decode_attention=triton_kv.decode_attention,
        select_pages=triton_kv.select_pages,
        copy_blocks=triton_kv.copy_blocks,
    )


def native_cpu_kernels() -> KernelSet | None:
    """The references with decode attention and cache writes in C, or None where the C kernel cannot be built here."""
    from cotserve.kernels import cpu_native

    if not cpu_native.available():
        return None
    return dataclasses.replace(REFERENCE, name="cpu-native", decode_attention=cpu_native.decode_attention,
                               write_kv=cpu_native.write_kv)


def _kernels_choice() -> str:
    """COTSERVE_KERNELS (auto, reference, triton, native), checked."""
    choice = os.environ.get("COTSERVE_KERNELS", "auto")
    if choice not in ("auto", "reference", "triton", "native"):
        raise ValueError(f"COTSERVE_KERNELS: {choice!r}, allowed auto, reference, triton, native")
    return choice


def kernels_for(device: torch.device) -> KernelSet:
    """Kernels for `device` (COTSERVE_KERNELS: auto, reference, triton, native): auto is Triton on CUDA, the
    native CPU set on the CPU where it builds, else the reference."""
    choice = _kernels_choice()
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        return triton_kernels()
    if choice == "native" or (choice == "auto" and device.type == "cpu"):
        return native_cpu_kernels() or REFERENCE
    return REFERENCE


def layer_ops_for(device: torch.device, dtype: torch.dtype) -> layer_ops.LayerOps:
    """The small operations between a layer's multiplies, and the dense multiplies, for a model served on `device` in
    `dtype`: C on the CPU in float32 where the kernel builds (COTSERVE_KERNELS auto or native, COTSERVE_LAYER_OPS auto), else the torch
    references."""
    choice, ops = _kernels_choice(), os.environ.get("COTSERVE_LAYER_OPS", "auto")
    if ops not in ("auto", "reference"):
        raise ValueError(f"COTSERVE_LAYER_OPS: {ops!r}, allowed auto, reference")
    if device.type != "cpu" or dtype != torch.float32 or choice not in ("auto", "native") or ops == "reference":
        return layer_ops.REFERENCE_OPS
    from cotserve.kernels import cpu_native

    if not cpu_native.available():
        return layer_ops.REFERENCE_OPS
    return layer_ops.LayerOps("cpu-native", cpu_native.rms_norm, cpu_native.rope_split, cpu_native.silu_mul,
                              cpu_native.linear, transposed_weights=True)


def decode_layers_choice() -> str:
    """COTSERVE_DECODE_LAYERS, checked: auto (a step's layers in one C call where the C operations run them all,
    `cpu_native.DecodeLayers`, `ModelRunner._in_one_call`) or per-op (each operation a call from Python: the benches'
    comparison)."""
    choice = os.environ.get("COTSERVE_DECODE_LAYERS", "auto")
    if choice not in ("auto", "per-op"):
        raise ValueError(f"COTSERVE_DECODE_LAYERS: {choice!r}, allowed auto, per-op")
    return choice
