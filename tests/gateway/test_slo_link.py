"""The gateway with the SLO predictor: windows and request observations arrive; BATCH is deferred
while an urgent forecast is above the threshold; routing follows predicted TTFT; and when the
predictor is down or slow, nothing fails."""

# In-process workers here run their engine as a thread (engine_process=False): these tests are about the gateway and the predictor, not
# the engine process boundary, which tests/worker/test_engine_process.py and every CLI-started worker cover;
# a second interpreter importing torch per worker would add about 2 s to each start.

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry import trace

from cotserve.common import errors
from cotserve.common.procs import free_port
from cotserve.common.sampling import SlaClass
from cotserve.common.sla import sla_targets
from cotserve.common.v1 import common_pb2
from cotserve.gateway.server import GatewayConfig, start_gateway
from cotserve.gateway.admission import AdmissionConfig
from cotserve.gateway.metrics import GatewayMetrics
from cotserve.gateway.rules import Chain, RequestContext, Stage
from cotserve.gateway.slo_link import SloLink
from cotserve.gateway.slo_rules import BatchHold, BatchPauses, InteractiveShed, deferred_share
from cotserve.gateway.slo_settings import SloSettings
from cotserve.common.latency import LATENCY_FEATURES, latency_row, predicted_ttft_ms
from cotserve.common.windows import worker_total
from cotserve.sdk import AsyncClient
from cotserve.sdk import ResourceExhausted as SdkResourceExhausted
from cotserve.slo.server import SloConfig, start_slo
from cotserve.slo.v1 import slo_pb2, slo_pb2_grpc
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker
from tests.slo.synth import simulate

I, B = common_pb2.SLA_CLASS_INTERACTIVE, common_pb2.SLA_CLASS_BATCH


def rule_of(gateway, kind: type):
    """The running gateway's admission rule of type `kind`."""
    return next(r for r in gateway.servicer.relay.chain.rules if isinstance(r, kind))


async def trained_slo(seconds: int = 600):
    """An SLO service trained on the queueing simulation of model "m"."""
    running = await start_slo(SloConfig(port=0, state_dir=None, retrain_interval_s=3600, advice_interval_s=3600))
    windows, requests = simulate(seconds, t0_ms=(int(time.time()) - seconds) * 1000)
    running.state.report(slo_pb2.ReportWindowsRequest(windows=windows, requests=requests))
    await running.state.maybe_retrain()
    assert running.state.forecaster.is_trained and running.state.latency.is_trained
    return running, windows


def test_gateway_reports_windows_and_requests_and_defers_batch_on_a_high_forecast():
    async def main():
        slo, windows = await trained_slo()
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=8))
        gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address],
                                                    slo=SloSettings(slo.server.address, admission=True, max_hold_ms=3000)))
        peak = max(windows, key=lambda w: w.queue_depth)
        stop = asyncio.Event()

        async def overload():  # another gateway's worker of the same model, deep in a queue build-up
            while not stop.is_set():
                w = common_pb2.MetricsWindow()
                w.CopyFrom(peak)
                w.model, w.worker, w.start_unix_ms = "cotserve-demo", "127.0.0.1:1", int(time.time()) * 1000
                slo.state.report(slo_pb2.ReportWindowsRequest(windows=[w]))
                await asyncio.sleep(0.5)

        try:
            async with AsyncClient(gateway.server.address) as client:
                started = int(time.time() * 1000)
                for i in range(5):
                    await client.generate(f"{i}+{i}=", max_new_tokens=16, sla="interactive")
                await asyncio.sleep(2.5)  # a window is closed and reported every second
                async with grpc.aio.insecure_channel(slo.server.address) as ch:
                    exported = await slo_pb2_grpc.SloServiceStub(ch).ExportWindows(slo_pb2.ExportWindowsRequest(since_unix_ms=started - 1000))
                ours = [w for w in exported.windows if w.worker == worker.server.address]
                inter = [w for w in ours if w.sla_class == I]
                assert sum(w.arrivals for w in inter) == 5 and sum(w.completions for w in inter) == 5
                assert sum(w.first_tokens for w in inter) == 5 and sum(w.arrivals for w in ours if w.sla_class == B) == 0
                assert all(w.utilization_is_cpu and 0 <= w.kv_used_fraction <= 1 for w in ours)
                # the worker's own Stats ride along: its step time and tokens/s (every client's, not only ours)
                assert any(w.worker_step_ms > 0 for w in ours) and any(w.worker_tokens_per_s > 0 for w in ours)
                assert {w.worker_max_num_seqs for w in ours} == {8}  # its seats, from its Info
                obs = [r for r in exported.requests if r.worker == worker.server.address]
                assert len(obs) == 5 and all(r.sla_class == I and r.prompt_tokens == 5 and r.max_new_tokens == 16 and r.ttft_ms > 0 for r in obs)

                assert (await client.generate("1+2=", max_new_tokens=8, sla="batch")).text  # forecast low: BATCH goes
                task = asyncio.create_task(overload())
                deadline = time.monotonic() + 15
                while rule_of(gateway, BatchHold).defer_share("cotserve-demo")[0] < 1:
                    assert time.monotonic() < deadline, f"the forecast never passed the threshold: {gateway.slo.forecasts}"
                    await asyncio.sleep(0.2)
                urgent_done = asyncio.Event()

                async def urgent_traffic():  # urgent work in flight: the hold protects something (`urgent_idle`)
                    while not urgent_done.is_set():
                        assert (await client.generate("1+2=", max_new_tokens=8, sla="interactive")).text  # it still goes
                        await asyncio.sleep(0.2)

                urgent = asyncio.create_task(urgent_traffic())
                await asyncio.sleep(0.05)
                t = time.monotonic()
                held = asyncio.create_task(client.generate("1+2=", max_new_tokens=8, sla="batch"))
                while rule_of(gateway, BatchHold).held == 0:  # held in the gateway, not turned away
                    assert not held.done(), held.result()
                    await asyncio.sleep(0.02)
                held_out = await held
                urgent_done.set()
                await urgent
                assert held_out.text and time.monotonic() - t >= 2.5  # it went after --slo-max-hold-ms (3 s)
                assert rule_of(gateway, BatchHold).held == 0
                assert held_out.timing.ttft_ms >= 2500  # the client's TTFT counts the hold
                await asyncio.sleep(2.5)  # its observation is reported with the next window
                async with grpc.aio.insecure_channel(slo.server.address) as ch:
                    since = slo_pb2.ExportWindowsRequest(since_unix_ms=started - 1000)
                    exported = await slo_pb2_grpc.SloServiceStub(ch).ExportWindows(since)
                batch_obs = [r for r in exported.requests if r.worker == worker.server.address and r.sla_class == B]
                # the latency model's TTFT starts when the hold ended: what a choice of worker can change
                assert len(batch_obs) == 2 and all(0 < r.ttft_ms < 1000 for r in batch_obs), batch_obs
                stop.set()
                await task
        finally:
            await gateway.stop()
            await worker.stop()
            await slo.stop()

    asyncio.run(main())


def test_gateway_carries_on_when_the_predictor_is_down():
    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4))
        dead = f"127.0.0.1:{free_port()}"
        gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], slo=SloSettings(dead)))
        try:
            async with AsyncClient(gateway.server.address) as client:
                for sla in ("realtime", "interactive", "batch", "batch"):
                    r = await client.generate("37+48-12=", max_new_tokens=32, sla=sla)
                    assert r.text == "<think>37+48=85. 85-12=73.</think> 73"
                await asyncio.sleep(1.5)
            assert gateway.slo.recorder.reports_failed >= 1 and rule_of(gateway, BatchHold).defer_share("cotserve-demo")[0] == 0
            assert len(gateway.slo.recorder.backlog) >= 1  # kept for when the predictor is back
        finally:
            await gateway.stop()
            await worker.stop()

    asyncio.run(main())


def handle(address: str, window: common_pb2.MetricsWindow):
    return SimpleNamespace(address=address, in_flight=window.in_flight, waiting_for_first_token=0, prefill_tokens_ahead=0,
                           waiting_since={}, last_heard=time.monotonic(), stats=None, info=None, seats=0,
                           admission=SimpleNamespace(can_start=lambda cls: True, queues={SlaClass.INTERACTIVE: [None] * window.queue_depth},
                                                     queued_ahead=lambda cls: window.queue_depth,
                                                     starts_now=lambda cls: not window.queue_depth))


def test_routing_picks_the_lower_predicted_ttft_and_falls_back_within_its_budget():
    async def main():
        slo, windows = await trained_slo()
        busy = worker_total([max(windows, key=lambda w: w.queue_depth)], "busy:1")
        idle = worker_total([min(windows, key=lambda w: w.queue_depth)], "idle:1")
        link = SloLink(SloSettings(slo.server.address, routing=True, predict_budget_ms=1000), SimpleNamespace(workers=[]))
        link.recorder.last_worker_window = {"busy:1": busy, "idle:1": idle}
        cands = [handle("busy:1", busy), handle("idle:1", idle)]
        try:
            assert (await link.pick("m", cands, SlaClass.INTERACTIVE, 200, 64)).address == "idle:1"
            assert (await link.pick("m", cands[::-1], SlaClass.INTERACTIVE, 200, 64)).address == "idle:1"
            assert await link.pick("m", cands[:1], SlaClass.INTERACTIVE, 200, 64) is None  # one candidate: nothing to choose
            await slo.stop()
            t = time.monotonic()
            assert await link.pick("m", cands, SlaClass.INTERACTIVE, 200, 64) is None  # down: the heuristic decides
            assert time.monotonic() - t < 1.5 and link.down_until > time.monotonic()
            t = time.monotonic()
            assert await link.pick("m", cands, SlaClass.INTERACTIVE, 200, 64) is None  # backing off: not even asked
            assert time.monotonic() - t < 0.01
        finally:
            await link.stop()
            await slo.stop()

    asyncio.run(main())


def test_predictions_order_the_workers_with_a_free_seat_before_those_without():
    """The lowest predicted TTFT wins among workers where a request would start at once; a worker whose last poll
    had requests waiting, or whose seats this gateway's requests fill, comes after them whatever its prediction."""
    from cotserve.worker.v1 import worker_pb2

    def worker(address: str, waiting: int, in_flight: int, seats: int):
        return SimpleNamespace(address=address, in_flight=in_flight, stats=worker_pb2.StatsResponse(num_waiting_seqs=waiting),
                               seats=seats, admission=SimpleNamespace(can_start=lambda cls: True))

    async def main():
        link = SloLink(SloSettings("127.0.0.1:1", routing=True), SimpleNamespace(workers=[]))
        predicted = {"queued:1": 10.0, "full:1": 20.0, "free:1": 90.0, "free:2": 80.0}

        async def ask(cands, sla, prompt_tokens, max_new):
            return [predicted[w.address] for w in cands]

        link._ask = ask
        queued, full, free1, free2 = worker("queued:1", 3, 0, 4), worker("full:1", 0, 4, 4), worker("free:1", 0, 3, 4), \
            worker("free:2", 0, 1, 32)
        picks = [(await link.pick("m", cands, SlaClass.INTERACTIVE, 100, 16)).address
                 for cands in ([queued, full, free1, free2], [queued, full, free1], [queued, full])]
        await link.stop()
        return picks

    assert asyncio.run(main()) == ["free:2", "free:1", "queued:1"]


def test_the_gateway_routes_by_the_predictors_trees_evaluated_in_process():
    """The gateway fetches the trained TTFT trees and predicts each candidate itself: every pick among two workers is
    decided by a prediction, and still is once the predictor is gone (the trees are kept); a gateway that reports to
    the same predictor without --slo-routing (the default) picks by load; one worker is no choice and is not
    counted."""
    async def main():
        slo, _ = await trained_slo()
        workers = [await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4)) for _ in range(2)]
        addresses = [w.server.address for w in workers]
        gateway = await start_gateway(GatewayConfig(port=0, workers=addresses,
                                                    slo=SloSettings(slo.server.address, routing=True)))
        plain = await start_gateway(GatewayConfig(port=0, workers=addresses, slo=SloSettings(slo.server.address)))

        def routed(gw, by: str) -> float:
            return gw.metrics.registry.get_sample_value("cotserve_gateway_routed_total", {"model": "cotserve-demo", "by": by}) or 0.0
        try:
            deadline = time.monotonic() + 10
            while gateway.slo.ttft_model is None:
                assert time.monotonic() < deadline, "the gateway never fetched the latency model"
                await asyncio.sleep(0.05)
            assert gateway.slo.ttft_model_version == slo.state.latency_version > 0
            async with AsyncClient(gateway.server.address) as client, AsyncClient(plain.server.address) as other:
                for i in range(4):
                    assert (await client.generate(f"{i}+1=", max_new_tokens=4)).text
                    assert (await other.generate(f"{i}+1=", max_new_tokens=4)).text
                assert (routed(gateway, "predicted_ttft"), routed(gateway, "load")) == (4, 0)
                assert (routed(plain, "predicted_ttft"), routed(plain, "load")) == (0, 4)
                await slo.stop()
                for i in range(3):
                    assert (await client.generate(f"{i}+2=", max_new_tokens=4)).text
                assert (routed(gateway, "predicted_ttft"), routed(gateway, "load")) == (7, 0)  # no call per request
                await workers[1].stop()
                deadline = time.monotonic() + 10
                while sum(w.healthy for w in gateway.pool.workers) > 1:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
                assert (await client.generate("5+5=", max_new_tokens=4)).text
                assert (routed(gateway, "predicted_ttft"), routed(gateway, "load")) == (7, 0)
        finally:
            await gateway.stop()
            await plain.stop()
            for w in workers:
                await w.stop()
            await slo.stop()

    asyncio.run(main())


def test_the_fetched_trees_predict_what_the_predictor_would_and_are_refetched_only_when_retrained():
    async def main():
        slo, windows = await trained_slo()
        busy = worker_total([max(windows, key=lambda w: w.queue_depth)], "busy:1")
        idle = worker_total([min(windows, key=lambda w: w.queue_depth)], "idle:1")
        link = SloLink(SloSettings(slo.server.address, routing=True), SimpleNamespace(workers=[]))
        link.recorder.last_worker_window = {"busy:1": busy, "idle:1": idle}
        cands = [handle("busy:1", busy), handle("idle:1", idle)]
        try:
            await link.fetch_model()
            version = link.ttft_model_version
            assert link.ttft_model is not None and version == slo.state.latency_version
            states = [slo_pb2.WorkerState(worker=c.address, window=link.state_now(c, SlaClass.INTERACTIVE)) for c in cands]
            theirs = slo.state.predict_latency(slo_pb2.PredictLatencyRequest(
                prompt_tokens=round(200 * link.recorder.tokens_per_byte_of("m")), max_new_tokens=64, sla_class=I, candidates=states))
            ours = [predicted_ttft_ms(link.ttft_model, latency_row(round(200 * link.recorder.tokens_per_byte_of("m")), 64, I, s.window))
                    for s in states]
            assert ours == pytest.approx([p.ttft_p90_ms for p in theirs.predictions], rel=1e-4)
            assert ours[0] > ours[1]
            assert (await link.pick("m", cands, SlaClass.INTERACTIVE, 200, 64)).address == "idle:1"
            assert not slo.state.latency_model(version).ttft_model_json  # current: only the version comes back
            assert slo.state.latency_model(0).ttft_model_json
            slo.state.windows_since_fit = slo.state.cfg.min_new_windows
            assert await slo.state.maybe_retrain()
            assert slo.state.latency_version > version
            await link.fetch_model()
            assert link.ttft_model_version == slo.state.latency_version
            # a predictor whose trees predict something else (an older build's milliseconds) is not used: the trees
            # times this build's estimate would be nonsense
            serve = slo.state.latency_model
            slo.state.latency_model = lambda known: slo_pb2.GetLatencyModelResponse(
                is_trained=True, version=known + 1, features=LATENCY_FEATURES, ttft_model_json=serve(0).ttft_model_json)
            await link.fetch_model()
            assert link.ttft_model is None and link.ttft_model_version == 0
            slo.state.latency_model = serve
            await link.fetch_model()
            assert link.ttft_model is not None
            await slo.stop()
            await link.fetch_model()  # the predictor is gone: the trees are kept
            assert link.ttft_model is not None
            assert (await link.pick("m", cands[::-1], SlaClass.INTERACTIVE, 200, 64)).address == "idle:1"
        finally:
            await link.stop()
            await slo.stop()

    asyncio.run(main())


def test_deferred_share_rises_from_the_throttle_point_to_all_at_the_threshold():
    assert deferred_share(0.2, 0.7, 0.5) == 0.0 and deferred_share(0.35, 0.7, 0.5) == 0.0
    assert deferred_share(0.525, 0.7, 0.5) == pytest.approx(0.5) and deferred_share(0.7, 0.7, 0.5) == 1.0
    assert deferred_share(0.69, 0.7, 1.0) == 0.0 and deferred_share(0.71, 0.7, 1.0) == 1.0  # 1: all or nothing


async def held_by(rule: BatchHold, model: str, time_remaining_s: float | None) -> tuple[float, str | None]:
    """A BATCH request of `model` through the hold rule, as the chain runs it: (ms held, why; None when not held)."""
    ctx = RequestContext(SimpleNamespace(time_remaining=lambda: time_remaining_s), None, model=model, sla=SlaClass.BATCH,
                         span=trace.INVALID_SPAN)
    await Chain([rule]).admit(Stage.REQUEST, ctx)
    return ctx.held_ms, ctx.state["hold"]["why"]


def test_held_batch_goes_in_a_trickle_as_the_forecast_falls_and_a_full_hold_turns_requests_away():
    async def main():
        link = SloLink(SloSettings("127.0.0.1:1", admission=True, retry_after_ms=10_000, throttle_from=0.5, max_held=200),
                       SimpleNamespace(workers=[], models=dict))
        rule = BatchHold(link, GatewayMetrics(SimpleNamespace(workers=[])), random.Random(7))
        hold = functools.partial(held_by, rule)
        link.recorder.arrival("m", "w", SlaClass.INTERACTIVE)  # urgent work in flight: there is something to protect
        link.forecasts["m"] = (0.9, 0.7, time.monotonic())  # over the threshold: every BATCH request held
        tasks = [asyncio.create_task(hold("m", None)) for _ in range(200)]
        await asyncio.sleep(0.05)
        assert rule.held == 200 and not any(t.done() for t in tasks)
        with pytest.raises(errors.ResourceExhausted) as err:  # the hold is full: turned away, retry-after jittered
            await hold("m", None)
        assert 5_000 <= int(err.value.trailers["retry-after-ms"]) <= 15_000
        assert "200 BATCH requests are already held" in str(err.value)
        link.forecasts["m"] = (0.525, 0.7, time.monotonic())  # half way from 0.35 to the threshold: half stay each refresh
        await rule.on_refresh()
        await asyncio.sleep(0.05)
        assert 70 < sum(t.done() for t in tasks) < 130 and rule.held == 200 - sum(t.done() for t in tasks)
        link.forecasts["m"] = (0.3, 0.7, time.monotonic())  # below the throttle point: all go
        await rule.on_refresh()
        results = await asyncio.gather(*tasks)
        assert rule.held == 0 and all(why is not None and "% of BATCH held" in why for _, why in results)
        assert await hold("m", None) == (pytest.approx(0, abs=5), None)  # not held now
        link.forecasts["m"] = (0.9, 0.7, time.monotonic() - 60)  # stale: nothing held on an old forecast
        assert (await hold("m", None))[1] is None
        link.forecasts["m"] = (0.9, 0.7, time.monotonic())
        ms, why = await hold("m", 1.2)  # a deadline 1.2 s away: it goes a second before it
        assert why is not None and 150 <= ms <= 1000
        held = [asyncio.create_task(hold("m", None)) for _ in range(20)]
        await asyncio.sleep(0.05)
        assert rule.held == 20
        link.settings.urgent_idle_s = 0.2
        link.recorder.done("m", "w", SlaClass.INTERACTIVE)  # the last urgent request ends: the forecast alone holds nothing
        await rule.on_refresh()
        await asyncio.sleep(0.05)
        assert rule.held == 20  # not idle for urgent_idle_s yet
        await asyncio.sleep(0.2)
        await rule.on_refresh()  # the next refresh (the forecast still 0.9) lets them all go
        assert all(0.2 <= ms / 1000 < 0.5 and why is not None for ms, why in await asyncio.gather(*held))
        assert rule.held == 0 and (await hold("m", None))[1] is None
        link.recorder.arrival("m", "w", SlaClass.REALTIME)  # and a new urgent request makes the forecast count again
        held = asyncio.create_task(hold("m", None))
        await asyncio.sleep(0.05)
        assert rule.held == 1 and not held.done()
        link.settings.admission = False
        await rule.on_refresh()
        assert (await held)[1] is not None and (await hold("m", None))[1] is None
        await link.stop()

    asyncio.run(main())


def test_a_forecast_that_holds_batch_also_restrains_the_workers_batch_ceiling():
    """Holding BATCH arrivals on the forecast, the rule keeps its workers' admission at the restart ceiling too (what
    is queued there starts 4 at a time, not 64): only while a share is deferred and urgent work is not idle, and only
    with the hold on."""
    from cotserve.gateway.admission import Admission, AdmissionConfig

    async def main():
        w = SimpleNamespace(admission=Admission(AdmissionConfig(batch_limit=64, batch_restart_limit=4)))
        link = SloLink(SloSettings("127.0.0.1:1", admission=True, throttle_from=0.5),
                       SimpleNamespace(workers=[w], models=lambda: {"m": [w]}))
        rule = BatchHold(link, GatewayMetrics(SimpleNamespace(workers=[])))
        ceilings = []
        for forecast, urgent in ((0.6, False), (0.3, True), (0.6, True)):  # urgent idle; below 0.35; held
            if urgent:
                link.recorder.arrival("m", "w", SlaClass.INTERACTIVE)
            link.forecasts["m"] = (forecast, 0.7, time.monotonic())
            await rule.on_refresh()
            ceilings.append(w.admission.limit[SlaClass.BATCH])
        link.settings.admission = False
        w.admission.limit[SlaClass.BATCH] = 64
        await rule.on_refresh()
        ceilings.append(w.admission.limit[SlaClass.BATCH])
        await link.stop()
        return ceilings

    assert asyncio.run(main()) == [64, 64, 4, 64]


@contextlib.asynccontextmanager
async def reporting_stack(max_num_seqs: int):
    """A predictor (no retraining), a worker of `max_num_seqs` seats and a gateway reporting to the predictor; yields
    (gateway, exported): `await exported(since_ms)` waits for the next window's report and gives the request
    observations the predictor has from `since_ms` on."""
    slo = await start_slo(SloConfig(port=0, state_dir=None, retrain_interval_s=3600, advice_interval_s=3600))
    worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=max_num_seqs))
    gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], slo=SloSettings(slo.server.address)))

    async def exported(since_ms: int) -> list:
        await asyncio.sleep(2.5)  # reported with the next window
        async with grpc.aio.insecure_channel(slo.server.address) as ch:
            answer = await slo_pb2_grpc.SloServiceStub(ch).ExportWindows(slo_pb2.ExportWindowsRequest(since_unix_ms=since_ms))
        return list(answer.requests)

    try:
        yield gateway, exported
    finally:
        await gateway.stop()
        await worker.stop()
        await slo.stop()


def test_each_request_reports_its_place_in_the_prefill_line_and_the_line_empties():
    """Requests sent together: each observation carries the requests (and their prompt tokens) that the gateway had
    sent the worker before it without a first token yet; when they are done the worker's line is empty again."""
    async def main():
        async with reporting_stack(8) as (gateway, exported):
            async with AsyncClient(gateway.server.address) as client:
                started = int(time.time() * 1000)
                await asyncio.gather(*(client.generate("12+34-5=" * 8, max_new_tokens=4, sla="interactive") for _ in range(4)))
                (handle,) = gateway.pool.workers
                assert handle.waiting_for_first_token == 0 and handle.prefill_tokens_ahead == 0 and handle.in_flight == 0
            obs = sorted(await exported(started - 1000), key=lambda r: r.waiting_for_first_token_at_start)
            assert len(obs) == 4 and obs[0].waiting_for_first_token_at_start == 0 and obs[0].prefill_tokens_ahead_at_start == 0
            later = [r for r in obs if r.waiting_for_first_token_at_start > 0]
            assert later, "all four were sent after the one before had its first token"
            # prompt tokens ahead are estimated from bytes (64 bytes at 0.25 tokens a byte before any request finished)
            assert all(r.prefill_tokens_ahead_at_start == 16 * r.waiting_for_first_token_at_start for r in later)
            # and how long the oldest of those had waited (none waiting: 0); the worker was in the middle of them
            assert obs[0].oldest_wait_ms_at_start == 0 and all(r.oldest_wait_ms_at_start > 0 for r in later)

    asyncio.run(main())


def test_the_counts_say_how_long_the_oldest_request_has_waited_and_how_long_the_worker_has_been_silent():
    """`counts_now` (what routing rows and request observations carry): the age of the oldest request sent to the
    worker without a first token, and the time since anything was read from the worker while requests are in
    flight there; a send to an idle worker starts the silence, a first token moves the oldest on, and an idle
    worker is neither waited on nor silent."""
    from opentelemetry.trace import INVALID_SPAN

    from cotserve.gateway.metrics import GatewayMetrics
    from cotserve.gateway.observer import AttemptObserver
    from cotserve.gateway.pool import WorkerHandle, WorkerPool
    from cotserve.gateway.slo_link import counts_now
    from cotserve.worker.v1 import worker_pb2

    worker = WorkerHandle("w", None, None)
    worker.last_heard = time.monotonic() - 60  # a minute-old chunk of an earlier request: not a silence now
    metrics = GatewayMetrics(WorkerPool([]))
    I = SlaClass.INTERACTIVE

    def attempt() -> AttemptObserver:
        a = AttemptObserver(metrics, None, INVALID_SPAN, "m", I, worker, time.monotonic(), 64, 16)
        a.sent(0.0)
        return a

    first = attempt()
    time.sleep(0.2)
    second = attempt()
    time.sleep(0.1)
    now = counts_now(worker, I)
    assert now.waiting_for_first_token == 2 and 300 <= now.oldest_wait_ms < 1000 and 300 <= now.silent_ms < 1000
    first.chunk(worker_pb2.GenerateResponse(token_ids=[1]), None, time.monotonic())  # its first token
    now = counts_now(worker, I)
    assert now.waiting_for_first_token == 1 and 100 <= now.oldest_wait_ms < 300 and now.silent_ms < 100
    second.chunk(worker_pb2.GenerateResponse(token_ids=[1]), None, time.monotonic())
    time.sleep(0.15)
    now = counts_now(worker, I)
    assert (now.waiting_for_first_token, now.oldest_wait_ms) == (0, 0.0) and 150 <= now.silent_ms < 1000
    first.done()
    second.done()
    assert (counts_now(worker, I).oldest_wait_ms, counts_now(worker, I).silent_ms) == (0.0, 0.0) and not worker.waiting_since


def test_a_new_request_waits_on_the_decode_left_of_whoever_frees_its_seat():
    """`seat_wait_tokens` (routing rows and request observations carry it): when this gateway's requests fill the
    worker's seats, a new one waits for the k-th of its seat line to finish (k beyond the seats, counting itself), and
    this is that one's tokens left to its max_new_tokens, fewest first among those with a first token; a less urgent
    class is not in a more urgent one's line (it gives up its seat); a request of several samples holds a seat for
    each; a free seat or unknown seats: 0. The attempts are real AttemptObservers fed real chunks."""
    from opentelemetry.trace import INVALID_SPAN

    from cotserve.gateway.metrics import GatewayMetrics
    from cotserve.gateway.observer import AttemptObserver
    from cotserve.gateway.pool import WorkerHandle, WorkerPool
    from cotserve.gateway.slo_link import counts_now, seat_wait_tokens
    from cotserve.worker.v1 import worker_pb2

    worker = WorkerHandle("w", None, None, info=worker_pb2.InfoResponse(max_num_seqs=2))
    metrics = GatewayMetrics(WorkerPool([]))
    I, B = SlaClass.INTERACTIVE, SlaClass.BATCH

    def attempt(sla: SlaClass, max_new: int, tokens: list[int], samples: int = 1) -> AttemptObserver:
        a = AttemptObserver(metrics, None, INVALID_SPAN, "m", sla, worker, time.monotonic(), 64, max_new, samples=samples)
        a.sent(0.0)
        for n in tokens:  # chunks of the first sample: n tokens each
            a.chunk(worker_pb2.GenerateResponse(token_ids=list(range(n))), None, time.monotonic())
        return a

    one = attempt(I, 16, [1, 9])  # 10 read, 6 left
    assert seat_wait_tokens(worker, I) == 0  # a seat is free
    two = attempt(I, 16, [3])  # 13 left
    assert worker.in_flight == 2 and seat_wait_tokens(worker, I) == 6 and counts_now(worker, I).seat_wait_tokens == 6
    three = attempt(I, 16, [])  # no first token: holds a place in line, frees nothing it can be asked about
    assert seat_wait_tokens(worker, I) == 13  # behind one more: the second to finish
    batch = attempt(B, 32, [1])  # 31 left
    assert seat_wait_tokens(worker, I) == 13  # BATCH gives INTERACTIVE its seat: not in its line
    assert seat_wait_tokens(worker, B) == 31  # BATCH waits behind everyone: the third to finish of 6, 13, 31
    one.chunk(worker_pb2.GenerateResponse(token_ids=[1, 2, 3, 4]), None, time.monotonic())  # 2 left
    assert seat_wait_tokens(worker, B) == 31 and seat_wait_tokens(worker, I) == 13
    two.done()
    assert worker.in_flight == 3 and seat_wait_tokens(worker, I) == 2  # one ahead beyond the seats: the soonest
    group = attempt(I, 16, [5], samples=3)  # three samples of 11 tokens left: three seats
    # INTERACTIVE's line holds five seats of two (one: 2 left, three: no first token, group: 11 x 3): the new one waits
    # for the fourth to finish of 2, 11, 11, 11; BATCH's holds six, the fifth of 2, 11, 11, 11, 31
    assert seat_wait_tokens(worker, I) == 11 and seat_wait_tokens(worker, B) == 31
    worker.info = None  # seats unknown
    assert seat_wait_tokens(worker, I) == 0
    for a in (one, three, batch, group):
        a.done()
    assert worker.in_flight == 0 and not worker.attempts and not worker.waiting_since


def test_a_request_takes_a_seat_for_each_of_its_samples():
    """What the relay tells an attempt's observer it holds on the worker: self-consistency's max_samples, else n."""
    from cotserve.gateway.relay import samples_of
    from cotserve.worker.v1 import worker_pb2

    assert samples_of(worker_pb2.GenerateRequest()) == 1
    assert samples_of(worker_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(n=3))) == 3
    voted = worker_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(n=1))
    voted.reasoning.self_consistency.max_samples = 5
    assert samples_of(voted) == 5


def test_a_request_sent_when_the_seats_are_taken_reports_the_decode_it_waits_on():
    """A real gateway and a two-seat worker: two long requests take the seats; one sent once both stream reports
    tokens left of theirs (between 1 and their 192), and the two before it report none (seats were free)."""
    async def main():
        async with reporting_stack(2) as (gateway, exported):
            async with AsyncClient(gateway.server.address) as client:
                started = int(time.time() * 1000)
                streams = [client.stream("12+34-5=" * 8, max_new_tokens=192, ignore_eos=True, sla="interactive")
                           for _ in range(2)]
                firsts = [await s.__anext__() for s in streams]  # both have a first token: they hold the seats
                assert all(f.token_ids for f in firsts)
                await client.generate("1+1=", max_new_tokens=2, sla="interactive")
                for s in streams:
                    async for _ in s:
                        pass
            obs: dict[int, list[float]] = {}
            for r in await exported(started - 1000):
                obs.setdefault(r.max_new_tokens, []).append(r.seat_wait_tokens_at_start)
            assert obs[192] == [0, 0] and len(obs[2]) == 1 and 1 <= obs[2][0] < 192

    asyncio.run(main())


def test_a_request_that_queued_in_the_gateway_reports_the_state_its_worker_was_chosen_in():
    """The latency model learns from what a routing decision sees: the counts when the gateway chose the worker, not
    when the request left the gateway's queue (by then the requests it waited behind had finished, and the wait was in
    its TTFT with nothing in its features to explain it). One BATCH request at a time per worker: the second and third
    wait behind the first; an INTERACTIVE request sent while they wait has them in the gateway's queue but none
    ahead of it (BATCH starts only when no INTERACTIVE waits)."""
    async def main():
        slo = await start_slo(SloConfig(port=0, state_dir=None, retrain_interval_s=3600, advice_interval_s=3600))
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=8))
        gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], slo=SloSettings(slo.server.address),
                                                    admission=AdmissionConfig(batch_limit=1)))
        try:
            async with AsyncClient(gateway.server.address) as client:
                started = int(time.time() * 1000)
                batch = [asyncio.create_task(client.generate("12+34-5=", max_new_tokens=48, ignore_eos=True, sla="batch"))
                         for _ in range(3)]
                (handle,) = gateway.pool.workers
                deadline = time.monotonic() + 10
                while len(handle.admission.queues[SlaClass.BATCH]) < 2:
                    assert time.monotonic() < deadline, "the second and third BATCH requests never queued"
                    await asyncio.sleep(0.001)
                await client.generate("1+1=", max_new_tokens=2, sla="interactive")
                await asyncio.gather(*batch)
                await asyncio.sleep(2.5)  # reported with the next window
                async with grpc.aio.insecure_channel(slo.server.address) as ch:
                    exported = await slo_pb2_grpc.SloServiceStub(ch).ExportWindows(slo_pb2.ExportWindowsRequest(since_unix_ms=started - 1000))
            (urgent,) = [r for r in exported.requests if r.sla_class == common_pb2.SLA_CLASS_INTERACTIVE]
            assert (urgent.in_flight_at_start, urgent.queued_at_start, urgent.queued_ahead_at_start) == (1, 2, 0)
            obs = sorted((r for r in exported.requests if r.sla_class == common_pb2.SLA_CLASS_BATCH), key=lambda r: r.ttft_ms)
            assert [(r.in_flight_at_start, r.queued_at_start, r.queued_ahead_at_start) for r in obs] == [
                (0, 0, 0), (1, 0, 0), (1, 1, 1)]
            # it waited for the others' tokens: at least the first's whole stream (its TTFT and 47 more tokens)
            assert obs[2].ttft_ms > obs[0].ttft_ms + 47 * obs[0].tpot_ms
            assert max(r.start_unix_ms for r in obs) - min(r.start_unix_ms for r in obs) < obs[2].ttft_ms
        finally:
            await gateway.stop()
            await worker.stop()
            await slo.stop()

    asyncio.run(main())


def test_a_forecast_miss_pauses_running_batch_on_the_models_workers_for_a_renewed_lease_and_no_longer():
    """`steer_pauses` after each refresh, against a real worker over gRPC: paused while the forecast is over the
    threshold and urgent work is in flight, for a lease of three refresh intervals renewed each time; ended at once
    when the forecast falls or urgent traffic goes idle; after max_pause_ms, half as long unpaused; a worker that
    cannot be reached is counted and warned about, nothing raised."""
    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4))
        sched = worker.engine.scheduler
        dead_addr = f"127.0.0.1:{free_port()}"
        async with grpc.aio.insecure_channel(worker.server.address) as ch, grpc.aio.insecure_channel(dead_addr) as dead_ch:
            from cotserve.worker.v1 import worker_pb2_grpc
            live = SimpleNamespace(address=worker.server.address, healthy=True, stub=worker_pb2_grpc.WorkerServiceStub(ch))
            dead = SimpleNamespace(address=dead_addr, healthy=True, stub=worker_pb2_grpc.WorkerServiceStub(dead_ch))
            down = SimpleNamespace(address="127.0.0.1:2", healthy=False, stub=None)  # not asked at all
            link = SloLink(SloSettings("127.0.0.1:1", pause_batch=True, max_pause_ms=2000, forecast_interval_s=1.0),
                           SimpleNamespace(models=lambda: {"m": [live, dead, down]}))
            pauses = BatchPauses(link)

            async def settled() -> float:  # the engine thread applies the pause between steps
                await asyncio.sleep(0.1)
                return sched.batch_paused_until - time.monotonic()

            link.recorder.arrival("m", live.address, SlaClass.INTERACTIVE)
            link.forecasts["m"] = (0.6, 0.7, time.monotonic())  # under the threshold: no pause
            await pauses.steer_pauses()
            assert await settled() < 0 and pauses.pauses_asked == 0 and pauses.pause_failures == 0
            link.forecasts["m"] = (0.8, 0.7, time.monotonic())
            await pauses.steer_pauses()
            assert 2.7 < await settled() <= 3.0  # a 3 s lease
            assert pauses.pauses_asked == 1 and pauses.pause_failures == 1  # the dead worker: counted, not raised
            await asyncio.sleep(0.5)
            await pauses.steer_pauses()  # renewed: 3 s from now again
            assert 2.7 < await settled() <= 3.0 and pauses.pauses_asked == 2
            link.forecasts["m"] = (0.5, 0.7, time.monotonic())  # the risk passed: ended now, not at the lease's end
            await pauses.steer_pauses()
            assert sched.batch_paused_until == 0.0 or await settled() < 0
            assert "m" not in pauses.pausing_since
            link.forecasts["m"] = (0.9, 0.7, time.monotonic())
            await pauses.steer_pauses()
            assert await settled() > 2
            pauses.pausing_since["m"] -= 2.0  # paused max_pause_ms (2 s) already: it ends and rests 1 s
            await pauses.steer_pauses()
            assert await settled() < 0 and pauses.pause_rest_until["m"] > time.monotonic() + 0.5
            await pauses.steer_pauses()
            assert await settled() < 0  # still resting
            pauses.pause_rest_until["m"] = 0.0
            link.settings.urgent_idle_s = 0.0
            link.recorder.done("m", live.address, SlaClass.INTERACTIVE)  # nothing urgent in flight: nothing to protect
            await pauses.steer_pauses()
            assert await settled() < 0
            link.recorder.arrival("m", live.address, SlaClass.REALTIME)
            await pauses.steer_pauses()
            assert await settled() > 2
        await link.stop()
        await worker.stop()

    asyncio.run(main())


def test_a_linked_gateway_sheds_and_pauses_by_default_its_flags_reach_the_link_and_a_bad_max_pause_names_the_range():
    with pytest.raises(ValueError, match=r"slo_max_pause_ms: 500, allowed 1000\.\.60000"):
        GatewayConfig(workers=["127.0.0.1:1"], slo=SloSettings(max_pause_ms=500)).validate()

    async def main():
        gateway = await start_gateway(GatewayConfig(port=0, workers=["127.0.0.1:1"],
                                                    slo=SloSettings("127.0.0.1:2", max_pause_ms=1500)))
        try:  # shedding and pausing are on with the predictor linked; holding BATCH arrivals is opt-in
            settings = gateway.slo.settings
            assert settings.pause_batch and settings.max_pause_ms == 1500 and settings.shed_over == 0.8
            assert not settings.admission
            assert [type(r).__name__ for r in gateway.servicer.relay.chain.rules] == [
                "Authenticate", "Grant", "PreProcess", "BatchHold", "InteractiveShed", "WorkerAdmission"]
            assert [type(f.__self__).__name__ for f in gateway.slo.on_refresh] == ["BatchHold", "BatchPauses"]
        finally:
            await gateway.stop()
        gateway = await start_gateway(GatewayConfig(port=0, workers=["127.0.0.1:1"],
                                                    slo=SloSettings("127.0.0.1:2", pause_batch=False, shed_over=0.0)))
        try:
            assert not gateway.slo.settings.pause_batch and gateway.slo.settings.shed_over == 0.0
            assert [type(f.__self__).__name__ for f in gateway.slo.on_refresh] == ["BatchHold"]
        finally:
            await gateway.stop()

    asyncio.run(main())


def waiting_handle(address: str, window: common_pb2.MetricsWindow, can_start: bool):
    """`handle`, where a new INTERACTIVE request can start at once or not (its class's in-flight limit reached)."""
    w = handle(address, window)
    w.admission.can_start = lambda cls: can_start
    w.admission.starts_now = lambda cls: can_start and not window.queue_depth
    return w


async def shed_by(rule: InteractiveShed, worker, sla: SlaClass, prompt_bytes: int, max_new_tokens: int) -> None:
    """A first attempt of a request of `sla` on `worker` through the shed rule, as the chain runs it (raises its
    refusal)."""
    ctx = RequestContext(SimpleNamespace(time_remaining=lambda: None), None, model="m", sla=sla, worker=worker,
                         prompt_bytes=prompt_bytes, max_new_tokens=max_new_tokens, span=trace.INVALID_SPAN)
    await Chain([rule]).admit(Stage.WORKER, ctx)


def test_an_interactive_request_that_would_queue_predicted_over_the_line_is_turned_away_and_nothing_else_is():
    """--slo-shed-over: the fetched trees' TTFT p90 for the picked worker against shed_over x INTERACTIVE's target, for
    a request that would queue in the gateway, while the model's forecast is at or over its threshold. With the line
    between the idle and the busy worker's predictions, one for the busy worker is turned away (RESOURCE_EXHAUSTED
    naming the prediction, the factor and the target; retry-after the predicted p90), one for the idle worker is not;
    nor one for the busy worker that would start at once, nor BATCH or REALTIME, nor anything with the rule off,
    without trees, or with the forecast under its threshold, stale or missing."""
    async def main():
        slo, windows = await trained_slo()
        busy = worker_total([max(windows, key=lambda w: w.queue_depth)], "busy:1")
        idle = worker_total([min(windows, key=lambda w: w.queue_depth)], "idle:1")
        busy_w, idle_w = handle("busy:1", busy), waiting_handle("idle:1", idle, can_start=False)
        probe = SloLink(SloSettings(slo.server.address), SimpleNamespace(workers=[]))
        links = []
        try:
            await probe.fetch_model()
            probe.recorder.last_worker_window = {"busy:1": busy, "idle:1": idle}
            tokens = probe.prompt_tokens_of("m", 200)

            def p90(w) -> float:
                return predicted_ttft_ms(probe.ttft_model, latency_row(tokens, 64, I, probe.state_now(w, SlaClass.INTERACTIVE)))
            p_busy, p_idle = p90(busy_w), p90(idle_w)
            assert p_busy > 2 * p_idle
            target = (p_busy * p_idle) ** 0.5 / 2  # shed_over 2: the line at twice this, between the two
            targets = sla_targets([f"interactive={target}/100"])

            def link_with(shed_over: float) -> InteractiveShed:
                link = SloLink(SloSettings(slo.server.address, shed_over=shed_over), SimpleNamespace(workers=[]))
                link.recorder.last_worker_window, link.ttft_model = probe.recorder.last_worker_window, probe.ttft_model
                link.forecasts["m"] = (0.8, 0.7, time.monotonic())  # a miss forecast: shedding may act
                links.append(link)
                return InteractiveShed(link, targets, GatewayMetrics(SimpleNamespace(workers=[])))

            link = link_with(2.0)
            with pytest.raises(errors.ResourceExhausted) as caught:
                await shed_by(link, busy_w, SlaClass.INTERACTIVE, 200, 64)
            assert (f"sla_class INTERACTIVE: shed: the SLO predictor puts this request's TTFT p90 on worker busy:1 at "
                    f"{p_busy:.0f} ms, over 2 x the class's {target:.0f} ms target") in str(caught.value)
            assert caught.value.trailers == {"retry-after-ms": str(round(p_busy))}
            await shed_by(link, idle_w, SlaClass.INTERACTIVE, 200, 64)
            assert busy.queue_depth and not idle.queue_depth  # busy_w would queue behind its window's queue
            low = link_with(2.0)
            low.targets = sla_targets([f"interactive={p_idle / 4}/100"])  # the idle worker's prediction over the line
            with pytest.raises(errors.ResourceExhausted):
                await shed_by(low, idle_w, SlaClass.INTERACTIVE, 200, 64)
            await shed_by(low, waiting_handle("idle:1", idle, can_start=True), SlaClass.INTERACTIVE, 200, 64)  # would not queue
            for sla in (SlaClass.BATCH, SlaClass.REALTIME):
                await shed_by(link, busy_w, sla, 200, 64)
            assert link.shed_total == 1
            await shed_by(link_with(0.0), busy_w, SlaClass.INTERACTIVE, 200, 64)
            untrained = link_with(2.0)
            untrained.link.ttft_model = None
            await shed_by(untrained, busy_w, SlaClass.INTERACTIVE, 200, 64)
            calm = link_with(2.0)  # the same request as the one turned away above, under other forecasts
            for forecast in ((0.69, 0.7, time.monotonic()), (0.9, 0.7, time.monotonic() - 60), None):
                if forecast is None:
                    del calm.link.forecasts["m"]
                else:
                    calm.link.forecasts["m"] = forecast
                await shed_by(calm, busy_w, SlaClass.INTERACTIVE, 200, 64)
            calm.link.forecasts["m"] = (0.7, 0.7, time.monotonic())  # at the threshold: turned away
            with pytest.raises(errors.ResourceExhausted):
                await shed_by(calm, busy_w, SlaClass.INTERACTIVE, 200, 64)
        finally:
            for link in (probe, *links):
                await link.stop()
            await slo.stop()

    asyncio.run(main())


def test_a_gateway_shedding_over_the_target_turns_away_interactive_that_would_queue_and_nothing_else():
    """End to end through a real predictor, worker and gateway, INTERACTIVE's target a microsecond (every prediction
    over it), a miss forecast (the one stand-in: this quiet stack's own forecast is low) and one INTERACTIVE request
    in flight at a time: while a long stream holds the one place, a second
    INTERACTIVE request gets RESOURCE_EXHAUSTED with a retry-after at the client and reaches no worker; BATCH (never
    shed) is served, and so is INTERACTIVE once the place is free (it would not queue). A bad factor names its range."""
    with pytest.raises(ValueError, match=r"slo_shed_over: 0\.1, allowed 0 \(off\) or 0\.25\.\.100"):
        GatewayConfig(workers=["127.0.0.1:1"], slo=SloSettings(shed_over=0.1)).validate()

    async def main():
        slo, _ = await trained_slo()
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4))
        gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address],
                                                    slo=SloSettings(slo.server.address, shed_over=1.0),
                                                    sla_target=("interactive=0.001/100",)))
        admission = gateway.pool.workers[0].admission
        admission.config.interactive_max_limit, admission.limit[SlaClass.INTERACTIVE] = 1, 1
        try:
            deadline = time.monotonic() + 10
            while gateway.slo.ttft_model is None:  # fetched for shedding, though routing is off
                assert time.monotonic() < deadline, "the gateway never fetched the latency model"
                await asyncio.sleep(0.05)
            gateway.slo.fresh_forecast = lambda model, now: (0.9, 0.7)
            async with AsyncClient(gateway.server.address) as client:
                long = client.stream("1+1=", max_new_tokens=200, ignore_eos=True, sla="interactive")
                first = await long.__anext__()
                assert first.token_ids
                with pytest.raises(SdkResourceExhausted) as caught:
                    await client.generate("2+2=", max_new_tokens=4, sla="interactive")
                assert "sla_class INTERACTIVE: shed" in str(caught.value) and caught.value.retry_after_ms >= 1
                assert (await client.generate("3+3=", max_new_tokens=4, sla="batch")).text
                async for _ in long:
                    pass
                assert (await client.generate("4+4=", max_new_tokens=4, sla="interactive")).text
            assert rule_of(gateway, InteractiveShed).shed_total == 1
            assert gateway.metrics.registry.get_sample_value("cotserve_gateway_shed_total", {"model": "cotserve-demo"}) == 1
            deadline = time.monotonic() + 10  # the engine counts a request finished just after its last output
            while worker.engine.stats().num_requests_finished_total < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert worker.engine.stats().num_requests_finished_total == 3  # all but the one turned away
        finally:
            await gateway.stop()
            await worker.stop()
            await slo.stop()

    asyncio.run(main())
