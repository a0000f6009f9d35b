"""The gateway's settings for the SLO predictor: the link to it (`slo_link.py`) and the admission rules that act on its
forecasts (`slo_rules.py`). A group of `GatewayConfig`: each field is the setting `slo_<field>` of `serve gateway`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cotserve.common.config import Cli


@dataclass(slots=True)
class SloSettings:
    """How the gateway uses the SLO predictor (nothing without `address`)."""

    address: str | None = None
    """The SLO predictor HOST:PORT: windows are reported to it, and its forecasts and predictions drive the rules
    below (none: heuristics only)."""
    admission: bool = False
    """Hold BATCH arrivals in the gateway while an urgent class's forecast is over the threshold (from
    --slo-throttle-from x threshold, a share rising to all at it), drawn again at every forecast refresh. Off by
    default: `cotserve bench slo` compares it with no rule, and it has not been better there."""
    routing: bool = False
    """Route among a model's workers by predicted TTFT (the predictor's trained trees, fetched when they change and
    evaluated in the gateway) instead of least loaded. Off by default: `cotserve bench slo-routing` compares the two,
    and which is better depends on why a worker is slow."""
    predict_budget_ms: float = 5.0
    """Milliseconds routing waits for a latency prediction from a predictor whose trees this gateway cannot evaluate
    itself (another build's features), before using the load heuristic."""
    retry_after_ms: int = 10_000
    """retry-after-ms, on average (each drawn within +-50%), of a BATCH request turned away because --slo-max-held
    already wait."""
    throttle_from: float = 1.0
    """Where holding BATCH starts, as a fraction of the forecast threshold (1, the default: all BATCH while the
    forecast is over the threshold, none below; 0.5: a share rising from half the threshold)."""
    max_hold_ms: int = 30_000
    """Longest a BATCH request is held on the forecast; then it goes whatever the forecast says."""
    max_held: int = 1024
    """BATCH requests held at once; more are turned away (RESOURCE_EXHAUSTED with retry-after-ms)."""
    pause_batch: bool = True
    """While an urgent class's forecast is at or over the threshold (and urgent requests are in flight), pause the
    model's running BATCH work on its workers (PauseBatch: BATCH sits out every engine step that has urgent work), a
    few seconds at a time, renewed at each forecast refresh. Without --slo, or while the forecast is below the
    threshold, untrained or missing, nothing is paused."""
    max_pause_ms: int = 5_000
    """Longest BATCH stays paused in one go; then it runs for at least half as long before it may be paused again
    (so that BATCH streams keep moving through a long urgent burst)."""
    shed_over: float = 0.8
    """While an urgent class's forecast is at or over the threshold, turn away (RESOURCE_EXHAUSTED, retry-after-ms) an
    INTERACTIVE request that would queue in this gateway and whose TTFT p90, predicted by the SLO predictor's trees
    for the worker picked for it, is over this multiple of the class's TTFT target, rather than queue it behind a
    backlog that makes it, and those after it, miss; 0: never (a client then gets a late answer, not a fast refusal).
    A request turned away counts as a miss; what it buys is the backlog it does not add (`cotserve bench slo`
    measures it)."""
    forecast_interval_s: float = 1.0
    """Seconds between forecast refreshes (holding, pausing and shedding act on the latest; one five refreshes old is
    stale and acts on nothing)."""
    backoff_s: float = 5.0
    """Seconds routing stops asking a predictor per request after a failed or untrained answer."""
    model_refresh_s: float = 5.0
    """Seconds between checks for a newly trained latency model (only its version is fetched while unchanged)."""
    max_backlog: int = 600
    """Reports kept for a predictor that does not answer (the oldest are dropped beyond it)."""
    urgent_idle_s: float = 2.0
    """With no REALTIME or INTERACTIVE request of a model in flight or started for this long, nothing is held or
    paused for it whatever the forecast (its features look back a minute, so it stays high after a burst)."""

    CLI: ClassVar[dict[str, Cli]] = {
        "address": Cli(flag="--slo-address --slo", env=("COTSERVE_SLO_ADDRESS",)),
        "predict_budget_ms": Cli(flag="--slo-predict-budget-ms --slo-budget-ms", env=("COTSERVE_SLO_BUDGET_MS",)),
    }

    def validate(self) -> None:
        """ValueError naming the first setting out of its range."""
        checks = [
            (self.retry_after_ms >= 1, f"slo_retry_after_ms: {self.retry_after_ms}, must be >= 1"),
            (0 < self.throttle_from <= 1, f"slo_throttle_from: {self.throttle_from}, allowed (0, 1]"),
            (self.shed_over == 0 or 0.25 <= self.shed_over <= 100,
             f"slo_shed_over: {self.shed_over}, allowed 0 (off) or 0.25..100"),
            (1_000 <= self.max_pause_ms <= 60_000, f"slo_max_pause_ms: {self.max_pause_ms}, allowed 1000..60000"),
            (self.max_hold_ms >= 0, f"slo_max_hold_ms: {self.max_hold_ms}, must be >= 0"),
            (self.max_held >= 0, f"slo_max_held: {self.max_held}, must be >= 0"),
            (self.predict_budget_ms > 0, f"slo_predict_budget_ms: {self.predict_budget_ms}, must be > 0"),
            (min(self.forecast_interval_s, self.backoff_s, self.model_refresh_s) > 0,
             "slo_forecast_interval_s / slo_backoff_s / slo_model_refresh_s: must be > 0"),
            (self.max_backlog >= 1, f"slo_max_backlog: {self.max_backlog}, must be >= 1"),
            (self.urgent_idle_s >= 0, f"slo_urgent_idle_s: {self.urgent_idle_s}, must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
