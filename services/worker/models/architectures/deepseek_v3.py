"""DeepSeek-V3 (and R1, its reasoning model): multi-head latent attention (`models/mla.py`: the cache holds each
token's compressed latent and its shared RoPE key, not keys and values) and, after the first `first_k_dense_replace`
dense layers, a mixture of experts with a shared expert and DeepSeek's router (sigmoid scores, a per-expert choice bias,
experts chosen within the best `topk_group` of `n_group` groups, weights scaled by `routed_scaling_factor`).
Checkpoints name an MoE layer's block `mlp` (`mlp.gate`, `mlp.experts.N.{gate,up,down}_proj`,
`mlp.shared_experts...`): mapped to the block's names. The multi-token-prediction layer the published checkpoints
carry past `num_hidden_layers` is not served (the loader leaves out layers the config does not count)."""

from __future__ import annotations

from typing import Any

from cotserve.worker.models.architectures.llama import build
from cotserve.worker.models.architectures.qwen3 import moe_weight_name
from cotserve.worker.models.config import MlaConfig, yarn_mscale
from cotserve.worker.models.registry import Architecture, register


def mla(raw: dict[str, Any]) -> MlaConfig:
    nope, rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    scale = (nope + rope) ** -0.5
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    if (params.get("rope_type") or params.get("type") or "default") != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
    q_rank = raw.get("q_lora_rank")
    return MlaConfig(q_lora_rank=int(q_rank) if q_rank else None, kv_lora_rank=int(raw["kv_lora_rank"]),
                     qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(raw["v_head_dim"]),
                     rope_interleave=bool(raw.get("rope_interleave", True)), scale=scale)


def config(raw: dict[str, Any]) -> dict[str, Any]:
    n, dense = int(raw["num_hidden_layers"]), int(raw.get("first_k_dense_replace") or 0)
    experts = int(raw.get("n_routed_experts") or raw.get("num_local_experts") or 0)
    bias = bool(raw.get("attention_bias", False))
    inter = int(raw.get("moe_intermediate_size") or 0)
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "mla": mla(raw),
            "head_dim": int(raw["qk_rope_head_dim"]),  # what RoPE rotates: the shared key's dimensions
            "num_experts": experts, "num_experts_per_tok": int(raw.get("num_experts_per_tok") or 0),
            "moe_intermediate_size": inter, "moe_layers": tuple(range(dense, n)),
            "moe_renormalize": bool(raw.get("norm_topk_prob", True)),
            "moe_sigmoid_groups": (int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)),
            "moe_scaling": float(raw.get("routed_scaling_factor") or 1.0),
            "moe_shared_intermediate": inter * int(raw.get("n_shared_experts") or 0)}


register(Architecture("DeepseekV3ForCausalLM", config, build, moe_weight_name))  # Qwen3-MoE's layout, plus a shared expert
