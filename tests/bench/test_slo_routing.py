"""`cotserve bench slo-routing`: its mixed-class load against a real gateway, and its report's verdicts."""

from __future__ import annotations

import asyncio

from rich.console import Console

from cotserve.bench.isolation import RequestRecord
from cotserve.bench.slo import LoadResult
from cotserve.bench.slo_routing import NEW_TOKENS, _pool, by_worker, drive, print_report
from cotserve.slo.v1 import slo_pb2
from cotserve.common.sampling import SlaClass


def test_the_load_mixes_every_class_with_its_own_answer_length(demo_gateway):
    run = asyncio.run(drive(demo_gateway, seconds=1.5, rate=12.0, prompts=["1+2=", "3+4="], seed=3))
    assert len(run.records) == 17 and {c for c, _ in run.records} == set(SlaClass)  # the seed's draws: every class
    for cls, rec in run.records:
        assert rec.error is None and rec.ttft_ms is not None and rec.tokens == NEW_TOKENS[cls]


def _run(ttfts: dict[SlaClass, list[float]]) -> LoadResult:
    run = LoadResult(60.0)
    for cls, values in ttfts.items():
        run.records += [(cls, RequestRecord(ttft_ms=v)) for v in values]
    return run


def _printed(out: dict, console: Console | None = None) -> str:
    """The report of a run that has figures (print_report says so), as text."""
    console = console or Console(record=True, width=220)
    assert print_report(out, console)
    return console.export_text()


def test_the_report_compares_p90_overall_and_per_class():
    base = _run({SlaClass.REALTIME: [10.0] * 10, SlaClass.INTERACTIVE: [100.0] * 10, SlaClass.BATCH: [400.0] * 10})
    better = _run({SlaClass.REALTIME: [12.0] * 10, SlaClass.INTERACTIVE: [50.0] * 10, SlaClass.BATCH: [200.0] * 10})
    out = {"observations": 500, "ttft_mape": 0.18, "ttft_mape_by_load": [("light (0-3 in flight)", 100, 0.1)],
           "rate_rps": 20.0, "runs": {"least loaded": base, "predicted TTFT": better}, "slowed": "flood",
           "routed_by": {"least loaded": {"load": 30}, "predicted TTFT": {"predicted_ttft": 28, "load": 2}},
           "flood_tok_s": {"least loaded": 1500.0, "predicted TTFT": 1800.0}}
    console = Console(record=True, width=220)
    text = _printed(out, console)
    assert "Three workers (one flooded by 16 streams not through the gateway), 20.0 requests/s" in text
    assert "predicted TTFT: worker picks by predicted TTFT 28, by the load heuristic 2" in text
    assert "the flood was served 1,500 tok/s under least loaded, 1,800 tok/s under predicted TTFT" in text
    assert "met: all classes: p90 TTFT 200 ms vs 400 ms, 50% better (goal >= 30% better)" in text
    assert "NOT met: REALTIME: p90 TTFT 12 ms with predictions vs 10 least loaded (no worse)" in text
    assert "met: BATCH: p90 TTFT 200 ms with predictions vs 400 least loaded" in text
    assert "held-out TTFT MAPE 18.0% (light (0-3 in flight): 10.0% of 100)" in text
    worse = {**out, "runs": {"least loaded": better, "predicted TTFT": base}}
    assert print_report(worse, console) and "NOT met: all classes: p90 TTFT 400 ms vs 200 ms, 100% worse" in console.export_text()
    assert not print_report({"untrained": "too few request observations: 3, need 50"}, console)


def test_rounds_are_kept_and_pooled_and_each_rounds_p90_is_reported():
    out: dict = {"runs": {}}
    fast, slow = _run({SlaClass.INTERACTIVE: [100.0] * 10}), _run({SlaClass.INTERACTIVE: [300.0] * 10})
    _pool(out, 0, "least loaded", slow, 1000.0, {"load": 10})
    _pool(out, 0, "predicted TTFT", fast, 1200.0, {"predicted_ttft": 10})
    _pool(out, 1, "predicted TTFT", slow, 1400.0, {"predicted_ttft": 9, "load": 1})
    _pool(out, 1, "least loaded", slow, 1100.0, {"load": 10})
    assert [sorted(r) for r in out["rounds"]] == [["least loaded", "predicted TTFT"]] * 2
    pooled = out["runs"]["predicted TTFT"]
    assert pooled.seconds == 120.0 and sorted(r.ttft_ms for _, r in pooled.records) == [100.0] * 10 + [300.0] * 10
    assert len(fast.records) == len(slow.records) == 10  # the rounds' own records untouched
    assert out["routed_by"] == {"least loaded": {"load": 20}, "predicted TTFT": {"predicted_ttft": 19, "load": 1}}
    assert out["flood_tok_s"] == {"least loaded": 1050.0, "predicted TTFT": 1300.0}  # the rounds' mean
    out.update({"observations": 500, "ttft_mape": 0.5, "ttft_mape_by_load": [], "rate_rps": 20.0, "slowed": "max-seqs"})
    text = _printed(out)
    assert "Three workers (one at --max-num-seqs 4)" in text
    assert "round 1: all classes p90 TTFT 100 ms with predictions vs 300 ms least loaded (67% better)" in text
    assert "round 2: all classes p90 TTFT 300 ms with predictions vs 300 ms least loaded (0% better)" in text


def test_each_routings_requests_are_split_by_worker_as_the_gateway_timed_them():
    """Observations are counted for the routing whose replay they started in (by time span) and the worker that
    served them; the report prints each worker's share and TTFT beside the client's p90."""
    def obs(t_ms: int, worker: str, ttft: float) -> slo_pb2.RequestObservation:
        return slo_pb2.RequestObservation(start_unix_ms=t_ms, worker=worker, ttft_ms=ttft)

    requests = ([obs(1_000 + i, "a", 100.0) for i in range(6)] + [obs(1_100 + i, "b", 10.0) for i in range(2)]
                + [obs(5_000 + i, "a", 300.0) for i in range(2)] + [obs(5_100 + i, "b", 20.0) for i in range(8)]
                + [obs(9_000, "a", 1e6)])  # between the replays: counted nowhere
    rows = by_worker(requests, {"least loaded": [(1_000, 2_000)], "predicted TTFT": [(5_000, 6_000)]}, ["a", "b", "c"])
    assert rows["least loaded"] == [("worker 0 (slowed)", 6, 0.75, 100.0, 100.0), ("worker 1", 2, 0.25, 10.0, 10.0),
                                    ("worker 2", 0, 0.0, 0.0, 0.0)]
    assert rows["predicted TTFT"][:2] == [("worker 0 (slowed)", 2, 0.2, 300.0, 300.0), ("worker 1", 8, 0.8, 20.0, 20.0)]
    base, pred = _run({SlaClass.INTERACTIVE: [400.0] * 10}), _run({SlaClass.INTERACTIVE: [200.0] * 10})
    out = {"observations": 500, "ttft_mape": 0.5, "ttft_mape_by_load": [], "rate_rps": 20.0, "slowed": "flood",
           "runs": {"least loaded": base, "predicted TTFT": pred}, "by_worker": rows}
    text = _printed(out)
    assert "Where the requests went: TTFT ms at the gateway by worker" in text
    lines = [" ".join(line.replace("│", " ").split()) for line in text.splitlines()]
    assert "least loaded worker 0 (slowed) 6 75% 100 100 400" in lines
    assert "predicted TTFT worker 0 (slowed) 2 20% 300 300 200" in lines
    assert "worker 1 8 80% 20 20" in lines
