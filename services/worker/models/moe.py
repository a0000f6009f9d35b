"""The mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3), with a live routing policy.

Routing: softmax over the gate's logits, the top-k experts per token, their weights renormalized over the chosen ones
(Mixtral; Qwen3-MoE when its config says `norm_topk_prob`, else the softmax's own); or, for gpt-oss, the top-k of the
(biased) router's logits and a softmax over those k; or, for DeepSeek-V3, sigmoid scores plus the checkpoint's
per-expert choice bias, experts chosen within the best groups, weights the chosen scores (renormalized) times a
scaling factor, and a shared expert every token goes through. A policy may add a per-expert bias used only to choose
the experts (the weights still come from the unbiased scores, as in DeepSeek-V3's auxiliary-loss-free balancing; for
DeepSeek-V3 it adds to the checkpoint's own) and may disable experts, which are then never chosen. With no policy the
block computes exactly what the family's own router does. The block counts tokens routed to each expert.
"""

from __future__ import annotations

import torch
from torch import nn

from cotserve.common.moe_policy import LayerRouting, RoutingPolicy

__all__ = ["ClampedExperts", "Expert", "LayerRouting", "RoutingPolicy", "SparseMoeBlock"]
from cotserve.worker.models.config import ModelConfig


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)  # gate
        self.w2 = nn.Linear(inter, hidden, bias=False)  # down
        self.w3 = nn.Linear(hidden, inter, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class ClampedExperts(nn.Module):
    """gpt-oss's experts, stacked as its checkpoints store them: `gate_up_proj` [experts, hidden, 2 * inter] with gate
    and up interleaved column by column, `down_proj` [experts, inter, hidden], each with a bias; the gate clamped
    above and up both ways to `limit`, then `(up + 1) * gate * sigmoid(alpha * gate)`."""

    def __init__(self, num_experts: int, hidden: int, inter: int, limit: float, alpha: float) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden))
        self.limit, self.alpha = limit, alpha

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return ((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ self.down_proj[e] + self.down_proj_bias[e]


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.moe_router_bias)
        inter = cfg.moe_intermediate_size or cfg.intermediate_size
        if cfg.swiglu_limit is None:
            self.experts = nn.ModuleList(Expert(cfg.hidden_size, inter) for _ in range(cfg.num_experts))
        else:
            self.experts = ClampedExperts(cfg.num_experts, cfg.hidden_size, inter, cfg.swiglu_limit, cfg.swiglu_alpha)
        self.renormalize = cfg.moe_renormalize
        self.softmax_after_topk = cfg.moe_softmax_after_topk
        self.sigmoid_groups, self.scaling = cfg.moe_sigmoid_groups, cfg.moe_scaling
        if self.sigmoid_groups is not None:  # DeepSeek's learned choice bias, by the checkpoint's name for it
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        if cfg.moe_shared_intermediate:
            self.shared_experts = Expert(cfg.hidden_size, cfg.moe_shared_intermediate)
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

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [num_tokens, k] float32, chosen experts [num_tokens, k]) for the gate's logits, under the policy."""
        k = self.active_top_k
        if self.sigmoid_groups is not None:
            return self._route_sigmoid(logits, k)
        if self.softmax_after_topk:
            if self.choice_bias is None:
                top, chosen = torch.topk(logits, k, dim=-1)
            else:
                chosen = torch.topk(logits.float() + self.choice_bias, k, dim=-1).indices
                top = logits.gather(-1, chosen)
            return torch.softmax(top, dim=-1).float(), chosen
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        if self.choice_bias is None:
            weights, chosen = torch.topk(probs, k, dim=-1)
        else:
            chosen = torch.topk(logits.float() + self.choice_bias, k, dim=-1).indices
            weights = probs.gather(-1, chosen)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def _route_sigmoid(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's routing: groups ranked by their two best biased scores, experts chosen in the best ones."""
        scores = logits.float().sigmoid()
        choice = scores + self.gate.e_score_correction_bias.float()
        if self.choice_bias is not None:
            choice = choice + self.choice_bias
        groups, keep = self.sigmoid_groups
        if groups > 1:  # (a policy's disabled expert counts as very low in its group's score, so a group of enabled
            # experts always outranks one without)
            per_group = choice.clamp(min=-1e9).view(-1, groups, self.num_experts // groups)
            best = per_group.topk(2, dim=-1).values.sum(dim=-1).topk(keep, dim=-1).indices  # [tokens, keep]
            allowed = torch.zeros_like(per_group[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~allowed.repeat_interleave(self.num_experts // groups, dim=1), float("-inf"))
        chosen = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [num_tokens, hidden]
        weights, chosen = self.route(self.gate(x))
        weights = weights.to(x.dtype)  # [num_tokens, k]
        self.load += torch.bincount(chosen.flatten().cpu(), minlength=self.num_experts)
        out = torch.zeros_like(x)
        stacked = isinstance(self.experts, ClampedExperts)
        for e in chosen.unique().tolist():
            token_idx, slot = torch.where(chosen == e)
            y = self.experts.expert(e, x[token_idx]) if stacked else self.experts[e](x[token_idx])
            out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out
