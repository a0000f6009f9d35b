"""Plain-torch references compiled by inductor when they run on the CPU.

On the CPU the worker runs the kernels' torch references (DESIGN.md, Conventions: Kernels). Eager
torch materialises every intermediate: a decode step's attention copied each row's pages out of
the cache before reading them, and FP8 dequantization took several passes over the payload.
`torch.compile` turns the same reference into one C++ loop nest that reads the pages where they
lie, so the compiled function *is* the reference, only fused (same math; float sums may associate
differently, within 1e-6).

Compiled with dynamic shapes: a new batch size or context length reuses the compiled code (sizes
0 and 1 are specialised by torch, so a few variants exist; `ModelRunner` compiles them at start).
`COTSERVE_TORCH_COMPILE=0` runs everything eager; so does a machine where compiling fails (no C++
compiler), after one warning.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Generic, ParamSpec, TypeVar

import torch

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def compile_enabled() -> bool:
    """False when COTSERVE_TORCH_COMPILE=0 (the eager references everywhere)."""
    return os.environ.get("COTSERVE_TORCH_COMPILE", "1") != "0"


class CompiledOnCpu(Generic[P, R]):
    """`fn` compiled on first use with CPU tensors, eager on other devices; eager for good after a
    compile failure. The device is that of the first argument."""

    def __init__(self, fn: Callable[P, R]) -> None:
        self.fn = fn
        self._compiled: Callable[P, R] | None = None
        self._failed = False

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._failed or args[0].device.type != "cpu" or not compile_enabled():
            return self.fn(*args, **kwargs)
        if self._compiled is None:
            import torch._inductor.config as inductor_config
            import torch.fx.experimental._config as fx_config

            # compile in this process, without inductor's pool of compile worker processes: a serving
            # process should not grow helpers for a few small kernels
            inductor_config.compile_threads = 1
            # no "duck sizing": two sizes that happen to be equal on the first call (2 rows, 2 pages)
            # must not become a guard that recompiles on the first call where they differ
            fx_config.use_duck_shape = False
            self._compiled = torch.compile(self.fn, dynamic=True)
        try:
            return self._compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager reference is always right
            self._failed = True
            log.warning("torch.compile unavailable for %s, running eager: %s", self.fn.__name__, exc)
            return self.fn(*args, **kwargs)
