"""The mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE), with a live routing policy.

Routing: softmax over the gate's logits, the top-k experts per token, their weights renormalized
over the chosen ones (Mixtral; Qwen3-MoE when its config says `norm_topk_prob`, else the softmax's own). A policy may add a per-expert bias used only to choose the
experts (the weights still come from the unbiased scores, as in DeepSeek-V3's auxiliary-loss-free
balancing) and may disable experts, which are then never chosen. With no policy the block
computes exactly what Mixtral does. The block counts tokens routed to each expert.
"""

from __future__ import annotations

import torch
from torch import nn

from cotserve.common.moe_policy import LayerRouting, RoutingPolicy

__all__ = ["Expert", "LayerRouting", "RoutingPolicy", "SparseMoeBlock"]
from cotserve.worker.models.config import ModelConfig


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)  # gate
        self.w2 = nn.Linear(inter, hidden, bias=False)  # down
        self.w3 = nn.Linear(hidden, inter, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        inter = cfg.moe_intermediate_size or cfg.intermediate_size
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, inter) for _ in range(cfg.num_experts))
        self.renormalize = cfg.moe_renormalize
        self.choice_bias: torch.Tensor | None = None  # [num_experts] float32, -inf where disabled
        self.active_top_k = self.top_k
        self.load = torch.zeros(cfg.num_experts, dtype=torch.int64)  # tokens routed per expert since reset

    def set_routing(self, routing: LayerRouting | None, top_k: int) -> None:
        """Install a policy; call only between two forward passes (the engine does)."""
        self.active_top_k = top_k or self.top_k
        if routing is None or (not routing.bias and not routing.disabled):
            self.choice_bias = None
            return
        bias = torch.tensor(routing.bias or [0.0] * self.num_experts, dtype=torch.float32)
        for e in routing.disabled:
            bias[e] = float("-inf")
        self.choice_bias = bias.to(self.gate.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [num_tokens, hidden]
        logits = self.gate(x)  # [num_tokens, num_experts]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        k = self.active_top_k
        if self.choice_bias is None:
            weights, chosen = torch.topk(probs, k, dim=-1)
        else:
            chosen = torch.topk(logits.float() + self.choice_bias, k, dim=-1).indices
            weights = probs.gather(-1, chosen)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)  # [num_tokens, k]
        self.load += torch.bincount(chosen.flatten().cpu(), minlength=self.num_experts)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            token_idx, slot = torch.where(chosen == e)
            out.index_add_(0, token_idx, self.experts[e](x[token_idx]) * weights[token_idx, slot, None])
        return out
