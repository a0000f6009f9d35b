"""Samples from span attributes, retention and series bounds, and the state file."""

from __future__ import annotations

import json

import pytest

from cotserve.telemetry.store import Aggregator, Malformed, RequestSample, SeriesKey, kv_bucket, sample_from_attributes

NOW_MS = 1_800_000_000_000


class Clock:
    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> float:
        return self.ms / 1000


def attrs(**over):
    a = {"cotserve.component": "gateway", "cotserve.model_version": "m@abc", "cotserve.sla_class": "SLA_CLASS_BATCH",
         "cotserve.kv_used_fraction_at_admission": 0.6, "cotserve.ttft_ms": 20.0, "cotserve.e2e_ms": 300, "cotserve.queue_ms": 1.5,
         "cotserve.tpot_ms": 4.0}
    a.update(over)
    return {k: v for k, v in a.items() if v is not None}


def sample(end_ms: int, ttft: float = 10.0, version: str = "m@1", sla: str = "BATCH", tenant: str = "t", kv: int = 0) -> RequestSample:
    return RequestSample(end_ms, SeriesKey(version, sla, tenant, kv), {"ttft": ttft, "e2e": ttft * 10, "queue": 1.0})


def test_sample_from_attributes_and_occupancy_buckets():
    s = sample_from_attributes(attrs(), 5_000_000_123)
    assert s.end_unix_ms == 5000
    assert s.key == SeriesKey("m@abc", "BATCH", "default", 50)
    assert s.latencies_ms == {"e2e": 300.0, "ttft": 20.0, "queue": 1.5, "tpot": 4.0}
    assert "tpot" not in sample_from_attributes(attrs(**{"cotserve.tpot_ms": None}), 0).latencies_ms  # one-token completion
    assert [kv_bucket(f) for f in (0.0, 0.2499, 0.25, 0.5, 0.74, 0.75, 1.0)] == [0, 0, 25, 50, 50, 75, 75]


@pytest.mark.parametrize("bad, field", [
    ({"cotserve.model_version": None}, "cotserve.model_version: want a non-empty string"),
    ({"cotserve.model_version": 7}, "cotserve.model_version: want a non-empty string"),
    ({"cotserve.ttft_ms": "fast"}, "cotserve.ttft_ms: want a finite number"),
    ({"cotserve.e2e_ms": -1.0}, "cotserve.e2e_ms: want a finite number >= 0"),
    ({"cotserve.e2e_ms": float("nan")}, "cotserve.e2e_ms: want a finite number"),
    ({"cotserve.queue_ms": True}, "cotserve.queue_ms: want a finite number"),
    ({"cotserve.queue_ms": None}, "cotserve.queue_ms: missing"),
    ({"cotserve.kv_used_fraction_at_admission": 1.5}, "want 0..1"),
    ({"cotserve.kv_used_fraction_at_admission": [0.1]}, "cotserve.kv_used_fraction_at_admission: want a finite number"),
    ({"cotserve.sla_class": ""}, "cotserve.sla_class: want a non-empty string"),
])
def test_malformed_attributes_name_the_field(bad, field):
    with pytest.raises(Malformed, match=field.replace(".", r"\.").replace("(", r"\(")):
        sample_from_attributes(attrs(**bad), 0)


def test_matrix_and_time_view_merge_the_selected_series():
    agg = Aggregator(slot_ms=10_000, retention_ms=3_600_000, clock=Clock(NOW_MS))
    agg.add(sample(NOW_MS - 25_000, 10, kv=0))
    agg.add(sample(NOW_MS - 24_000, 12, kv=0, tenant="u"))
    agg.add(sample(NOW_MS - 5_000, 30, kv=50, sla="REALTIME"))
    agg.add(sample(NOW_MS - 5_000, 60, version="m@2", kv=75))
    m = agg.matrix("ttft")
    assert {k: h.count for k, h in m.items()} == {("m@1", 0): 2, ("m@1", 50): 1, ("m@2", 75): 1}
    assert {k: h.count for k, h in agg.matrix("ttft", sla_class="BATCH", tenant="t").items()} == {("m@1", 0): 1, ("m@2", 75): 1}
    assert {k: h.count for k, h in agg.matrix("ttft", window_ms=10_000).items()} == {("m@1", 50): 1, ("m@2", 75): 1}
    assert {k: h.count for k, h in agg.matrix("ttft", model_version="m@2").items()} == {("m@2", 75): 1}
    assert agg.matrix("tpot") == {}  # no sample had a tpot
    slot = NOW_MS - NOW_MS % 10_000
    assert {k: h.count for k, h in agg.time_view("ttft").items()} == {
        ("m@1", slot - 30_000): 2, ("m@1", slot - 10_000): 1, ("m@2", slot - 10_000): 1}
    with pytest.raises(ValueError, match="metric: want one of e2e, ttft, tpot, queue"):
        agg.matrix("p99")


def test_retention_drops_oldest_slots_and_too_old_samples():
    clock = Clock(NOW_MS)
    agg = Aggregator(slot_ms=1_000, retention_ms=10_000, clock=clock)
    for k in range(10):
        agg.add(sample(NOW_MS - k * 1000))
    assert len(agg.slots) == 10 and agg.num_series == 10
    assert not agg.add(sample(NOW_MS - 60_000)) and agg.dropped_too_old == 1
    clock.ms += 5_000  # five seconds on: the four slots that ended more than 10 s ago fall out
    agg.evict()
    assert sorted(agg.slots) == [NOW_MS - NOW_MS % 1000 - k * 1000 for k in range(5, -1, -1)]
    assert agg.num_series == 6 and agg.matrix("ttft")[("m@1", 0)].count == 6


def test_series_bound_drops_oldest_slots_first():
    agg = Aggregator(slot_ms=1_000, retention_ms=3_600_000, max_series=6, clock=Clock(NOW_MS))
    for k in range(4):  # 4 slots x 2 tenants = 8 series > 6
        for tenant in ("a", "b"):
            agg.add(sample(NOW_MS - (3 - k) * 1000, tenant=tenant))
    assert agg.num_series == 6 and min(agg.slots) == NOW_MS - NOW_MS % 1000 - 2000
    assert sum(len(s) for s in agg.slots.values()) == agg.num_series


def test_state_file_round_trip_and_corrupt_file(tmp_path, caplog):
    path = tmp_path / "state.json"
    agg = Aggregator(clock=Clock(NOW_MS))
    for k in range(50):
        agg.add(sample(NOW_MS - k * 700, ttft=k * 3.3, kv=(0, 25, 50, 75)[k % 4]))
    agg.save(path)
    assert not agg.dirty and not (tmp_path / "state.json.tmp").exists()
    again = Aggregator(clock=Clock(NOW_MS))
    assert again.load(path) == agg.num_series
    for metric in ("ttft", "e2e", "queue"):
        assert {k: (h.counts, h.count) for k, h in again.matrix(metric).items()} == {
            k: (h.counts, h.count) for k, h in agg.matrix(metric).items()}
    assert Aggregator().load(tmp_path / "missing.json") == 0

    data = json.loads(path.read_text())
    data["series"][0][2]["ttft"][0] += 1  # count no longer matches its buckets
    path.write_text(json.dumps(data))
    fresh = Aggregator(clock=Clock(NOW_MS))
    assert fresh.load(path) == 0 and fresh.num_series == 0
    assert (tmp_path / "state.json.corrupt").exists() and not path.exists()
    assert "unreadable" in caplog.text
    path.write_text("{not json")
    assert Aggregator().load(path) == 0
