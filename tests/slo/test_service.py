"""The SLO service over real gRPC: it trains on reported windows and serves Forecast and
PredictLatency; bad input is INVALID_ARGUMENT; advice reaches WatchAdvice, Redis and Prometheus;
history and models survive a restart."""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.request

import grpc
import pytest

from cotserve.common.latency import LATENCY_FEATURES, TTFT_TARGET, TreeEnsemble, latency_row, predicted_ttft_ms
from cotserve.common.procs import free_port
from cotserve.common.v1 import common_pb2
from cotserve.slo.features import FEATURES
from cotserve.slo.server import SloConfig, start_slo
from cotserve.slo.v1 import slo_pb2, slo_pb2_grpc
from tests.slo.synth import simulate

I = common_pb2.SLA_CLASS_INTERACTIVE


def recent_simulation(seconds: int):
    """The simulation, ending now (so the latest windows are fresh)."""
    now_s = int(time.time())
    return simulate(seconds, t0_ms=(now_s - seconds + 1) * 1000)


def test_trains_on_reported_windows_and_serves_forecasts_and_predictions(tmp_path, redis_url):
    windows, requests = recent_simulation(600)

    async def main():
        cfg = SloConfig(port=0, state_dir=tmp_path, retrain_interval_s=0.2, advice_interval_s=0.2, redis_url=redis_url,
                        metrics_port=free_port())
        running = await start_slo(cfg)
        import redis.asyncio as aioredis

        sub = aioredis.Redis.from_url(redis_url).pubsub()
        await sub.subscribe("cotserve:slo:advice")
        try:
            async with grpc.aio.insecure_channel(running.server.address) as ch:
                stub = slo_pb2_grpc.SloServiceStub(ch)
                before = await stub.Forecast(slo_pb2.ForecastRequest(model="m", sla_class=I))
                assert not before.is_trained and before.untrained_reason == "no history yet"
                model = await stub.GetLatencyModel(slo_pb2.GetLatencyModelRequest())
                assert not model.is_trained and model.untrained_reason == "no request observations yet" and not model.ttft_model_json
                for i in range(0, len(windows), 100):
                    resp = await stub.ReportWindows(slo_pb2.ReportWindowsRequest(
                        windows=windows[i:i + 100], requests=[r for r in requests if windows[i].start_unix_ms <= r.start_unix_ms
                                                              < windows[i].start_unix_ms + 100_000]))
                    assert resp.num_accepted == len(windows[i:i + 100])
                deadline = time.monotonic() + 60
                while not (running.state.forecaster.is_trained and running.state.latency.is_trained):
                    assert time.monotonic() < deadline, running.state.forecaster.untrained_reason
                    await asyncio.sleep(0.2)
                f = await stub.Forecast(slo_pb2.ForecastRequest(model="m", sla_class=I))
                assert f.is_trained and 0 <= f.violation_probability <= 1 and f.threshold == 0.7 and f.horizon_ms == 30_000
                assert len(f.top_features) == 5 and {c.feature for c in f.top_features} <= set(FEATURES)
                other = await stub.Forecast(slo_pb2.ForecastRequest(model="nobody", sla_class=I))
                assert not other.is_trained and "no windows from model 'nobody'" in other.untrained_reason

                busy, idle = common_pb2.MetricsWindow(worker="a"), common_pb2.MetricsWindow(worker="b")
                busy.CopyFrom(max(windows, key=lambda w: w.queue_depth))
                idle.CopyFrom(min(windows, key=lambda w: w.queue_depth))
                for w in (busy, idle):  # a candidate's queue ahead of the request, as a gateway fills it in
                    w.queued_ahead = w.queue_depth
                pred = await stub.PredictLatency(slo_pb2.PredictLatencyRequest(
                    prompt_tokens=64, max_new_tokens=64, sla_class=I,
                    candidates=[slo_pb2.WorkerState(worker="a", window=busy), slo_pb2.WorkerState(worker="b", window=idle)]))
                assert pred.is_trained and [p.worker for p in pred.predictions] == ["a", "b"]
                assert pred.predictions[0].ttft_ms > pred.predictions[1].ttft_ms > 0  # a queue means a later first token
                model = await stub.GetLatencyModel(slo_pb2.GetLatencyModelRequest())
                assert model.is_trained and model.version > 0 and list(model.features) == list(LATENCY_FEATURES)
                assert model.target == TTFT_TARGET
                trees = TreeEnsemble(model.ttft_model_json)  # the same predictions, made by the caller
                assert [predicted_ttft_ms(trees, latency_row(64, 64, I, w)) for w in (busy, idle)] == pytest.approx(
                    [p.ttft_p90_ms for p in pred.predictions], rel=1e-4)
                again = await stub.GetLatencyModel(slo_pb2.GetLatencyModelRequest(known_version=model.version))
                assert again.is_trained and again.version == model.version and not again.ttft_model_json

                for bad, message in (
                    (slo_pb2.ReportWindowsRequest(windows=[common_pb2.MetricsWindow(start_unix_ms=1, model="m", worker="w", sla_class=I,
                                                                                ttft_p99_ms=math.nan)]), "windows[0].ttft_p99_ms"),
                    (slo_pb2.ReportWindowsRequest(windows=[common_pb2.MetricsWindow(start_unix_ms=1, model="m", worker="w", sla_class=7)]),
                     "windows[0].sla_class"),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.ReportWindows(bad)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Forecast(slo_pb2.ForecastRequest(model="m", sla_class=I, horizon_ms=5000))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "horizon_ms" in err.value.details()

                advice_stream = stub.WatchAdvice(slo_pb2.WatchAdviceRequest(model="m"))
                advice = await asyncio.wait_for(advice_stream.read(), 10)
                assert advice.model == "m" and advice.current_replicas == 1
                assert advice.action in (slo_pb2.SCALE_ACTION_HOLD, slo_pb2.SCALE_ACTION_SCALE_UP, slo_pb2.SCALE_ACTION_SCALE_DOWN)
                advice_stream.cancel()
                msg = None
                while msg is None:
                    msg = await sub.get_message(ignore_subscribe_messages=True, timeout=5)
                published = json.loads(msg["data"])
                assert published["model"] == "m" and published["current_replicas"] == 1
                assert published["action"] in ("HOLD", "SCALE_UP", "SCALE_DOWN")
                # the gauges are set by the next advice round after training (every 0.2 s, later on a busy machine)
                url = f"http://127.0.0.1:{cfg.metrics_port}/metrics"
                deadline = time.monotonic() + 10
                while True:
                    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
                    if 'cotserve_slo_violation_probability{model="m",sla_class="INTERACTIVE"}' in text:
                        break
                    assert time.monotonic() < deadline, text
                    await asyncio.sleep(0.1)
                assert 'cotserve_slo_recommended_replicas{model="m"}' in text
        finally:
            await sub.aclose()
            await running.stop()

        again = await start_slo(SloConfig(port=0, state_dir=tmp_path))  # a restart keeps history and models
        try:
            assert len(again.state.history.windows) == len(windows)
            assert again.state.forecaster.is_trained and again.state.latency.is_trained
        finally:
            await again.stop()

    asyncio.run(main())


def test_scale_advice_rules():
    from cotserve.slo.server import SloState

    state = SloState(SloConfig(state_dir=None, scale_down_after_s=100))
    state.recent["m"].extend(common_pb2.MetricsWindow(start_unix_ms=1000, model="m", worker=w, sla_class=I) for w in ("a", "b"))
    state.forecast = lambda model, cls: slo_pb2.ForecastResponse(is_trained=True, violation_probability=p)  # type: ignore[method-assign]
    p = 0.9
    up = state.decide("m", now=0)
    assert (up.action, up.current, up.recommended) == (slo_pb2.SCALE_ACTION_SCALE_UP, 2, 3)
    p = 0.05
    assert state.decide("m", now=10).action == slo_pb2.SCALE_ACTION_HOLD   # low, but not for long yet
    down = state.decide("m", now=111)
    assert (down.action, down.recommended) == (slo_pb2.SCALE_ACTION_SCALE_DOWN, 1)
    assert state.decide("m", now=112).action == slo_pb2.SCALE_ACTION_HOLD  # one step per sustained stretch
    p = 0.5
    assert state.decide("m", now=300).action == slo_pb2.SCALE_ACTION_HOLD


def test_a_history_larger_than_a_grpc_message_is_exported_whole_in_pages():
    """600 s of a busy gateway's request observations were 6 MB: one page over gRPC's 4 MiB limit, and `bench slo`
    failed with RESOURCE_EXHAUSTED at the export. Pages are cut by size as well as by windows."""
    from cotserve.slo.history import export_all

    requests = [slo_pb2.RequestObservation(start_unix_ms=1_000_000 + i // 100, model="m", worker="127.0.0.1:50051",
                                           sla_class=I, prompt_tokens=64, max_new_tokens=32, completion_tokens=32,
                                           ttft_ms=12.5 + i % 7, tpot_ms=3.25, in_flight_at_start=i % 40)
                for i in range(120_000)]
    assert sum(r.ByteSize() for r in requests) > 4 << 20

    async def main():
        running = await start_slo(SloConfig(port=0, state_dir=None, retrain_interval_s=3600, advice_interval_s=3600))
        try:
            running.state.history.add([], requests)
            with grpc.insecure_channel(running.server.address) as ch:
                windows, got, since = await asyncio.to_thread(export_all, slo_pb2_grpc.SloServiceStub(ch))
            assert windows == [] and got == requests and since == requests[-1].start_unix_ms + 1
        finally:
            await running.stop()

    asyncio.run(main())
