"""The garbage collector and a service's start-up heap.

A service that has imported torch, grpc and OpenTelemetry holds about 250,000 container objects before it serves
anything; CPython's full (oldest-generation) collection walks all of them, about 100 ms on this project's 2-core
machines, and runs every so often while requests allocate. Each one stalls every stream the process carries:
it was the 100 ms outliers of TTFT and inter-token latency, alone and under load (`cotserve bench isolation`).
`freeze_startup_heap` moves everything alive at the end of start-up into the permanent generation (`gc.freeze`),
which collections skip: a full collection then walks only what was allocated since, a fraction of a
millisecond. Objects made later are collected as before; what start-up leaves behind is kept for the life of
the process, as it would be anyway. vLLM freezes its engine's heap after start-up for the same reason.
`COTSERVE_GC_FREEZE=0` turns it off (to measure the difference).
"""

from __future__ import annotations

import gc
import logging
import os
import time

log = logging.getLogger("cotserve")


def freeze_startup_heap(what: str) -> None:
    """Collect once, then freeze what is left (see the module docstring); `what` names the process in the log."""
    if os.environ.get("COTSERVE_GC_FREEZE", "1") == "0":
        return
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("%s: start-up heap frozen (%d objects, %.0f ms); collections skip it", what, gc.get_freeze_count(),
             (time.perf_counter() - start) * 1000)
