"""Plain-torch references compiled by inductor when they run on the CPU.

On the CPU the worker runs the kernels' torch references (DESIGN.md, Conventions: Kernels). Eager
torch materialises every intermediate: a decode step's attention copied each row's pages out of
the cache before reading them, and FP8 dequantization took several passes over the payload.
`torch.compile` turns the same reference into one C++ loop nest that reads the pages where they
lie, so the compiled function *is* the reference, only fused (same math; float sums may associate
differently, within 1e-6).

Compiled with dynamic shapes: a new batch size or context length reuses the compiled code (sizes
0 and 1 are specialised by torch, so callers pad them away or compile a variant each). The worker
compiles at start on a helper thread (`warm_up`) and serves with the eager reference meanwhile: a
restarted worker answers at once rather than after the compiler (about 4 s with inductor's on-disk
cache warm, 10-15 s cold on 2 cores).
`COTSERVE_TORCH_COMPILE=0` runs everything eager; so does a machine where compiling fails (no C++
compiler), after one warning.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Generic, Iterator, ParamSpec, TypeVar

import torch

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def compile_enabled() -> bool:
    """False when COTSERVE_TORCH_COMPILE=0 (the eager references everywhere)."""
    return os.environ.get("COTSERVE_TORCH_COMPILE", "1") != "0"


class CompiledOnCpu(Generic[P, R]):
    """`fn` compiled on first use with CPU tensors, eager on other devices; eager for good after a
    compile failure. The device is that of the first argument.

    `warm_up` compiles ahead of use (seconds): a server calls it on a helper thread at start, and every
    call meanwhile runs the eager reference instead of waiting for the compiler."""

    def __init__(self, fn: Callable[P, R]) -> None:
        self.fn = fn
        self._compiled: Callable[P, R] | None = None
        self._failed = False
        self._warming = False
        self._warm_lock = threading.Lock()  # one warm-up at a time (another waits its turn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._failed or self._warming or args[0].device.type != "cpu" or not compile_enabled():
            return self.fn(*args, **kwargs)
        if self._compiled is None:
            self._compiled = self._compile()
        return self._run(self._compiled, *args, **kwargs)

    def warm_up(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Compile by running once on `args` (CPU tensors of the shapes and dtypes to come: a new dtype compiles a
        variant of its own); calls from other threads run eager until it is done. Nothing to do when off."""
        if not compile_enabled() or args[0].device.type != "cpu":
            return
        with self._warm_lock, _gil_handoff():
            if self._failed:
                return
            self._warming = True
            try:
                compiled = self._compiled or self._compile()
                self._run(compiled, *args, **kwargs)
                self._compiled = compiled
            finally:
                self._warming = False

    def _compile(self) -> Callable[P, R]:
        import torch._inductor.config as inductor_config
        import torch.fx.experimental._config as fx_config

        # compile in this process, without inductor's pool of compile worker processes: a serving
        # process should not grow helpers for a few small kernels
        inductor_config.compile_threads = 1
        # no "duck sizing": two sizes that happen to be equal on the first call (2 rows, 2 pages)
        # must not become a guard that recompiles on the first call where they differ
        fx_config.use_duck_shape = False
        return torch.compile(self.fn, dynamic=True)

    def _run(self, compiled: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager reference is always right
            self._failed = True
            log.warning("torch.compile unavailable for %s, running eager: %s", self.fn.__name__, exc)
            return self.fn(*args, **kwargs)


_handoff_lock = threading.Lock()
_handoff_users = 0
_handoff_saved = 0.005


@contextmanager
def _gil_handoff() -> Iterator[None]:
    """While a compile runs on a helper thread: the compiler is Python-heavy, so hand the GIL back to the serving
    threads every 0.2 ms (not 5 ms), or each torch op of an engine step may wait that long for it. The first of
    overlapping users lowers the interval, the last restores it."""
    global _handoff_users, _handoff_saved
    with _handoff_lock:
        if _handoff_users == 0:
            _handoff_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_handoff_saved, 0.0002))
        _handoff_users += 1
    try:
        yield
    finally:
        with _handoff_lock:
            _handoff_users -= 1
            if _handoff_users == 0:
                sys.setswitchinterval(_handoff_saved)


@contextmanager
def compile_setting(enabled: bool) -> Iterator[None]:
    """COTSERVE_TORCH_COMPILE on or off for the duration (a benchmark compares both in one process)."""
    with env_setting("COTSERVE_TORCH_COMPILE", "1" if enabled else "0"):
        yield


@contextmanager
def env_setting(name: str, value: str) -> Iterator[None]:
    """Environment variable `name` set to `value` for the duration, then as it was (unset if it was)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
