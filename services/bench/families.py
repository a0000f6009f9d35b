"""`cotserve bench families`: every architecture the worker loads, at one shape, engine alone against transformers.

For each family a checkpoint of random weights is made with transformers' own config class at the shape asked for
(the bundled demo model's tokenizer, so its vocabulary: the LM head is small beside a real model's), then the same
greedy workload runs through cotserve's engine alone at each batch size and through transformers' `generate` in
static batches of the largest, in this process, one family after another. Needs the dev extra (transformers)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(slots=True, frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    experts: int = 8  # MoE families: experts per layer, 2 chosen, each a quarter of `intermediate`


def family_configs(shape: Shape) -> dict[str, Any]:
    """Each registered family's transformers config at `shape`."""
    import transformers

    head_dim = shape.hidden // shape.heads
    common = dict(vocab_size=1464, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    moe = dict(num_experts_per_tok=2)
    return {
        "Llama": transformers.LlamaConfig(**common),
        "Qwen2": transformers.Qwen2Config(**common),
        "Qwen3": transformers.Qwen3Config(**common, head_dim=head_dim),
        "Phi3 (partial rotary 0.75)": transformers.Phi3Config(**common, partial_rotary_factor=0.75),
        "Mixtral": transformers.MixtralConfig(**{**common, "intermediate_size": shape.intermediate // 4},
                                              num_local_experts=shape.experts, sliding_window=None, **moe),
        "Qwen3-MoE": transformers.Qwen3MoeConfig(**common, head_dim=head_dim, num_experts=shape.experts,
                                                 moe_intermediate_size=shape.intermediate // 4, norm_topk_prob=True, **moe),
        # latent attention (a latent of 4 heads' size, RoPE over half a head), one dense layer, then MoE with a shared
        # expert and DeepSeek's grouped sigmoid router (4 groups, 2 kept)
        "DeepSeek-V3 (MLA)": transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": shape.heads}, q_lora_rank=None, kv_lora_rank=4 * head_dim,
            qk_nope_head_dim=head_dim, qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim, head_dim=head_dim // 2,
            n_routed_experts=shape.experts, moe_intermediate_size=shape.intermediate // 4, n_group=4, topk_group=2,
            n_shared_experts=1, first_k_dense_replace=1, **moe),
        # its own sliding window (128) and YaRN defaults; attention sinks in every layer
        "gpt-oss": transformers.GptOssConfig(**{**common, "intermediate_size": shape.intermediate // 4},
                                             head_dim=head_dim, num_local_experts=shape.experts, **moe),
    }


def make_checkpoint(config: Any, folder: Path) -> int:
    """A checkpoint of random weights for `config` in `folder`, with the demo model's tokenizer; its parameters."""
    import torch
    import transformers

    from cotserve.worker.config import DEMO_MODEL

    torch.manual_seed(0)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    model = getattr(transformers, config.architectures[0])._from_config(config)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (DEMO_MODEL / name).exists():
            shutil.copy(DEMO_MODEL / name, folder / name)
    return sum(p.numel() for p in model.parameters())


@dataclass(slots=True)
class FamilyRow:
    family: str
    parameters: int
    engine: dict[int, float]  # batch -> output tok/s
    transformers: float  # static batch of the largest batch, output tok/s


def measure(shape: Shape, batches: list[int], prompt_tokens: int, max_new_tokens: int,
            say: Callable[[str], None], only: list[str] | None = None) -> list[FamilyRow]:
    """Each family's row (`only`: those named, else every one)."""
    from cotserve.bench.baseline import run_engine_only, run_transformers

    rows = []
    prompt = [3 + (7 * i) % 1400 for i in range(prompt_tokens)]
    for family, config in family_configs(shape).items():
        if only is not None and family not in only:
            continue
        with tempfile.TemporaryDirectory(prefix="cotserve-family-") as folder:
            params = make_checkpoint(config, Path(folder))
            engine = {}
            for batch in batches:
                say(f"{family}: engine alone, batch {batch} ...")
                engine[batch] = run_engine_only(Path(folder), prompt, max_new_tokens, max(batch, 8), batch).output_tokens_per_s
            say(f"{family}: transformers, static batch of {batches[-1]} ...")
            hf = run_transformers(Path(folder), prompt, max_new_tokens, batches[-1], batches[-1]).output_tokens_per_s
            rows.append(FamilyRow(family, params, engine, hf))
    return rows


def table(rows: list[FamilyRow], batches: list[int], shape: Shape, prompt_tokens: int, max_new_tokens: int):
    from rich.table import Table

    t = Table(title=f"every family at hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads "
                    f"({shape.kv_heads} KV), intermediate {shape.intermediate}; {prompt_tokens}+{max_new_tokens} tokens, "
                    "greedy, output tok/s")
    t.add_column("family")
    t.add_column("parameters", justify="right")
    for b in batches:
        t.add_column(f"engine, batch {b}", justify="right")
    t.add_column(f"transformers, static batch {batches[-1]}", justify="right")
    t.add_column(f"engine / transformers at {batches[-1]}", justify="right")
    for r in rows:
        t.add_row(r.family, f"{r.parameters / 1e6:.0f}M", *(f"{r.engine[b]:,.0f}" for b in batches),
                  f"{r.transformers:,.0f}", f"{r.engine[batches[-1]] / r.transformers:.2f}x")
    return t
