"""Benchmarks measure warmed-up services: `running` as `common.procs.running`, each worker also waited for until its
CPU kernels are compiled, so that no measurement shares its cores with the compiler."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any, Callable

from cotserve.common.procs import FROM_ENV, Child, wait_serving
from cotserve.common.procs import running as _running
from cotserve.common.tls import client_channel
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc


def wait_kernels_ready(address: str, timeout_s: float = 180.0, credentials: Any = None) -> None:
    """Block until the worker at `address` has compiled its CPU kernels (its Stats say so); `credentials` as
    `common.tls.client_channel` takes them."""
    deadline = time.monotonic() + timeout_s
    with client_channel(address, credentials) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        while not stub.Stats(worker_pb2.StatsRequest(), timeout=10).kernels_ready:
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {address}: kernels not compiled within {timeout_s:.0f}s")
            time.sleep(0.2)


def wait_warm(child: Child, timeout_s: float) -> None:
    """`wait_serving`, and for a worker until its kernels are compiled."""
    wait_serving(child, timeout_s, lambda: None)
    if child.name.startswith("worker"):
        wait_kernels_ready(child.address, timeout_s, None if child.credentials is FROM_ENV else child.credentials)


def running(children: list[Child], timeout_s: float = 120.0, grace_s: float = 5.0,
            wait: Callable[[Child], None] | None = None,
            on_start: Callable[[Child], None] | None = None) -> AbstractContextManager[list[Child]]:
    """`common.procs.running`, waiting for each child with `wait_warm` unless told otherwise."""
    return _running(children, timeout_s, grace_s, wait or (lambda c: wait_warm(c, timeout_s)), on_start)
