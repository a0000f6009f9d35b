"""The small operations a decoder layer runs between its matrix multiplies, as plain-torch references.

RMSNorm (with the residual add folded in, as vLLM's fused_add_rms_norm), RoPE applied while the fused q/k/v output is
split into heads, and SwiGLU's silu(gate) * up. On a small model a decode step is mostly these: each reference is a few
torch operations, every one a pass over the batch and a dispatch (about 160 of them a step on the demo model, ~1 ms
of a batch-32 step's 5.6 on one thread). `cpu_native` runs each in one pass of C on the CPU; `dispatch.layer_ops_for`
chooses once per model. The references define the math: the C versions round as they do (RMSNorm's sum of squares may
associate differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (normalized, residual stream): with `residual`, the stream is `x + residual` and that sum is normalized;
    without, the stream is `x`. Computed in float32, returned in x's dtype."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), x


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE: x * cos + rotate_half(x) * sin (cos/sin broadcast over heads)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_split_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                   dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused projections' output [tokens, (heads + 2 kv_heads) * dim] -> q [tokens, heads, dim], k, v [tokens, kv_heads,
    dim], RoPE applied to q and k; cos/sin [tokens, dim]."""
    n = qkv.shape[0]
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    q = rotate_half_rope(q.reshape(n, heads, dim), cos, sin)
    k = rotate_half_rope(k.reshape(n, kv_heads, dim), cos, sin)
    return q, k, v.reshape(n, kv_heads, dim)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * inter] (gate, then up) -> silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(slots=True, frozen=True)
class LayerOps:
    """The small operations one model runs, fixed when it is loaded for serving."""

    name: str
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope_split: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[..., torch.Tensor] = F.linear
    transposed_weights: bool = False  # `linear` wants each weight stored transposed (`store_transposed`)


REFERENCE_OPS = LayerOps("torch-reference", rms_norm_ref, rope_split_ref, silu_mul_ref)


def store_transposed(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] as the transposed view of a contiguous [in, out] copy: the same values and shape, which
    `F.linear` and every torch operation take as they are, and whose memory a multiply can read a row of outputs at a
    time (`cpu_native.linear`)."""
    return weight.detach().t().contiguous().t()
