"""The architecture registry: which model code serves a checkpoint's `architectures` name, how its `config.json`
fills the family's fields of `ModelConfig`, and how its checkpoint names its weights. The loader, the engine and the
kernels never branch on an architecture's name; a family is a module under `architectures/` that calls `register`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from cotserve.common.errors import ModelLoadError

FAMILY_MODULES = ("llama", "mixtral", "qwen3", "phi3", "gpt_oss", "deepseek_v3")
"""The modules of `cotserve.worker.models.architectures` imported (and so registered) on the first lookup."""


def keep_name(name: str) -> str | None:
    """A checkpoint that names its weights as the model code does."""
    return name


@dataclass(frozen=True, slots=True)
class Architecture:
    """One architecture name and what serves it."""

    name: str  # as `config.json`'s `architectures` says it, e.g. "Qwen2ForCausalLM"
    config: Callable[[dict[str, Any]], dict[str, Any]]  # the family's ModelConfig fields from the raw config.json
    build: Callable[[Any], Any]  # ModelConfig -> the model (an nn.Module with the causal-LM interface of llama.py)
    weight_name: Callable[[str], str | None] = keep_name  # checkpoint weight name -> the model's (None: not used)
    split: Callable[[str, Any, Any], list[tuple[str, Any]]] | None = None  # (the model's name, tensor, ModelConfig) ->
    # the model's tensors it holds (a checkpoint that stores several as one, as Phi3's fused qkv_proj); None: as is


_REGISTRY: dict[str, Architecture] = {}
_loaded = False


def register(arch: Architecture) -> Architecture:
    """Add `arch` (a name registered twice is a programming error)."""
    if arch.name in _REGISTRY:
        raise ValueError(f"architecture {arch.name} is registered twice")
    _REGISTRY[arch.name] = arch
    return arch


def _load_families() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in FAMILY_MODULES:
            importlib.import_module(f"cotserve.worker.models.architectures.{module}")


def supported() -> tuple[str, ...]:
    """Every registered architecture name, sorted."""
    _load_families()
    return tuple(sorted(_REGISTRY))


def architecture(name: str | None, source: str = "config.json") -> Architecture:
    """The registered architecture `name`; ModelLoadError naming the supported ones otherwise."""
    _load_families()
    arch = _REGISTRY.get(name) if name is not None else None
    if arch is None:
        raise ModelLoadError(f"{source}: architecture {name!r} is not supported (supported: {', '.join(supported())})")
    return arch
