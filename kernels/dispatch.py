"""The one place that chooses a kernel implementation for a device.

Triton on CUDA, the plain-torch reference elsewhere (DESIGN.md, Conventions: Kernels). Until the
Triton kernels land, every device gets the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from cotserve.kernels import kv_fp8, paged_attention


@dataclass(slots=True, frozen=True)
class KernelSet:
    """The attention kernels one worker uses, fixed at start-up."""

    name: str
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    write_fp8: Callable[..., None]  # FP8 pages with per-token, per-head scales
    paged_attention_fp8: Callable[..., torch.Tensor]
    update_page_bounds: Callable[..., None]  # per-page key min/max for top-k page selection
    topk_key_mask: Callable[..., torch.Tensor]


REFERENCE = KernelSet(
    name="torch-reference",
    reshape_and_cache=paged_attention.reshape_and_cache_ref,
    paged_attention=paged_attention.paged_attention_ref,
    write_fp8=kv_fp8.write_fp8_ref,
    paged_attention_fp8=kv_fp8.paged_attention_fp8_ref,
    update_page_bounds=kv_fp8.update_page_bounds_ref,
    topk_key_mask=kv_fp8.topk_key_mask_ref,
)


def kernels_for(device: torch.device) -> KernelSet:
    """Kernels for `device`."""
    return REFERENCE
