"""The SLO predictor's settings (`cotserve serve slo` is generated from them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from cotserve.common.config import Cli, legacy_env
from cotserve.common.paths import cache_dir
from cotserve.common.sampling import SlaClass
from cotserve.common.sla import SlaTarget, sla_targets
from cotserve.common.tls import TlsSettings


@dataclass(slots=True)
class SloConfig(TlsSettings):
    """Everything `cotserve serve slo` takes: each field is one setting (`common.config`), its docstring the help."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 50091
    """Port to bind (0 picks a free one)."""
    state_dir: Path | None = field(default_factory=lambda: cache_dir("slo"))
    """Folder for the window history and the models (--no-state: nothing kept across restarts)."""
    horizon_s: int = 30
    """Seconds ahead a forecast covers (1..600)."""
    threshold: float = 0.7
    """Forecast probability above which to scale up and shed BATCH (0..1)."""
    retrain_interval_s: float = 10.0
    """Seconds between retraining checks."""
    min_new_windows: int = 300
    """New windows needed before retraining (a gateway reports 3 per worker per second)."""
    train_window_s: int = 3600
    """Seconds of the most recent history each training fits on."""
    advice_interval_s: float = 10.0
    """Seconds between scale-advice rounds."""
    scale_down_below: float = 0.2
    """Forecast below which, sustained, replicas may go down."""
    scale_down_after_s: float = 300.0
    """Seconds the forecast must stay low before SCALE_DOWN."""
    max_windows: int = 200_000
    """Windows (and request observations) the history keeps at most; the oldest go first."""
    redis_url: str | None = None
    """Redis to publish advice on (cotserve:slo:advice); none: streams and gauges only."""
    metrics_port: int = 0
    """Port for Prometheus /metrics with the advice gauges (0 = off)."""
    sla_target: tuple[str, ...] = ()
    """CLASS=TTFT_MS/ITL_P95_MS overrides, as the gateway's (repeatable; defaults realtime=250/50, interactive=1000/100,
    batch=30000/1000)."""
    grace_s: float = 5.0
    """Seconds to drain in-flight calls on SIGTERM."""

    CLI: ClassVar[dict[str, Cli]] = {
        **legacy_env("host", "redis_url", "grace_s"),
        "state_dir": Cli(env=("COTSERVE_SLO_STATE",), none_flag="--no-state", none_help="Keep nothing across restarts."),
        "sla_target": Cli(env=("COTSERVE_SLA_TARGETS",)),
    }

    @property
    def targets(self) -> dict[SlaClass, SlaTarget]:
        """Every class's target: the defaults with `sla_target`'s overrides."""
        return sla_targets(self.sla_target)

    def validate(self) -> None:
        self.check_tls()
        checks = [
            (1 <= self.horizon_s <= 600, f"horizon_s: {self.horizon_s}, must be within 1..600"),
            (0 < self.threshold < 1, f"threshold: {self.threshold}, must be within (0, 1)"),
            (0 <= self.scale_down_below < self.threshold, f"scale_down_below: {self.scale_down_below}, must be within [0, threshold)"),
            (self.retrain_interval_s > 0 and self.advice_interval_s > 0, "retrain_interval_s and advice_interval_s: must be > 0"),
            (self.min_new_windows >= 1, f"min_new_windows: {self.min_new_windows}, must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        sla_targets(self.sla_target)  # each override parses, or a ValueError names sla_target
