"""Qwen3 and Qwen3-MoE: Llama-shaped attention with an RMSNorm over each query and key head before RoPE, and for
Qwen3-MoE a mixture-of-experts block (`models/moe.py`: softmax top-k, renormalized when `norm_topk_prob`, no shared
expert) in every `decoder_sparse_step`-th layer not listed in `mlp_only_layers`, a dense SwiGLU MLP in the others.
Qwen3-MoE's checkpoints name an MoE layer's block `mlp` (`mlp.gate`, `mlp.experts.N.{gate,up,down}_proj`): mapped to
the block's names (`block_sparse_moe.gate`, `...experts.N.{w1,w3,w2}`)."""

from __future__ import annotations

import re
from typing import Any

from cotserve.worker.models.architectures.llama import biases, build
from cotserve.worker.models.registry import Architecture, register


def dense(raw: dict[str, Any]) -> dict[str, Any]:
    return {**biases("attention_bias", "attention_bias", False)(raw), "qk_norm": True}


def moe(raw: dict[str, Any]) -> dict[str, Any]:
    step = int(raw.get("decoder_sparse_step") or 1)
    dense_only = set(raw.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(int(raw["num_hidden_layers"])) if i not in dense_only and (i + 1) % step == 0)
    # the published checkpoints say num_experts; transformers 5 writes num_local_experts
    return {**dense(raw), "num_experts": int(raw.get("num_experts") or raw.get("num_local_experts") or 0),
            "num_experts_per_tok": int(raw.get("num_experts_per_tok") or 0),
            "moe_intermediate_size": int(raw.get("moe_intermediate_size") or 0),
            "moe_renormalize": bool(raw.get("norm_topk_prob", False)), "moe_layers": layers}


_EXPERT = re.compile(r"^(model\.layers\.\d+\.)mlp\.(experts\.\d+\.|shared_experts\.)(gate|up|down)_proj\.")
_ROUTER = re.compile(r"^(model\.layers\.\d+\.)mlp\.gate\.")
_EXPERT_WEIGHT = {"gate": "w1", "up": "w3", "down": "w2"}


def moe_weight_name(name: str) -> str:
    """A Qwen3-MoE (or DeepSeek-V3: its shared expert too) checkpoint's weight name as the model code names it."""
    if m := _EXPERT.match(name):
        return f"{m[1]}block_sparse_moe.{m[2]}{_EXPERT_WEIGHT[m[3]]}.{name[m.end():]}"
    if m := _ROUTER.match(name):
        return f"{m[1]}block_sparse_moe.gate.{name[m.end():]}"
    return name


register(Architecture("Qwen3ForCausalLM", dense, build))
register(Architecture("Qwen3MoeForCausalLM", moe, build, moe_weight_name))
