"""Phi3 (Phi-3, Phi-4, Phi-4-mini, Phi-4-reasoning): the Llama design with q/k/v and gate/up stored fused in the
checkpoint (`qkv_proj`, `gate_up_proj`: split at load into the model's projections, which it fuses again for its own
multiplies), RoPE over a share of each head (`partial_rotary_factor`) and LongRoPE scaling (its short factors:
contexts up to the original length are served, `ModelConfig.max_context`)."""

from __future__ import annotations

from typing import Any

from cotserve.worker.models.architectures.llama import biases, build
from cotserve.worker.models.registry import Architecture, register


def split(name: str, tensor: Any, cfg: Any) -> list[tuple[str, Any]]:
    """`...self_attn.qkv_proj.*` as q/k/v (rows: the query heads, then the key and the value heads) and
    `...mlp.gate_up_proj.*` as gate and up (the first half gates, as transformers' chunk(2) reads it)."""
    head, _, leaf = name.rpartition(".")
    if head.endswith(".self_attn.qkv_proj"):
        prefix, q, kv = head.removesuffix("qkv_proj"), cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        parts = tensor.split([q, kv, kv])
        return [(f"{prefix}{proj}.{leaf}", part) for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts)]
    if head.endswith(".mlp.gate_up_proj"):
        prefix = head.removesuffix("gate_up_proj")
        gate, up = tensor.chunk(2)
        return [(f"{prefix}gate_proj.{leaf}", gate), (f"{prefix}up_proj.{leaf}", up)]
    return [(name, tensor)]


register(Architecture("Phi3ForCausalLM", biases(False, False, False), build, split=split))
