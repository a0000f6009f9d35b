"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one model.

Parameter names match Hugging Face's, so a checkpoint's state dict loads as is. Tokens are flat:
a continuous batch of ragged sequences is `[num_tokens]` with per-token positions, and attention
goes through an `AttentionBackend` that knows where each sequence's keys live.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cotserve.kernels.layer_ops import REFERENCE_OPS, LayerOps, rotate_half_rope, store_transposed
from cotserve.worker.models.attention import AttentionBackend
from cotserve.worker.models.config import ModelConfig, RopeConfig
from cotserve.worker.models.mla import LatentAttention
from cotserve.worker.models.moe import RoutingPolicy, SparseMoeBlock


class RMSNorm(nn.Module):
    """`forward(x, residual) -> (normalized, residual stream)`: with a residual, `x + residual` is the new stream and
    what is normalized (the add and the norm one operation, as vLLM's fused_add_rms_norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: LayerOps = REFERENCE_OPS  # set by LlamaForCausalLM.use_layer_ops when served

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]`, computed exactly as Hugging Face does (float32); `long`: LongRoPE's for
    sequences past its original length."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "longrope":  # the short factors, or the long ones past the original length
        factors = rope.long_factor if long else rope.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "yarn":
        return yarn_inv_freq(rope, head_dim)
    if rope.rope_type != "llama3":
        return inv
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """YaRN's frequencies: the original ones for dimensions that turn more than `beta_fast` times over the
    original context, divided by the factor for those that turn fewer than `beta_slow` times, a linear ramp between."""
    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original length
        return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    kept = 1 - ramp  # each dimension's share of its original frequency (written as transformers does, to the bit)
    wavelengths = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return 1.0 / (rope.factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE, applied per token from its absolute position.

    With `max_positions`, cos and sin come from a table of every position below it, made once per dtype on first
    use (as vLLM's cos_sin_cache): a step then gathers its tokens' rows instead of computing a cos and a sin of
    every position again (on the demo model at batch 32, 6% of the engine's step went to MKL's threaded cos and
    sin). The table holds what the computation gives, element for element (tested to the bit); without
    `max_positions` (training, which runs on any position) each call computes them.

    LongRoPE with long factors: a sequence longer than the original length takes them at every position; its tokens
    ask for position p + `long_offset` (the table's second half: `ModelRunner` adds it)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int | None = None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)
        self.scale = rope.attention_factor  # LongRoPE's: cos and sin scaled (1.0 otherwise)
        self.max_positions = max_positions
        self.long_offset = max_positions if rope.long_factor and max_positions else None
        if self.long_offset is not None:
            self.register_buffer("long_inv_freq", rope_inv_freq(rope, head_dim, long=True), persistent=False)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [num_tokens, head_dim] for each token's position."""
        if self.max_positions is None:
            return self._computed(positions, dtype)
        table = self._tables.get(dtype)
        if table is None or table[0].device != positions.device:
            every = torch.arange(self.max_positions, device=positions.device)
            table = self._computed(every, dtype)
            if self.long_offset is not None:  # [short; long]: a long sequence's position p is row p + long_offset
                long = self._computed(every, dtype, self.long_inv_freq)
                table = (torch.cat((table[0], long[0])), torch.cat((table[1], long[1])))
            self._tables[dtype] = table
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _computed(self, positions: torch.Tensor, dtype: torch.dtype,
                  inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        freqs = positions[:, None].float() * inv_freq[None, :].float()  # [num_tokens, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.scale != 1.0:
            return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def fuse_linears(*linears: nn.Linear, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for `linears` that read the same input: their rows concatenated, and each linear's own
    parameters re-pointed at its slice, so the checkpoint's names still hold the weights and nothing is stored
    twice. One matrix multiply then does the work of several (a step's cost on small models is per operation).
    `transposed`: the weight stored transposed (`layer_ops.store_transposed`)."""
    if transposed:  # concatenated straight into the [in, out] layout: one copy, not a concatenation and then another
        weight = torch.cat([lin.weight.detach().t() for lin in linears], dim=1).t()
    else:
        weight = torch.cat([lin.weight for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


def transpose_weight(linear: nn.Module) -> None:
    """`linear`'s weight stored transposed (`layer_ops.store_transposed`): the same parameter values."""
    linear.weight = nn.Parameter(store_transposed(linear.weight), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, q_out, kv_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q_out, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, kv_out, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, kv_out, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_out, h, bias=cfg.o_bias)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by `fuse` once the weights are loaded
        self.ops: LayerOps = REFERENCE_OPS
        self.rotary_dim = cfg.rotary_dim  # below head_dim: only each head's first dimensions rotate (Phi-4-mini)
        if cfg.qk_norm:  # Qwen3: each query and key head normalized before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.window = cfg.window(layer)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attention_sinks else None  # gpt-oss

    def fuse(self, transposed: bool = False) -> None:
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj, transposed=transposed)
        if transposed:
            transpose_weight(self.o_proj)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        n = x.shape[0]
        if hasattr(self, "q_norm") or self.rotary_dim < self.head_dim:
            q, k, v = self._qkv_in_torch(x, cos, sin)
        elif self.qkv is not None:
            q, k, v = self.ops.rope_split(self.ops.linear(x, *self.qkv), cos, sin, self.num_heads,
                                          self.num_kv_heads, self.head_dim)
        else:
            cs, sn = cos[:, None, :], sin[:, None, :]
            q = rotate_half_rope(self.q_proj(x).reshape(n, self.num_heads, self.head_dim), cs, sn)
            k = rotate_half_rope(self.k_proj(x).reshape(n, self.num_kv_heads, self.head_dim), cs, sn)
            v = self.v_proj(x).reshape(n, self.num_kv_heads, self.head_dim)
        if self.window is None and self.sinks is None:
            out = attn.attend(self.layer, q, k, v)  # [num_tokens, num_heads, head_dim]
        else:
            out = attn.attend(self.layer, q, k, v, window=self.window, sinks=self.sinks)
        return self.ops.linear(out.reshape(n, -1), self.o_proj.weight, self.o_proj.bias)

    def _qkv_in_torch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k (each head RMS-normalized where the model has per-head norms, then rotated, over its first
        `rotary_dim` dimensions) and v."""
        n, d = x.shape[0], self.head_dim
        if self.qkv is not None:
            q, k, v = self.ops.linear(x, *self.qkv).split([self.num_heads * d, self.num_kv_heads * d,
                                                            self.num_kv_heads * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        cs, sn, r = cos[:, None, :], sin[:, None, :], self.rotary_dim

        def heads(x: torch.Tensor, count: int, norm: str) -> torch.Tensor:
            if hasattr(self, norm):
                x = getattr(self, norm)(x.reshape(-1, d))[0]
            x = x.reshape(n, count, d)
            if r == d:
                return rotate_half_rope(x, cs, sn)
            return torch.cat([rotate_half_rope(x[..., :r], cs, sn), x[..., r:]], dim=-1)

        return heads(q, self.num_heads, "q_norm"), heads(k, self.num_kv_heads, "k_norm"), v.reshape(n, self.num_kv_heads, d)


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by `fuse`
        self.ops: LayerOps = REFERENCE_OPS

    def fuse(self, transposed: bool = False) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj, transposed=transposed)
        if transposed:
            transpose_weight(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        down = self.down_proj
        return self.ops.linear(self.ops.silu_mul(self.ops.linear(x, *self.gate_up)), down.weight, down.bias)


class DecoderLayer(nn.Module):
    """Attention plus a feed-forward block: a dense SwiGLU `mlp`, or Mixtral's `block_sparse_moe`
    (the attribute names are the checkpoints')."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LatentAttention(cfg, layer) if cfg.mla is not None else Attention(cfg, layer)
        if cfg.is_moe_layer(layer):
            self.block_sparse_moe = SparseMoeBlock(cfg)
        else:
            self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's output, the residual stream before it): the next norm adds the two (the first layer's
        `x` is the stream itself, `residual` None)."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, attn), residual)
        return self.ffn(h), residual


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim)


class LlamaForCausalLM(nn.Module):
    """Causal LM over flat tokens: `forward(ids, positions, attn) -> hidden [num_tokens, hidden]`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.layer_ops: LayerOps = REFERENCE_OPS  # `use_layer_ops`
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        attn: AttentionBackend,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary.cos_sin(positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, attn)
        return self.model.norm(x, residual)[0]

    def fuse_projections(self) -> None:
        """Fuse each layer's q/k/v and gate/up projections into one matrix multiply each. Call it once the weights
        are loaded on their device and in their dtype: the fused weights are plain tensors, which `.to()` would
        not move (the loader does this last)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            if hasattr(layer, "mlp"):
                layer.mlp.fuse()

    def use_layer_ops(self, ops: LayerOps) -> None:
        """Run the small operations between the multiplies (norms, RoPE, SwiGLU) and the dense layers' multiplies
        with `ops` (the loader sets the device's, `dispatch.layer_ops_for`; the default is the torch references, which
        training needs). Ops that want their weights stored transposed get them so: the fused projections (call this
        after `fuse_projections`), the output projections and the LM head (the embedding too, when tied)."""
        self.layer_ops = ops
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.ops = ops
        if not ops.transposed_weights:
            return
        for layer in self.model.layers:  # the fused weights, stored again transposed (where fused: see fuse_projections)
            if layer.self_attn.qkv is not None:
                layer.self_attn.fuse(transposed=True)
            if hasattr(layer, "mlp") and layer.mlp.gate_up is not None:
                layer.mlp.fuse(transposed=True)
        transpose_weight(self.lm_head)
        if self.config.tie_word_embeddings:
            self.model.embed_tokens.weight = self.lm_head.weight

    def native_decode_layers(self, caches: list, scale: float):
        """Every decoder layer and the final norm over `caches` (`kv_spec.LayerCache`, one a layer) as one C call
        (`cpu_native.DecodeLayers`: for a step of decode rows bit for bit this forward's result), or None where it does
        not apply: layer operations other than the C ones, a mixture of experts, projections not fused, a shape or
        dtype the C operations do not take."""
        if self.layer_ops.name != "cpu-native" or self.moe_blocks():
            return None
        from cotserve.kernels import cpu_native

        layers = []
        for layer, cache in zip(self.model.layers, caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(attn, Attention) or attn.qkv is None or mlp.gate_up is None or hasattr(attn, "q_norm") or attn.rotary_dim < attn.head_dim:
                # (per-head norms, partial rotation: not in C)
                return None
            layers.append(cpu_native.DecodeLayer(
                layer.input_layernorm.weight, *attn.qkv, attn.o_proj.weight, attn.o_proj.bias,
                layer.post_attention_layernorm.weight, *mlp.gate_up, mlp.down_proj.weight, mlp.down_proj.bias, cache))
        cfg = self.config
        return cpu_native.DecodeLayers.build(layers, self.model.norm.weight, cfg.rms_norm_eps, cfg.num_heads,
                                             cfg.num_kv_heads, cfg.head_dim, scale)

    def forward_natively(self, layers, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                         fresh: torch.Tensor | None, tables: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """`forward` with its layers run by `layers` (`native_decode_layers`), each token attending over its own page
        table `tables` [num_tokens, width] up to its context length `ctx` (a decode row's, or a prompt chunk token's:
        its own position + 1); `slots` and `fresh` as `PagedBatch`'s: [num_tokens, hidden_size]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary.cos_sin(positions, x.dtype)
        return layers(x, cos, sin, slots, fresh, tables, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        return self.layer_ops.linear(hidden, self.lm_head.weight)

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.block_sparse_moe for layer in self.model.layers if hasattr(layer, "block_sparse_moe")]

    def set_routing_policy(self, policy: RoutingPolicy) -> None:
        """Switch every MoE layer to `policy` together; call only between two forward passes."""
        for i, layer in enumerate(self.model.layers):
            if hasattr(layer, "block_sparse_moe"):
                layer.block_sparse_moe.set_routing(policy.layers.get(i), policy.top_k)

    def take_expert_load(self) -> dict[int, list[int]]:
        """Tokens routed per expert in each MoE layer since the last call (and reset)."""
        out = {}
        for i, layer in enumerate(self.model.layers):
            if hasattr(layer, "block_sparse_moe"):
                block = layer.block_sparse_moe
                out[i] = block.load.tolist()
                block.load.zero_()
        return out
