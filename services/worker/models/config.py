"""Model configuration read from a Hugging Face `config.json`.

One dataclass covers every registered family: the fields all families share are read here, the differences
(biases, experts, ...) by the family's entry in the architecture registry (`models/registry.py`), never by separate
model classes for variants of one design.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cotserve.common.errors import ModelLoadError
from cotserve.worker.models.registry import architecture


@dataclass(slots=True, frozen=True)
class RopeConfig:
    """Rotary embedding parameters: base frequency plus optional `llama3` scaling."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()  # longrope: the per-frequency factors for contexts up to the original length
    long_factor: tuple[float, ...] = ()  # longrope: the factors for longer contexts (every position of such a sequence)
    attention_factor: float = 1.0  # longrope, yarn: cos and sin scaled by it
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions rotated (Phi-4-mini: 0.75)
    beta_fast: float = 32.0  # yarn: the correction range's bounds, in rotations
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the correction range rounded outwards to whole dimensions


@dataclass(slots=True, frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): each token's keys and values are one compressed latent (RMS-
    normalized) and one RoPE key shared by every head; the cache holds those two, the heads' keys and values are
    expanded from the latent (`kv_b_proj`) as attention reads them."""

    q_lora_rank: int | None  # the query's own low-rank bottleneck (None: a plain q_proj)
    kv_lora_rank: int  # the latent's size: what the cache stores per token instead of keys and values
    qk_nope_head_dim: int  # each head's key/query dimensions without position
    qk_rope_head_dim: int  # and with RoPE (shared by the heads on the key side)
    v_head_dim: int
    rope_interleave: bool  # RoPE over interleaved pairs (x0, x1), (x2, x3)... as DeepSeek's checkpoints lay them out
    scale: float  # the softmax scale: (nope + rope) ** -0.5, times YaRN's mscale_all_dim squared where given


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Everything the model code needs from `config.json`, validated."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None
    num_experts: int = 0  # 0: a dense SwiGLU MLP; else the number of experts per MoE block
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # an expert's intermediate size (0: intermediate_size)
    moe_renormalize: bool = True  # the chosen experts' weights renormalized to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    moe_layers: tuple[int, ...] | None = None  # the layers with an MoE block (None: every layer, with num_experts)
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)
    attention_sinks: bool = False  # a learned logit per query head joins each softmax and takes a share (gpt-oss)
    layer_windows: tuple[int | None, ...] | None = None  # per layer: its sliding window (None: full attention); the
    # keys stay cached, so the context is not capped by them (unlike `sliding_window`, every layer's window)
    moe_router_bias: bool = False  # the router's linear layer has a bias (gpt-oss)
    moe_softmax_after_topk: bool = False  # the weights are the softmax over the chosen experts' logits (gpt-oss)
    swiglu_limit: float | None = None  # gpt-oss's experts: stacked, biased, gate and up clamped to it (None: SwiGLU)
    swiglu_alpha: float = 1.702  # gpt-oss's experts: the gate is g * sigmoid(alpha * g)
    moe_sigmoid_groups: tuple[int, int] | None = None  # DeepSeek-V3's router: sigmoid scores plus a per-expert choice
    # bias (`e_score_correction_bias`), experts chosen only within the (n_group, topk_group) best groups
    moe_scaling: float = 1.0  # the chosen experts' weights times it (DeepSeek's routed_scaling_factor)
    moe_shared_intermediate: int = 0  # a shared expert every token goes through, of this size (0: none)
    mla: MlaConfig | None = None  # multi-head latent attention in every layer (DeepSeek-V3), else Llama attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def window(self, layer: int) -> int | None:
        """`layer`'s sliding window in tokens (a query sees its own and the window - 1 keys before it); None: all."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def rope_long_after(self) -> int | None:
        """LongRoPE's original length where the model has long factors: a sequence longer than it takes the long
        factors at every position (as transformers' forward over it does); None where the length changes nothing."""
        return self.rope.original_max_position_embeddings if self.rope.long_factor else None

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and (self.moe_layers is None or layer in self.moe_layers)

    @property
    def rotary_dim(self) -> int:
        """Each head's leading dimensions that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def max_context(self) -> int:
        """Longest context served exactly: a sliding window caps it (we never drop keys), and so does LongRoPE's
        original length where it has no long factors."""
        longest = self.max_position_embeddings
        if self.rope.rope_type == "longrope" and not self.rope.long_factor:
            longest = min(longest, self.rope.original_max_position_embeddings)
        if self.sliding_window:
            return min(longest, self.sliding_window)
        return longest

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        family = architecture(archs[0] if archs else None, source)
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            use_sw = raw.get("use_sliding_window", True)
            fields = {"num_experts": 0, "num_experts_per_tok": 0, "head_dim": int(raw.get("head_dim") or hidden // num_heads),
                      "sliding_window": (raw.get("sliding_window") if use_sw else None) or None, **family.config(raw)}
            return cls(
                architecture=family.name,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                rope=_parse_rope(raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                **fields,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: missing or invalid field: {exc}") from exc

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: file not found (a model folder needs config.json)") from None
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
        cfg = cls.from_dict(raw, str(path))
        if cfg.num_experts and not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ModelLoadError(f"{path}: num_experts_per_tok ({cfg.num_experts_per_tok}) must be 1..num_local_experts "
                                 f"({cfg.num_experts})")
        if cfg.num_heads % cfg.num_kv_heads:
            raise ModelLoadError(
                f"{path}: num_attention_heads ({cfg.num_heads}) must be a multiple of "
                f"num_key_value_heads ({cfg.num_kv_heads})"
            )
        return cfg


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "llama3", "longrope", "yarn"):
        raise ModelLoadError(f"config.json: rope type {rope_type!r} is not supported (default, llama3, longrope, yarn)")
    if rope_type == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if rope_type == "longrope":
        return _longrope(raw, params, theta, partial)
    if rope_type == "yarn":
        return _yarn(raw, params, theta, partial)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _longrope(raw: dict[str, Any], params: dict[str, Any], theta: float, partial: float) -> RopeConfig:
    """LongRoPE (Phi-3/Phi-4): the short factors (contexts up to the original length: what is served) and the
    attention factor, as transformers computes them."""
    original = int(params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
                   or raw.get("max_position_embeddings", 2048))
    factor = float(params.get("factor") or int(raw.get("max_position_embeddings", original)) / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(theta=theta, rope_type="longrope", factor=factor, original_max_position_embeddings=original,
                      short_factor=tuple(float(f) for f in params["short_factor"]), attention_factor=float(attention),
                      long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
                      partial_rotary_factor=partial)


def _yarn(raw: dict[str, Any], params: dict[str, Any], theta: float, partial: float) -> RopeConfig:
    """YaRN (gpt-oss, DeepSeek-V3, long-context Qwen3): the factor (default: the context over the original length) and
    the attention factor (default: the paper's 0.1 ln(factor) + 1, or the ratio of the two mscales DeepSeek gives), as
    transformers computes them. One set of frequencies serves every length, so nothing caps the context."""
    original = int(params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
                   or raw.get("max_position_embeddings", 2048))
    factor = float(params.get("factor") or int(raw.get("max_position_embeddings", original)) / original)

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    return RopeConfig(theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                      attention_factor=float(attention), partial_rotary_factor=partial,
                      beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                      truncate=bool(params.get("truncate", True)))


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's attention-temperature factor: 0.1 m ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
