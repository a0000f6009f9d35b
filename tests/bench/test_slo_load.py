"""`cotserve bench slo`'s load: the cycle's shape at any length, misses split by cause, and a surge prompt the
served model can take."""

from __future__ import annotations

import asyncio
import math

import pytest

from cotserve.bench.isolation import RequestRecord
from cotserve.bench.slo import BATCH_NEW_TOKENS, INTERACTIVE_NEW_TOKENS, LoadResult, poisson, rates
from cotserve.common.sampling import SlaClass


@pytest.mark.parametrize("cycle_s", [60.0, 15.0])
def test_a_cycle_is_steady_then_a_ramp_then_a_burst_or_surge_then_a_drain_at_any_length(cycle_s):
    cap = 100.0
    at = lambda fraction, cycle=0: rates((cycle + fraction) * cycle_s, cap, cycle_s)  # noqa: E731
    assert at(0.1) == (30.0, 10.0, False)                                   # steady
    assert at(0.5) == pytest.approx((55.0, 20.0, False))                    # half way up the ramp
    assert at(0.7) == (150.0, 30.0, False)                                  # burst: 1.5 + 2 x 0.3 = 2.1 x capacity
    assert at(0.7, cycle=1) == (40.0, 30.0, True)                           # every third cycle: long prompts instead
    assert at(0.7, cycle=4) == (40.0, 30.0, True) and not at(0.7, cycle=2)[2]  # the second of three: in a training stretch
    assert at(0.9) == (10.0, 5.0, False)                                    # drain
    if cycle_s == 60.0:  # the 60 s cycle keeps its old boundaries: 20 s, 40 s, 48 s
        assert rates(19.9, cap)[0] == 30.0 and rates(47.9, cap)[0] == 150.0 and rates(48.1, cap)[0] == 10.0


def test_the_burst_level_sets_interactives_burst_and_caps_its_ramp():
    """`--burst`: INTERACTIVE's rate in the burst, x capacity; the ramp climbs to 0.8 or to a lower burst, never past
    it; BATCH, the surge and the quiet phases are the default's. The arrivals follow it."""
    from cotserve.bench.slo import arrivals

    cap, cycle_s = 100.0, 30.0
    at = lambda fraction, burst, cycle=0: rates((cycle + fraction) * cycle_s, cap, cycle_s, burst)  # noqa: E731
    assert at(0.7, 0.7) == pytest.approx((70.0, 30.0, False)) and at(0.7, 1.2) == pytest.approx((120.0, 30.0, False))
    assert at(0.65, 0.7)[0] == pytest.approx(68.0) and at(0.65, 1.2)[0] == pytest.approx(77.5)  # ramp: to 0.7, to 0.8
    assert at(0.7, 0.7, cycle=1) == at(0.7, 0.9, cycle=1) == (40.0, 30.0, True)
    assert at(0.1, 0.7) == at(0.1, 0.9) and at(0.9, 0.7) == at(0.9, 0.9)
    assert rates(0.7 * cycle_s, cap, cycle_s) == at(0.7, 1.5)  # 1.5 by default

    def interactive_in_bursts(burst: float) -> int:
        ticks = arrivals(90.0, 200.0, ["s"], ["L"], seed=5, cycle_s=cycle_s, burst=burst)
        return sum(cls == SlaClass.INTERACTIVE for t, sent in ticks if 0.67 <= (t * 0.1 / cycle_s) % 1 < 0.8
                   and int(t * 0.1 // cycle_s) % 3 != 1 for cls, _ in sent)
    low, high = interactive_in_bursts(0.5), interactive_in_bursts(1.0)
    assert high / low == pytest.approx(2.0, rel=0.15)  # two bursts of ~4 s: ~400 and ~800 requests


def test_arrivals_per_tick_are_poisson_and_not_capped():
    """A tick's count has the Poisson mean and variance at a burst's rate too (30 a tick: 300 requests/s); the 20
    Bernoulli trials a tick it replaced never gave more than 20."""
    import random
    import statistics

    rng = random.Random(1)
    for mean in (0.4, 30.0):
        counts = [poisson(rng, mean) for _ in range(4000)]
        assert statistics.mean(counts) == pytest.approx(mean, rel=0.05)
        assert statistics.variance(counts) == pytest.approx(mean, rel=0.1)
    assert max(poisson(rng, 30.0) for _ in range(100)) > 30


def test_the_load_without_batch_sends_the_same_interactive_requests_and_no_batch():
    """The replay without BATCH (the floor under any BATCH rule) must differ from off's in BATCH alone: the same
    INTERACTIVE requests at the same ticks with the same prompts, over bursts and a surge."""
    from cotserve.bench.slo import arrivals

    short, long = ["s1", "s2", "s3"], ["L"]
    full = list(arrivals(60.0, 200.0, short, long, seed=3, cycle_s=20.0))
    bare = list(arrivals(60.0, 200.0, short, long, seed=3, cycle_s=20.0, batch=False))
    assert [t for t, _ in full] == [t for t, _ in bare] == list(range(600))
    assert [[a for a in sent if a[0] == SlaClass.INTERACTIVE] for _, sent in full] == [sent for _, sent in bare]
    n_batch = sum(cls == SlaClass.BATCH for _, sent in full for cls, _ in sent)
    n_inter = sum(len(sent) for _, sent in bare)
    assert n_batch > 1000 and n_inter > 2000  # both classes present (about 0.25 and 0.5 x 200 a second over the cycle)
    assert any(p == "L" for _, sent in bare for _, p in sent)  # the surge's long prompts are INTERACTIVE's
    assert all(p in short for _, sent in full for cls, p in sent if cls == SlaClass.BATCH)


def test_served_share_compares_replays_of_different_sizes():
    small, large = LoadResult(1.0), LoadResult(1.0)
    for result, n in ((small, 2), (large, 4)):
        for _ in range(n):
            result.records.append((SlaClass.INTERACTIVE, RequestRecord(tokens=INTERACTIVE_NEW_TOKENS)))
            result.records.append((SlaClass.BATCH, RequestRecord(tokens=BATCH_NEW_TOKENS // 2)))
    assert small.served_share == large.served_share == pytest.approx(64 / 96)
    assert LoadResult(1.0).served_share != LoadResult(1.0).served_share  # NaN: nothing asked for


def test_misses_are_split_by_cause():
    result = LoadResult(1.0)
    records = [RequestRecord(ttft_ms=50.0, itl_ms=[5.0] * 10),             # on target
               RequestRecord(ttft_ms=1500.0, itl_ms=[5.0] * 10),           # first token late
               RequestRecord(ttft_ms=50.0, itl_ms=[500.0] * 10),           # tokens slow
               RequestRecord(error="INVALID_ARGUMENT"), RequestRecord(error="INVALID_ARGUMENT"),
               RequestRecord(error="RESOURCE_EXHAUSTED")]
    result.records = [(SlaClass.INTERACTIVE, r) for r in records]
    assert result.miss_causes(SlaClass.INTERACTIVE) == {"ttft": 1, "inter-token": 1, "failed INVALID_ARGUMENT": 2,
                                                        "failed RESOURCE_EXHAUSTED": 1}
    assert result.miss_rate(SlaClass.INTERACTIVE) == 5 / 6


def test_the_surge_prompt_fits_the_served_models_context(demo_gateway):
    """512 tokens do not fit the demo model's 256-token context with the answer: the surge's prompt takes what
    fits, so surge requests load the worker instead of being refused."""
    from cotserve.bench.slo import INTERACTIVE_NEW_TOKENS, _prompts
    from cotserve.sdk import AsyncClient

    async def main():
        short, long = await _prompts(demo_gateway)
        async with AsyncClient(demo_gateway) as client:
            (info,) = await client.list_models()
            n = len(await client.tokenize(long[0]))
            out = await client.generate(long[0], max_new_tokens=INTERACTIVE_NEW_TOKENS, ignore_eos=True)
        return info, n, out

    info, n, out = asyncio.run(main())
    assert info.max_context_tokens - INTERACTIVE_NEW_TOKENS - 8 <= n <= info.max_context_tokens - INTERACTIVE_NEW_TOKENS
    assert len(out.token_ids) == INTERACTIVE_NEW_TOKENS


def _replay(misses: int, total: int, ttft_ms: float, tokens: int, late_ms: float = 5000.0) -> LoadResult:
    """A replay whose INTERACTIVE requests miss `misses` of `total` (by TTFT: `late_ms`, which is the p99 from two
    misses on) and serve `tokens` in all."""
    r = LoadResult(30.0)
    for i in range(total):
        rec = RequestRecord(ttft_ms=late_ms if i < misses else ttft_ms, itl_ms=[5.0] * 4)
        r.records.append((SlaClass.INTERACTIVE, rec))
    r.records[-1][1].tokens = tokens
    return r


def _run(seed: int, replays: dict[str, LoadResult], onsets: int = 4, ahead: int = 3, auc: float = 0.9):
    from cotserve.slo.model import EventMetrics, Evaluation

    ev = Evaluation(0, 100, 50, 10, auc, 0.5, 0.5, 12.0, onsets, 0.8, 0.4, 0.4, 3.0, 2.0, 0.18, 0.1, 40,
                    events=EventMetrics(onsets, ahead, 1, 0.01, 12.0), baseline_events=EventMetrics(onsets, 1, 2, 0.01, 3.0),
                    ttft_mape_by_load=[("light (0-4 in flight)", 20, 0.25), ("heavy (5-60 in flight)", 20, 0.11)])
    return {"seed": seed, "recorded": _replay(1, 10, 50.0, 100), "windows": 300, "evaluation": ev, "replays": replays}


def test_report_pools_onsets_over_seeds_and_judges_each_seed_against_its_own_replay_without_admission():
    from rich.console import Console

    from cotserve.bench.slo import QUICK, outcomes
    from cotserve.bench.slo_report import print_report, verdicts
    from cotserve.slo.model import pooled_events

    runs = [
        _run(0, {"off": _replay(10, 100, 50.0, 1000), "shed and pause": _replay(1, 100, 40.0, 950)}),   # 10% -> 1%: cut 90%
        _run(2, {"off": _replay(2, 100, 50.0, 1000), "shed and pause": _replay(3, 100, 40.0, 990)}),    # more misses: worse
        _run(4, {"off": _replay(0, 100, 50.0, 1000), "shed and pause": _replay(0, 100, 80.0, 700)}),    # p99 up: worse
    ]
    per_seed = [outcomes(r) for r in runs]
    assert per_seed[0]["shed and pause"].misses == 0.01 and per_seed[0]["shed and pause"].tokens_ratio == 0.95
    worse, cuts, beyond = verdicts(per_seed, "shed and pause")
    assert worse == 2 and cuts == [True]  # only seed 0 missed >= 5% without admission
    assert beyond is None  # no seed replayed off twice
    assert pooled_events([r["evaluation"] for r in runs], "events")[:3] == (12, 9, 0.75)
    console = Console(record=True, width=250)
    assert print_report(runs, QUICK, console)
    text = console.export_text()
    assert "12 held-out violation onsets over the seeds (goal >= 20)" in text and "NOT met: 12 held-out" in text
    assert "NOT met: shed and pause: never worse than off (misses and p99 TTFT): worse on 2 of 3 seeds" in text
    assert "met: shed and pause: where off missed >= 5% (1 seeds), misses down >= 80% at >= 0.85x tokens on 1 of them" in text
    assert "9 = 75.0% [" in text  # the pooled share with its Wilson interval
    assert "seed 2: TTFT MAPE by load: light (0-4 in flight): 25.0% of 20, heavy (5-60 in flight): 11.0% of 20" in text


def test_a_rule_is_judged_worse_beyond_noise_only_by_more_than_off_differed_from_itself():
    from rich.console import Console

    from cotserve.bench.slo import FULL, outcomes
    from cotserve.bench.slo_report import print_report, verdicts

    def replays(off, again, rule):
        return {"off": _replay(off[0], 100, 50.0, 1000, off[1]), "off again": _replay(again[0], 100, 50.0, 1000, again[1]),
                "all-or-nothing": _replay(rule[0], 100, 50.0, 1000, rule[1]), "proportional": _replay(rule[0], 100, 50.0, 1000, rule[1]),
                "pause": _replay(rule[0], 100, 50.0, 1000, rule[1]), "shed": _replay(rule[0], 100, 50.0, 1000, rule[1]),
                "shed and pause": _replay(rule[0], 100, 50.0, 1000, rule[1]), "no BATCH": _replay(0, 100, 50.0, 1000)}

    runs = [
        _run(0, replays((10, 1900), (14, 1950), (12, 1940))),  # worse than off, but less than off differed from itself
        _run(2, replays((10, 1900), (11, 1910), (13, 1905))),  # misses up 3 points, off's gap 1: worse beyond noise
        _run(4, replays((10, 1900), (10, 1900), (8, 1850))),   # better
    ]
    per_seed = [outcomes(r) for r in runs]
    worse, _, beyond = verdicts(per_seed, "proportional")
    assert worse == 2 and beyond == 1
    console = Console(record=True, width=250)
    assert print_report(runs, FULL, console)
    text = console.export_text()
    assert "off replayed twice, the run-to-run gap per seed (INTERACTIVE misses / p99 TTFT): 4.0 points / 50 ms, " \
           "1.0 points / 10 ms, 0.0 points / 0 ms" in text
    assert "NOT met: proportional: never worse than off (misses and p99 TTFT): worse on 2 of 3 seeds, by more than " \
           "off's own run-to-run gap on 1" in text
    assert "off again: never worse" not in text  # the second off run is the yardstick, not a rule


def test_the_replay_without_batch_bounds_what_a_batch_rule_can_cut_and_is_not_judged_as_a_rule():
    from rich.console import Console

    from cotserve.bench.slo import FULL, NO_BATCH, outcomes
    from cotserve.bench.slo_report import most_cut, print_report, rules

    def replays(off, bare, rule):
        out = {v: _replay(rule, 100, 50.0, 1000) for v in FULL.variants}
        out["off"], out["off again"], out[NO_BATCH] = _replay(off, 100, 50.0, 1000), _replay(off, 100, 50.0, 1000), _replay(bare, 100, 50.0, 1000)
        return out

    runs = [_run(0, replays(20, 18, 2)),   # INTERACTIVE's own misses: 2 of 20 were BATCH's, a 10% cut at most
            _run(2, replays(10, 1, 1)),    # BATCH's: up to a 90% cut
            _run(4, replays(0, 0, 0))]     # nothing missed: nothing to cut
    per_seed = [outcomes(r) for r in runs]
    assert [round(most_cut(s), 2) for s in per_seed[:2]] == [0.1, 0.9] and math.isnan(most_cut(per_seed[2]))
    assert NO_BATCH not in rules(FULL) and NO_BATCH in FULL.variants
    console = Console(record=True, width=400)
    assert print_report(runs, FULL, console)
    text = " ".join(console.export_text().split())
    assert ("INTERACTIVE misses against off's, and the most of off's misses a BATCH rule could cut: 18.0% vs 20.0%: 10%, "
            "1.0% vs 10.0%: 90%, 0.0% vs 0.0%: n/a") in text
    assert ("met: all-or-nothing: where off missed >= 5% (2 seeds), misses down >= 80% at >= 0.85x tokens on 2 of them "
            "(within reach, no BATCH leaving <= 20% of off's misses, on 1)") in text
    # shedding acts on INTERACTIVE itself: the replay without BATCH bounds nothing it does, alone or with pause
    assert "met: shed: where off missed >= 5% (2 seeds), misses down >= 80% at >= 0.85x tokens on 2 of them met" in text
    assert text.endswith("met: shed and pause: where off missed >= 5% (2 seeds), misses down >= 80% at >= 0.85x tokens "
                         "on 2 of them")
    assert "no BATCH: never worse" not in text


def test_the_miss_floor_counts_what_no_order_of_service_could_start_within_the_target():
    """`miss_floor`: a fluid queue at margin x capacity a second; what is queued beyond the target's worth of that rate
    is missed whatever the order; BATCH does not count (a rule may hold it all)."""
    from cotserve.bench.slo import arrivals, miss_floor

    I, B = SlaClass.INTERACTIVE, SlaClass.BATCH
    burst = [(0, [(I, "p")] * 25 + [(B, "p")] * 40)] + [(t, []) for t in range(1, 31)]
    # 10/s: one of the 25 starts within their tick, 10 more within 1 s of its end; the other 14 cannot
    assert miss_floor(burst, 10.0, 1000.0, margin=1.0) == pytest.approx(14 / 25)
    assert miss_floor(burst, 10.0, 1000.0, margin=2.0) == pytest.approx(3 / 25)   # 2 + 20 in time
    assert miss_floor(burst, 10.0, 500.0, margin=1.0) == pytest.approx(19 / 25)   # half the target: 1 + 5
    # 9 a second for 3 s at 10/s, then 25 at once: each starts within its tick, nothing queued before the burst
    steady = [(t, [(I, "p")] * (1 if t % 10 else 0)) for t in range(30)] + burst
    assert miss_floor(steady, 10.0, 1000.0, margin=1.0) == pytest.approx(14 / (27 + 25))
    assert math.isnan(miss_floor([(0, [(B, "p")])], 10.0, 1000.0))
    # the load itself: bursts at the capacity leave none; at 1.5x the floor is a few percent; more with less margin
    assert miss_floor(arrivals(90.0, 200.0, ["s"], ["L"], seed=1, cycle_s=30.0, burst=1.0), 200.0, 1000.0) == 0.0
    high = miss_floor(arrivals(90.0, 200.0, ["s"], ["L"], seed=1, cycle_s=30.0, burst=1.5), 200.0, 1000.0)
    assert 0.01 < high < 0.1
    assert miss_floor(arrivals(90.0, 200.0, ["s"], ["L"], seed=1, cycle_s=30.0, burst=1.5), 200.0, 1000.0, margin=1.0) > high


def test_the_report_says_where_the_fluid_floor_puts_the_80_percent_cut_out_of_any_rules_reach():
    from rich.console import Console

    from cotserve.bench.slo import QUICK
    from cotserve.bench.slo_report import print_report

    runs = [_run(0, {"off": _replay(20, 100, 50.0, 1000), "shed and pause": _replay(10, 100, 50.0, 1000)}),
            _run(2, {"off": _replay(10, 100, 50.0, 1000), "shed and pause": _replay(1, 100, 50.0, 1000)})]
    runs[0]["miss_floor"], runs[1]["miss_floor"] = 0.05, 0.01  # over a fifth of off's 20%; under a fifth of 10%
    console = Console(record=True, width=400)
    assert print_report(runs, QUICK, console)
    text = " ".join(console.export_text().split())
    assert ("the fewest INTERACTIVE misses any rule could leave (`miss_floor`: a fluid queue at 1.1x the measured "
            "capacity, BATCH out of the way), per seed, against off's misses and the 80% cut's bound: "
            "5.0% vs 20.0% (cut to 4.0%), 1.0% vs 10.0% (cut to 2.0%)") in text
    assert ("NOT met: shed and pause: where off missed >= 5% (2 seeds), misses down >= 80% at >= 0.85x tokens on 1 of them "
            "(within reach, the fluid floor leaving <= 20% of off's misses, on 1)") in text


def test_report_without_a_trained_seed_says_why_and_fails():
    from rich.console import Console

    from cotserve.bench.slo import QUICK
    from cotserve.bench.slo_report import print_report

    console = Console(record=True, width=200)
    run = {"seed": 0, "recorded": _replay(0, 10, 50.0, 10), "windows": 90, "untrained": "no violation in the training stretch",
           "replays": {}}
    assert not print_report([run], QUICK, console)
    assert "could not train: no violation in the training stretch" in console.export_text()


@pytest.mark.parametrize("given", ["pause", "off,nudge"])
def test_bench_slo_refuses_variants_without_off_or_unknown_naming_the_allowed_ones(given):
    from typer.testing import CliRunner

    from cotserve.cli import app

    result = CliRunner().invoke(app, ["bench", "slo", "--variants", given])
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())
    assert "give off and any of off, off again, no BATCH, all-or-nothing, proportional, pause" in text


def test_bench_slo_refuses_a_burst_out_of_range_naming_it():
    from typer.testing import CliRunner

    from cotserve.cli import app

    result = CliRunner().invoke(app, ["bench", "slo", "--burst", "3.5"])
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())
    assert "--burst" in text and "less than or equal to 3" in text


def test_a_batch_request_gives_up_at_once_when_the_retry_after_would_end_past_its_deadline():
    """A deferred BATCH request waits the gateway's retry-after and tries again, but not when that wait would end
    after `give_up_at`: it gives up then (a full queue's retry-after can be minutes, which held a replay's end 20
    minutes past its last arrival). A gateway stand-in that defers every try: with 0.2 s to go a 50 ms retry-after
    is waited out (more than one try), a 10-minute one is not (one try, no wait)."""
    import time

    import grpc

    from cotserve.bench.slo import _batch
    from cotserve.sdk import ResourceExhausted

    class Deferring:
        def __init__(self, retry_after_ms: int) -> None:
            self.retry_after_ms, self.tries = retry_after_ms, 0

        async def stream(self, *args, **kwargs):
            self.tries += 1
            raise ResourceExhausted(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", self.retry_after_ms)
            yield  # an async generator, as the client's stream is

    for retry_after_ms, more_than_one in ((50, True), (600_000, False)):
        client, rec, result = Deferring(retry_after_ms), RequestRecord(), LoadResult(1.0)
        started = time.perf_counter()
        asyncio.run(_batch(client, "p", rec, result, started + 0.2))
        assert rec.error == "RESOURCE_EXHAUSTED" and rec.ttft_ms is None and time.perf_counter() - started < 1.0
        assert (client.tries > 1) == more_than_one and result.deferrals == client.tries - 1


def test_capacity_is_measured_with_the_loads_own_streamed_calls(monkeypatch):
    """The bursts are multiples of the measured capacity, so it is measured with the calls the load sends: streams.
    A gateway stand-in whose stream takes 20 ms and whose unary call returns at once: four in flight give at most 200
    streams a second, which is the capacity; unary calls (`streamed=False`, bench slo-routing's measure) give many
    times as many."""
    import types

    from cotserve.bench import slo

    class Client:
        def __init__(self, address: str) -> None:
            assert address == "gw"

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def stream(self, prompt, **kwargs):
            assert kwargs["max_new_tokens"] == INTERACTIVE_NEW_TOKENS and kwargs["sla"] == "interactive"
            await asyncio.sleep(0.02)
            yield types.SimpleNamespace(token_ids=[1] * INTERACTIVE_NEW_TOKENS, timing=None)

        async def generate(self, prompt, **kwargs):
            await asyncio.sleep(0)

    monkeypatch.setattr(slo, "AsyncClient", Client)
    streamed = asyncio.run(slo.capacity("gw", ["p"], seconds=0.5, concurrency=4))
    unary = asyncio.run(slo.capacity("gw", ["p"], seconds=0.5, concurrency=4, streamed=False))
    assert 50 < streamed <= 210 and unary > 5 * streamed


def test_each_replay_names_every_admission_rule_so_off_is_off_whatever_the_gateways_defaults():
    """The gateway sheds and pauses by default with the predictor linked; the bench's replays pass each rule's flags
    explicitly, so "off" (and every variant) runs exactly the rules it is named for."""
    import typer
    from typer.testing import CliRunner

    from cotserve.bench.slo import ADMISSION_VARIANTS
    from cotserve.common.config import serve_command
    from cotserve.gateway.config import GatewayConfig

    def parsed(flags: tuple[str, ...]) -> GatewayConfig:
        app, seen = typer.Typer(), []
        serve_command(app, GatewayConfig, "gateway", seen.append, "Start the gateway.")
        result = CliRunner().invoke(app, ["--worker", "127.0.0.1:1", "--slo", "127.0.0.1:2", *flags], env={})
        assert result.exit_code == 0, result.output
        return seen[0]

    linked = parsed(())
    assert (linked.slo.admission, linked.slo.shed_over, linked.slo.pause_batch) == (False, 0.8, True)
    rules = {name: (c.slo.admission, c.slo.throttle_from, c.slo.shed_over, c.slo.pause_batch)
             for name, c in ((name, parsed(flags)) for name, flags in ADMISSION_VARIANTS.items())}
    assert rules == {"off": (False, 1.0, 0.0, False), "off again": (False, 1.0, 0.0, False), "no BATCH": (False, 1.0, 0.0, False),
                     "all-or-nothing": (True, 1.0, 0.0, False), "proportional": (True, 0.5, 0.0, False),
                     "pause": (False, 1.0, 0.0, True), "shed": (False, 1.0, 0.8, False),
                     "shed and pause": (False, 1.0, 0.8, True)}
