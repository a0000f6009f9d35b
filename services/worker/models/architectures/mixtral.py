"""Mixtral: Llama/Mistral attention with a mixture-of-experts feed-forward block (`models/moe.py`), chosen by the
config's expert count."""

from __future__ import annotations

from typing import Any

from cotserve.worker.models.architectures.llama import biases, build
from cotserve.worker.models.registry import Architecture, register


def config(raw: dict[str, Any]) -> dict[str, Any]:
    return {**biases(False, False, False)(raw), "num_experts": int(raw.get("num_local_experts") or 0),
            "num_experts_per_tok": int(raw.get("num_experts_per_tok") or 0)}


register(Architecture("MixtralForCausalLM", config, build))
