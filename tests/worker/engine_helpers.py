"""Helpers for engine-level tests: drive an Engine synchronously, make tiny checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from cotserve.demo.tokenizer import build_tokenizer
from cotserve.worker.engine import Engine
from cotserve.worker.outputs import RequestOutput
from cotserve.worker.sequence import SamplingParams


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str | None = None
    last: RequestOutput | None = None
    error: str | None = None


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
               max_steps: int = 10_000) -> list[Collected]:
    """Submit every prompt, then step the engine on this thread until all finish."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    results = [Collected() for _ in prompts]

    def sink_for(r: Collected):
        def sink(out: RequestOutput) -> None:
            if out.error:
                r.error = out.error
                return
            r.token_ids.append(out.token_id)
            r.text += out.text
            r.logprobs.append(out.logprob)
            r.finish_reason = out.finish_reason
            r.last = out
        return sink

    for i, (ids, p) in enumerate(zip(prompts, params_list)):
        engine.submit(f"req-{i}", ids, p, sink_for(results[i]))
    engine.drain_inbox(block=False)
    steps = 0
    while engine.scheduler.has_work():
        engine.step()
        engine.drain_inbox(block=False)
        steps += 1
        assert steps < max_steps, "engine did not finish"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a finished request leaked KV blocks"
    return results


def save_tiny_checkpoint(config, folder: Path, seed: int = 0, max_shard_size: str | None = None):
    """A randomly initialised transformers model saved as a normal checkpoint folder (+ tokenizer)."""
    import transformers

    torch.manual_seed(seed)
    config.architectures = [config.__class__.__name__.replace("Config", "ForCausalLM")]
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 0, 1, 2
    model = getattr(transformers, config.architectures[0])._from_config(config, attn_implementation="eager")
    with torch.no_grad():  # untrained logits are near uniform; widen them so token choices are decisive
        for name, p in model.named_parameters():
            # random biases too (Qwen2's, gpt-oss's experts'), stacked experts and attention sinks
            if p.dim() >= 2 or name.endswith((".bias", "_bias", ".sinks")):
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():  # DeepSeek's learned choice bias is a buffer
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    build_tokenizer().save(str(folder / "tokenizer.json"))
    return model
