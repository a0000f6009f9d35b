"""The telemetry service's settings (`cotserve serve telemetry` is generated from them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from cotserve.common.config import Cli, legacy_env
from cotserve.common.paths import cache_dir
from cotserve.common.tls import TlsSettings


@dataclass(slots=True)
class TelemetryConfig(TlsSettings):
    """Everything `cotserve serve telemetry` takes: each field is one setting (`common.config`), its docstring the help."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 4317
    """gRPC port of the OTLP trace receiver and TelemetryService (0 picks a free one)."""
    http_port: int | None = None
    """Serve the live heatmap page over HTTP on this port (0 picks a free one; default: no page)."""
    http_tls: bool = True
    """With tls_cert, serve the page over HTTPS with it (never asking browsers for client certificates); off: plain
    HTTP, for a page on loopback while the gRPC port has mutual TLS."""
    metrics_port: int = 0
    """Port for Prometheus /metrics on `host` (0 = off)."""
    state_file: Path | None = field(default_factory=lambda: cache_dir("telemetry-state.json"))
    """Where the aggregates are kept across restarts (--no-state: nowhere)."""
    slot_s: int = 10
    """Seconds per time slot (the time view's resolution)."""
    retention_s: int = 3600
    """Seconds of data kept; older slots are dropped first."""
    max_series: int = 100_000
    """Histogram series kept at most (oldest slots dropped beyond it)."""
    max_traces: int = 10_000
    """Recent traces kept for GetTrace."""
    save_interval_s: float = 10.0
    """Seconds between saves of the aggregates to the state file."""
    grace_s: float = 5.0
    """Seconds to drain in-flight calls on SIGTERM."""

    CLI: ClassVar[dict[str, Cli]] = {
        **legacy_env("host", "grace_s"),
        "state_file": Cli(env=("COTSERVE_TELEMETRY_STATE",), none_flag="--no-state", none_help="Keep nothing across restarts."),
    }

    def validate(self) -> None:
        self.check_tls()
        if self.slot_s < 1:
            raise ValueError(f"slot_s: must be >= 1, got {self.slot_s}")
        if self.retention_s < self.slot_s:
            raise ValueError(f"retention_s: must be >= slot_s ({self.slot_s}), got {self.retention_s}")
        if self.max_series < 1 or self.max_traces < 1:
            raise ValueError("max_series and max_traces: must be >= 1")
        if self.save_interval_s <= 0:
            raise ValueError(f"save_interval_s: {self.save_interval_s}, must be > 0")
