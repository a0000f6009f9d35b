"""SLA targets per class: one definition for the gateway's admission, the SLO predictor's labels and the benchmarks.

A target is a time to first token and a p95 inter-token latency, in milliseconds. Both the gateway and the SLO
predictor take overrides as `--sla-target CLASS=TTFT_MS/ITL_P95_MS` (repeatable) or `COTSERVE_SLA_TARGETS`, so
the two can be kept in sync from one environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from cotserve.common.sampling import SlaClass


@dataclass(slots=True, frozen=True)
class SlaTarget:
    ttft_ms: float
    itl_p95_ms: float


DEFAULT_SLA_TARGETS: dict[SlaClass, SlaTarget] = {
    SlaClass.REALTIME: SlaTarget(ttft_ms=250.0, itl_p95_ms=50.0),
    SlaClass.INTERACTIVE: SlaTarget(ttft_ms=1000.0, itl_p95_ms=100.0),
    SlaClass.BATCH: SlaTarget(ttft_ms=30000.0, itl_p95_ms=1000.0),
}
"""The defaults (do not mutate: `sla_targets()` returns a copy)."""

SLA_TARGET_SYNTAX = "CLASS=TTFT_MS/ITL_P95_MS (classes: realtime, interactive, batch)"


def parse_sla_target(text: str) -> tuple[SlaClass, SlaTarget]:
    """`interactive=1000/100` -> (INTERACTIVE, SlaTarget(ttft_ms=1000, itl_p95_ms=100))."""
    name, _, values = text.partition("=")
    ttft, _, itl = values.partition("/")
    try:
        cls = SlaClass[name.strip().upper()]
        target = SlaTarget(float(ttft), float(itl))
    except (KeyError, ValueError):
        raise ValueError(f"sla_target: {text!r} is not {SLA_TARGET_SYNTAX}") from None
    if target.ttft_ms <= 0 or target.itl_p95_ms <= 0:
        raise ValueError(f"sla_target: {text!r}: both targets must be > 0 ms")
    return cls, target


def sla_targets(overrides: Iterable[str] = ()) -> dict[SlaClass, SlaTarget]:
    """The defaults with `CLASS=TTFT_MS/ITL_P95_MS` overrides, keyed (and ordered) by class."""
    targets = dict(DEFAULT_SLA_TARGETS)
    targets.update(parse_sla_target(text) for text in overrides)
    return {cls: targets[cls] for cls in SlaClass}
