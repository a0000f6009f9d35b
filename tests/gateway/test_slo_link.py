"""The gateway with the SLO predictor: windows and request observations arrive; BATCH is deferred
while an urgent forecast is above the threshold; routing follows predicted TTFT; and when the
predictor is down or slow, nothing fails."""

# In-process workers here run their engine as a thread (engine_process=False): these tests are about the gateway and the predictor, not
# the engine process boundary, which tests/worker/test_engine_process.py and every CLI-started worker cover;
# a second interpreter importing torch per worker would add about 2 s to each start.

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from cotserve.common.procs import free_port
from cotserve.common.sampling import SlaClass
from cotserve.common.v1 import common_pb2
from cotserve.gateway.server import GatewayConfig, start_gateway
from cotserve.gateway.slo_link import SloLink, SloLinkConfig
from cotserve.sdk import AsyncClient, ResourceExhausted
from cotserve.common.windows import worker_total
from cotserve.slo.server import SloConfig, start_slo
from cotserve.slo.v1 import slo_pb2, slo_pb2_grpc
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker
from tests.slo.synth import simulate

I, B = common_pb2.SLA_CLASS_INTERACTIVE, common_pb2.SLA_CLASS_BATCH


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
        gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], slo_address=slo.server.address))
        peak = max(windows, key=lambda w: w.queue_depth)
        stop = asyncio.Event()

        async def overload():  # another gateway's worker of the same model, deep in a queue build-up
            while not stop.is_set():
                w = slo_pb2.MetricsWindow()
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
                obs = [r for r in exported.requests if r.worker == worker.server.address]
                assert len(obs) == 5 and all(r.sla_class == I and r.prompt_tokens == 5 and r.max_new_tokens == 16 and r.ttft_ms > 0 for r in obs)

                assert (await client.generate("1+2=", max_new_tokens=8, sla="batch")).text  # forecast low: BATCH goes
                task = asyncio.create_task(overload())
                deadline = time.monotonic() + 15
                while gateway.slo.shed_batch("cotserve-demo") is None:
                    assert time.monotonic() < deadline, f"the forecast never passed the threshold: {gateway.slo.forecasts}"
                    await asyncio.sleep(0.2)
                with pytest.raises(ResourceExhausted) as err:
                    await client.generate("1+2=", max_new_tokens=8, sla="batch")
                assert "deferred: the SLO predictor forecasts" in err.value.message and err.value.retry_after_ms == 10_000
                assert (await client.generate("1+2=", max_new_tokens=8, sla="interactive")).text  # urgent work still goes
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
        gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], slo_address=dead))
        try:
            async with AsyncClient(gateway.server.address) as client:
                for sla in ("realtime", "interactive", "batch", "batch"):
                    r = await client.generate("37+48-12=", max_new_tokens=32, sla=sla)
                    assert r.text == "<think>37+48=85. 85-12=73.</think> 73"
                await asyncio.sleep(1.5)
            assert gateway.slo.reports_failed >= 1 and gateway.slo.shed_batch("cotserve-demo") is None
            assert len(gateway.slo.backlog) >= 1  # kept for when the predictor is back
        finally:
            await gateway.stop()
            await worker.stop()

    asyncio.run(main())


def handle(address: str, window: slo_pb2.MetricsWindow):
    return SimpleNamespace(address=address, in_flight=window.in_flight,
                           admission=SimpleNamespace(can_start=lambda cls: True, queues={SlaClass.INTERACTIVE: [None] * window.queue_depth}))


def test_routing_picks_the_lower_predicted_ttft_and_falls_back_within_its_budget():
    async def main():
        slo, windows = await trained_slo()
        busy = worker_total([max(windows, key=lambda w: w.queue_depth)], "busy:1")
        idle = worker_total([min(windows, key=lambda w: w.queue_depth)], "idle:1")
        link = SloLink(SloLinkConfig(slo.server.address, predict_budget_ms=1000), SimpleNamespace(workers=[]))
        link.last_worker_window = {"busy:1": busy, "idle:1": idle}
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
