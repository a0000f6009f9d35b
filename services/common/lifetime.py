"""A child process that ends with its parent: the one helper every supervised process calls (services started
by `up` or a benchmark, the exec shim in front of foreign binaries, a worker's engine process). It imports
nothing heavy, so that a shim can call it before it execs."""

from __future__ import annotations

import ctypes
import os
import signal

ADDRESS_FILE_ENV = "COTSERVE_ADDRESS_FILE"
"""When set (by `cotserve up`), the file a service writes its bound gRPC address to once it listens: services
started with port 0 bind a free port themselves and report it, so no port is picked free and then raced for."""


def follow_parent(parent: int) -> None:
    """Ask the kernel to SIGTERM this process when its parent dies, even by SIGKILL (Linux; the request
    survives exec), and end now if `parent` is already gone (it died before we could ask)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent:
        os._exit(1)
