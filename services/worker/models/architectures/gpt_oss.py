"""gpt-oss: Llama-shaped attention (biased projections) with a learned sink logit per head in every softmax, layers
alternating between a sliding window and full attention (`layer_types`), YaRN RoPE, and in every layer a mixture of
experts whose router has a bias and weighs the top-k by a softmax over their logits, with stacked, biased experts
whose SwiGLU is clamped (`models/moe.py`, `ClampedExperts`). Checkpoints name the block `mlp` (`mlp.router`,
`mlp.experts.gate_up_proj`...): mapped to the block's names (`block_sparse_moe.gate`, `block_sparse_moe.experts...`).
The experts of the published checkpoints are MXFP4 (`loader.mxfp4_dequantized`)."""

from __future__ import annotations

import re
from typing import Any

from cotserve.worker.models.architectures.llama import build
from cotserve.worker.models.registry import Architecture, register


def layer_windows(raw: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window: `sliding_window` for a "sliding_attention" layer, None for a full one (without
    `layer_types`, the even layers slide, as transformers' GptOssConfig defaults)."""
    n, window = int(raw["num_hidden_layers"]), int(raw.get("sliding_window") or 128)
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types: {types!r}, expected {n} of sliding_attention / full_attention")
    return tuple(window if t == "sliding_attention" else None for t in types)


def config(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", True))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "attention_sinks": True,
            "layer_windows": layer_windows(raw), "sliding_window": None,
            "num_experts": int(raw.get("num_local_experts") or 0), "num_experts_per_tok": int(raw.get("num_experts_per_tok") or 0),
            "moe_router_bias": True, "moe_softmax_after_topk": True,
            "swiglu_limit": float(raw.get("swiglu_limit", 7.0)), "swiglu_alpha": float(raw.get("swiglu_alpha", 1.702))}


_BLOCK = re.compile(r"^(model\.layers\.\d+\.)mlp\.(router|experts)\.")


def weight_name(name: str) -> str:
    """A gpt-oss checkpoint's weight name as the model code names it."""
    if m := _BLOCK.match(name):
        return f"{m[1]}block_sparse_moe.{'gate' if m[2] == 'router' else 'experts'}.{name[m.end():]}"
    return name


register(Architecture("GptOssForCausalLM", config, build, weight_name))
