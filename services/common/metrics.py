"""Prometheus metrics over HTTP for every service (`--metrics-port`, 0 = off).

Each service builds its own `CollectorRegistry` (no process-global state), registers its
metrics there, and serves `/metrics` on the loopback or host address it was told.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

# Latency buckets in seconds: fine below 100 ms (inter-token), out to a minute (batch e2e).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CallbackCollector(Collector):
    """Metrics computed at scrape time from live state (queues, pools, engine stats)."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()


@dataclass(slots=True)
class MetricsServer:
    port: int
    _server: object
    _thread: object

    def stop(self) -> None:
        self._server.shutdown()  # type: ignore[attr-defined]
        self._server.server_close()  # type: ignore[attr-defined]


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer | None:
    """Serve `/metrics` on host:port; None when port is 0 (metrics off)."""
    if port == 0:
        return None
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(f"metrics_port: cannot bind {host}:{port} ({exc.strerror})") from None
    return MetricsServer(server.server_port, server, thread)
