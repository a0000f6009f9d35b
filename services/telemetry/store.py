"""What the telemetry service keeps: request samples aggregated into histograms per time slot, and
the most recent traces.

A request becomes one sample when the gateway's summary span arrives (the span marked
`cotserve.component = gateway`): its model version, SLA class, tenant, the worker's KV-cache
occupancy when the request was admitted, and four latencies (end-to-end, TTFT, time per output
token, queue). Samples land in mergeable histograms keyed by (time slot, model version, class,
tenant, occupancy bucket). Memory is bounded twice: slots older than the retention are dropped,
and when the number of series passes `max_series` the oldest slots go first. The state is saved
as JSON (atomically, on a timer and at shutdown) and restored at start.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, NamedTuple

from cotserve.telemetry.histogram import Histogram

log = logging.getLogger("cotserve.telemetry")

METRICS = ("e2e", "ttft", "tpot", "queue")
KV_BUCKETS_PCT = (0, 25, 50, 75)
STATE_VERSION = 1


class Malformed(ValueError):
    """A request span whose attributes are missing, mistyped or out of range."""


class SeriesKey(NamedTuple):
    model_version: str
    sla_class: str
    tenant: str
    kv_pct: int


@dataclass(slots=True, frozen=True)
class RequestSample:
    end_unix_ms: int
    key: SeriesKey
    latencies_ms: dict[str, float]  # metric -> value; tpot is absent for one-token completions


def kv_bucket(fraction: float) -> int:
    """Lower bound in percent of the occupancy bucket (0-25, 25-50, 50-75, 75-100 %)."""
    return KV_BUCKETS_PCT[min(3, int(fraction * 4))]


def any_value(v) -> object:
    """An OTLP AnyValue as a Python value (arrays become lists; kvlists and bytes as is)."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _number(attrs: dict, key: str, required: bool = True) -> float | None:
    v = attrs.get(key)
    if v is None:
        if required:
            raise Malformed(f"{key}: missing")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise Malformed(f"{key}: want a finite number >= 0, got {v!r}")
    return float(v)


def _string(attrs: dict, key: str, default: str | None = None) -> str:
    v = attrs.get(key, default)
    if not isinstance(v, str) or not v:
        raise Malformed(f"{key}: want a non-empty string, got {v!r}")
    return v


def sample_from_attributes(attrs: dict, end_unix_nano: int) -> RequestSample:
    """The sample of one successful request from its gateway span's attributes (raises Malformed)."""
    kv = _number(attrs, "cotserve.kv_used_fraction_at_admission")
    if kv > 1.0:
        raise Malformed(f"cotserve.kv_used_fraction_at_admission: want 0..1, got {kv}")
    sla = _string(attrs, "cotserve.sla_class").removeprefix("SLA_CLASS_")
    latencies = {"e2e": _number(attrs, "cotserve.e2e_ms"), "ttft": _number(attrs, "cotserve.ttft_ms"),
                 "queue": _number(attrs, "cotserve.queue_ms")}
    tpot = _number(attrs, "cotserve.tpot_ms", required=False)
    if tpot is not None:
        latencies["tpot"] = tpot
    key = SeriesKey(_string(attrs, "cotserve.model_version"), sla, _string(attrs, "cotserve.tenant", "default"), kv_bucket(kv))
    return RequestSample(end_unix_nano // 1_000_000, key, latencies)


class Aggregator:
    """Histograms per (slot, series, metric), bounded by retention and by series count."""

    def __init__(self, slot_ms: int = 10_000, retention_ms: int = 3_600_000, max_series: int = 100_000,
                 clock=time.time) -> None:
        if slot_ms < 1 or retention_ms < slot_ms:
            raise ValueError(f"slot_ms ({slot_ms}) must be >= 1 and retention_ms ({retention_ms}) >= slot_ms")
        self.slot_ms, self.retention_ms, self.max_series, self.clock = slot_ms, retention_ms, max_series, clock
        self.slots: dict[int, dict[SeriesKey, dict[str, Histogram]]] = {}
        self.num_series = 0
        self.dropped_too_old = 0
        self.dirty = False

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def add(self, sample: RequestSample) -> bool:
        """Add one sample; False when it is older than the retention (dropped)."""
        now = self.now_ms()
        if sample.end_unix_ms < now - self.retention_ms:
            self.dropped_too_old += 1
            return False
        slot = sample.end_unix_ms - sample.end_unix_ms % self.slot_ms
        series = self.slots.setdefault(slot, {})
        hists = series.get(sample.key)
        if hists is None:
            hists = series[sample.key] = {}
            self.num_series += 1
            self.evict(now)  # a new series (every new slot starts one) is when the bounds can be passed
        for metric, value in sample.latencies_ms.items():
            h = hists.get(metric)
            if h is None:
                h = hists[metric] = Histogram()
            h.add(value)
        self.dirty = True
        return True

    def evict(self, now_ms: int | None = None) -> None:
        now = self.now_ms() if now_ms is None else now_ms
        for slot in sorted(self.slots):
            if slot + self.slot_ms > now - self.retention_ms and self.num_series <= self.max_series:
                break
            self.num_series -= len(self.slots.pop(slot))
            self.dirty = True

    def _select(self, metric: str, sla_class: str | None, tenant: str | None, model_version: str | None,
                window_ms: int) -> Iterable[tuple[int, SeriesKey, Histogram]]:
        if metric not in METRICS:
            raise ValueError(f"metric: want one of {', '.join(METRICS)}, got {metric!r}")
        self.evict()
        since = self.now_ms() - window_ms if window_ms else None
        for slot in sorted(self.slots):
            if since is not None and slot + self.slot_ms <= since:
                continue
            for key, hists in self.slots[slot].items():
                if (sla_class and key.sla_class != sla_class) or (tenant and key.tenant != tenant) or (
                        model_version and key.model_version != model_version):
                    continue
                h = hists.get(metric)
                if h is not None:
                    yield slot, key, h

    def matrix(self, metric: str, sla_class: str | None = None, tenant: str | None = None,
               model_version: str | None = None, window_ms: int = 0) -> dict[tuple[str, int], Histogram]:
        """(model version, occupancy bucket) -> merged histogram."""
        out: dict[tuple[str, int], Histogram] = {}
        for _, key, h in self._select(metric, sla_class, tenant, model_version, window_ms):
            out.setdefault((key.model_version, key.kv_pct), Histogram()).merge(h)
        return out

    def time_view(self, metric: str, sla_class: str | None = None, tenant: str | None = None,
                  model_version: str | None = None, window_ms: int = 0) -> dict[tuple[str, int], Histogram]:
        """(model version, slot start ms) -> merged histogram."""
        out: dict[tuple[str, int], Histogram] = {}
        for slot, key, h in self._select(metric, sla_class, tenant, model_version, window_ms):
            out.setdefault((key.model_version, slot), Histogram()).merge(h)
        return out

    # -- persistence -------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "version": STATE_VERSION, "slot_ms": self.slot_ms,
            "series": [[slot, list(key), {m: h.to_json() for m, h in hists.items()}]
                       for slot, series in sorted(self.slots.items()) for key, hists in series.items()],
        }

    def load_json(self, data: dict) -> int:
        """Replace the state with `data` (from `to_json`); returns the series restored."""
        if data.get("version") != STATE_VERSION or data.get("slot_ms") != self.slot_ms:
            raise ValueError(f"state has version {data.get('version')} / slot_ms {data.get('slot_ms')}, "
                             f"want {STATE_VERSION} / {self.slot_ms}")
        slots: dict[int, dict[SeriesKey, dict[str, Histogram]]] = {}
        n = 0
        for slot, key, hists in data["series"]:
            if int(slot) % self.slot_ms:
                raise ValueError(f"slot {slot} is not a multiple of slot_ms")
            mv, sla, tenant, kv = key
            if kv not in KV_BUCKETS_PCT or not all(isinstance(x, str) for x in (mv, sla, tenant)):
                raise ValueError(f"bad series key {key!r}")
            if not set(hists) <= set(METRICS):
                raise ValueError(f"unknown metric in {sorted(hists)}")
            slots.setdefault(int(slot), {})[SeriesKey(mv, sla, tenant, kv)] = {m: Histogram.from_json(h) for m, h in hists.items()}
            n += 1
        self.slots, self.num_series, self.dirty = slots, n, False
        self.evict()
        return n

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), separators=(",", ":")))
        os.replace(tmp, path)
        self.dirty = False

    def load(self, path: Path) -> int:
        """Restore from `path` if it exists; a missing file is an empty start, a corrupt one is
        logged, set aside as `<name>.corrupt` and also an empty start. Returns series restored."""
        if not path.exists():
            return 0
        try:
            return self.load_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as exc:
            aside = path.with_name(path.name + ".corrupt")
            os.replace(path, aside)
            log.error("telemetry state %s is unreadable (%s); starting empty, the file is kept as %s", path, exc, aside)
            return 0


class TraceStore:
    """The spans of the most recent `max_traces` traces, for GetTrace and `cotserve trace check`."""

    def __init__(self, max_traces: int = 10_000, max_spans_per_trace: int = 1_000) -> None:
        self.max_traces, self.max_spans_per_trace = max_traces, max_spans_per_trace
        self.traces: OrderedDict[bytes, list] = OrderedDict()

    def add(self, trace_id: bytes, service: str, span) -> None:
        spans = self.traces.get(trace_id)
        if spans is None:
            spans = self.traces[trace_id] = []
            if len(self.traces) > self.max_traces:
                self.traces.popitem(last=False)
        if len(spans) < self.max_spans_per_trace:
            spans.append((service, span))

    def get(self, trace_id: bytes) -> list:
        return list(self.traces.get(trace_id, ()))
