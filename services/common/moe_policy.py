"""Expert-routing policy as the engine applies it (no torch): shared by the worker and the router."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class LayerRouting:
    """One layer's policy: additive bias per expert (choice only) and experts never chosen."""

    bias: tuple[float, ...] = ()
    disabled: frozenset[int] = frozenset()


@dataclass(slots=True, frozen=True)
class RoutingPolicy:
    """A whole model's routing policy; `version` 0 is the empty policy."""

    version: int = 0
    layers: dict[int, LayerRouting] = field(default_factory=dict)
    top_k: int = 0  # 0: the checkpoint's
