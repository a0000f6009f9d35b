"""The Llama family: Llama, Mistral and Qwen2 are one model (`models/llama.py`) that differs in which projections
carry biases (and Mistral's sliding window, read generically from config.json)."""

from __future__ import annotations

from typing import Any

from cotserve.worker.models.registry import Architecture, register


def build(cfg):
    from cotserve.worker.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(cfg)


def biases(qkv: bool | str, o: bool | str, mlp: bool | str):
    """A family's bias fields: fixed, or read from the named config.json flag."""
    def config(raw: dict[str, Any]) -> dict[str, Any]:
        def flag(spec: bool | str) -> bool:
            return bool(raw.get(spec, False)) if isinstance(spec, str) else spec

        return {"qkv_bias": flag(qkv), "o_bias": flag(o), "mlp_bias": flag(mlp)}

    return config


register(Architecture("LlamaForCausalLM", biases("attention_bias", "attention_bias", "mlp_bias"), build))
register(Architecture("MistralForCausalLM", biases(False, False, False), build))
register(Architecture("Qwen2ForCausalLM", biases(True, False, False), build))
