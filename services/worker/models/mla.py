"""Multi-head latent attention (DeepSeek-V2/V3), with the parameter names of DeepSeek's checkpoints.

Each token writes two vectors to the cache: its compressed latent (`kv_lora_rank` values, RMS-normalized) as the
layer's "keys" and its RoPE key, shared by every head, as its "values" (one cache head each). Attention reads them
back and expands the latent into every head's keys and values (`kv_b_proj`) before attending: the cache stores
`kv_lora_rank + qk_rope_head_dim` numbers per token and layer where the expanded keys and values are
`heads * (qk_nope + qk_rope + v_head_dim)` (DeepSeek-V3: 576 against 40,960), so the paged pool, the prefix cache
and forks hold 71x the tokens in the same bytes. No kernel absorbs `kv_b_proj` into the query yet: the expansion
runs per row group in torch (`attention.PagedAttention`), and decode reads every page (top-k page selection scores
keys, which the cache does not hold).
"""

from __future__ import annotations

import torch
from torch import nn

from cotserve.kernels.layer_ops import rotate_half_rope
from cotserve.worker.models.attention import AttentionBackend
from cotserve.worker.models.config import ModelConfig


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over interleaved pairs (x0, x1), (x2, x3)...: each pair rotated by its frequency, the result laid out as
    the rotated first elements then the rotated second ones (the same permutation for queries and keys, so q·k is
    that of the pairs). `cos`, `sin`: [tokens, 1, dim] as `cat(freqs, freqs)`, each frequency's angle once a half."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        from cotserve.worker.models.llama import RMSNorm

        super().__init__()
        m = cfg.mla
        assert m is not None
        self.layer, self.mla, self.num_heads = layer, m, cfg.num_heads
        h, qk = cfg.hidden_size, m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(h, cfg.num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(m.q_lora_rank, cfg.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * m.v_head_dim, h, bias=cfg.o_bias)
        self.qkv = None  # (no fused projection: the model's layer-ops pass looks for one)

    def fuse(self, transposed: bool = False) -> None:
        """Nothing to fuse (the model calls it on every attention block)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        m, n = self.mla, x.shape[0]
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])
        q_nope, q_rot = q.view(n, self.num_heads, -1).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)[0]
        rope = interleaved_rope if m.rope_interleave else rotate_half_rope
        cs, sn = cos[:, None, :], sin[:, None, :]
        q = torch.cat([q_nope, rope(q_rot, cs, sn)], dim=-1)
        out = attn.attend(self.layer, q, latent[:, None, :], rope(k_rot[:, None, :], cs, sn), expand=self.expand,
                          scale=m.scale)  # [n, heads, v_head_dim]
        return self.o_proj(out.reshape(n, -1))

    def expand(self, latents: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's keys and values from cached latents [batch, 1, ctx, kv_lora_rank] and RoPE keys
        [batch, 1, ctx, rope_dim]: ([batch, heads, ctx, nope + rope], [batch, heads, ctx, v_head_dim])."""
        m = self.mla
        batch, ctx = latents.shape[0], latents.shape[2]
        kv = self.kv_b_proj(latents[:, 0]).view(batch, ctx, self.num_heads, -1).transpose(1, 2)
        k_nope, values = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        keys = torch.cat([k_nope, k_rot.expand(batch, self.num_heads, ctx, m.qk_rope_head_dim)], dim=-1)
        return keys, values
