"""The telemetry service over real gRPC: spans exported by the real OTel SDK from a real gateway and
worker become heatmap cells whose counts and quantiles match the spans themselves; malformed OTLP is
counted and skipped; the aggregates survive a restart."""

# In-process workers here run their engine as a thread (engine_process=False): these tests are about telemetry, not
# the engine process boundary, which tests/worker/test_engine_process.py and every CLI-started worker cover;
# a second interpreter importing torch per worker would add about 2 s to each start.

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cotserve.common.v1 import common_pb2
from cotserve.gateway.server import GatewayConfig, start_gateway
from cotserve.sdk import AsyncClient
from cotserve.telemetry.histogram import bucket_bounds, bucket_index
from cotserve.telemetry.otlpbuild import export_request, gateway_attrs, span
from cotserve.telemetry.server import TelemetryConfig, start_telemetry
from cotserve.telemetry.store import kv_bucket
from cotserve.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker
from tests.conftest import start_telemetry as start_telemetry_process
from tests.telemetry.test_histogram import nearest_rank
from tests.conftest import free_port, stop_process
from tests.metrics import scrape, value as sample

METRICS = {"ttft": telemetry_pb2.LATENCY_METRIC_TTFT, "e2e": telemetry_pb2.LATENCY_METRIC_E2E,
           "tpot": telemetry_pb2.LATENCY_METRIC_TPOT, "queue": telemetry_pb2.LATENCY_METRIC_QUEUE}
SLAS = {"realtime": common_pb2.SLA_CLASS_REALTIME, "interactive": common_pb2.SLA_CLASS_INTERACTIVE,
        "batch": common_pb2.SLA_CLASS_BATCH}


def providers(endpoint: str):
    memory = InMemorySpanExporter()
    made = []
    for name in ("cotserve-worker", "cotserve-gateway"):
        p = TracerProvider(resource=Resource.create({"service.name": name}))
        p.add_span_processor(SimpleSpanProcessor(memory))
        p.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True), schedule_delay_millis=200))
        made.append(p)
    return memory, made


def test_heatmap_counts_and_quantiles_equal_those_of_the_spans(tmp_path):
    proc, telemetry = start_telemetry_process("--state-file", str(tmp_path / "state.json"))
    memory, (wp, gp) = providers(f"http://{telemetry}")
    mix = ["interactive"] * 12 + ["batch"] * 8 + ["realtime"] * 4
    prompts = ["37+48-12=", "5*6-7=", "91-45+3=", "8+8+8-20="]

    async def main():
        # 24 blocks of 16 tokens: eight requests of up to 3 blocks each fill it, so admission sees
        # every occupancy from empty to nearly full.
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=8, kv_cache_bytes=24 * 16 * 6144), wp)
        gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address]), gp)
        try:
            async with AsyncClient(gateway.server.address) as client:
                sem = asyncio.Semaphore(8)

                async def one(i: int, sla: str):
                    async with sem:
                        await client.generate(prompts[i % 4], max_new_tokens=40, sla=sla, temperature=0.8, seed=i)

                await asyncio.gather(*(one(i, sla) for i, sla in enumerate(mix)))
        finally:
            await gateway.stop()
            await worker.stop()
        for p in (wp, gp):
            await asyncio.to_thread(p.force_flush)

    try:
        asyncio.run(main())
        summaries = [s for s in memory.get_finished_spans() if s.attributes.get("cotserve.component") == "gateway"]
        assert len(summaries) == len(mix)
        with grpc.insecure_channel(telemetry) as ch:
            stub = telemetry_pb2_grpc.TelemetryServiceStub(ch)
            deadline = time.monotonic() + 20
            while stub.GetStats(telemetry_pb2.GetStatsRequest(), timeout=5).requests_aggregated < len(mix):
                assert time.monotonic() < deadline, "not every request arrived at the telemetry service"
                time.sleep(0.2)
            stats = stub.GetStats(telemetry_pb2.GetStatsRequest(), timeout=5)
            assert stats.spans_malformed == 0 and stats.requests_aggregated == len(mix)
            occupancy = {kv_bucket(s.attributes["cotserve.kv_used_fraction_at_admission"]) for s in summaries}
            assert len(occupancy) >= 2, f"the load should spread over occupancy buckets, got {occupancy}"
            for sla in (None, *SLAS):
                for metric, pb_metric in METRICS.items():
                    expected = defaultdict(list)
                    for s in summaries:
                        a = s.attributes
                        if sla and a["cotserve.sla_class"] != f"SLA_CLASS_{sla.upper()}":
                            continue
                        if f"cotserve.{metric}_ms" in a:
                            key = (a["cotserve.model_version"], kv_bucket(a["cotserve.kv_used_fraction_at_admission"]))
                            expected[key].append(a[f"cotserve.{metric}_ms"])
                    resp = stub.GetHeatmap(telemetry_pb2.GetHeatmapRequest(metric=pb_metric, sla_class=SLAS.get(sla, 0)), timeout=5)
                    got = {(c.model_version, c.kv_occupancy_pct): c for c in resp.cells}
                    assert {k: c.count for k, c in got.items()} == {k: len(v) for k, v in expected.items()}, (sla, metric)
                    for key, values in expected.items():
                        for q, value in ((0.5, got[key].p50_ms), (0.95, got[key].p95_ms), (0.99, got[key].p99_ms)):
                            lo, hi = bucket_bounds(bucket_index(nearest_rank(values, q)))
                            assert lo <= value < hi, (sla, metric, key, q, sorted(values), value)
                    assert sum(sum(sl.counts) for sl in resp.slices) == sum(len(v) for v in expected.values())
            tenant = stub.GetHeatmap(telemetry_pb2.GetHeatmapRequest(metric=METRICS["ttft"], tenant="nobody"), timeout=5)
            assert list(tenant.cells) == []
    finally:
        stop_process(proc)


def test_malformed_otlp_is_counted_and_skipped_never_a_crash(tmp_path):
    now = time.time_ns()

    async def main():
        running = await start_telemetry(TelemetryConfig(port=0, state_file=None, metrics_port=free_port()))
        try:
            async with grpc.aio.insecure_channel(running.server.address) as ch:
                otlp = trace_service_pb2_grpc.TraceServiceStub(ch)
                tel = telemetry_pb2_grpc.TelemetryServiceStub(ch)
                good = span(gateway_attrs(ttft=12.0), now)  # a root: no parent is fine
                bad = [
                    span(gateway_attrs(), now, trace_id=b"abc"),                        # short trace id
                    span(gateway_attrs(), now, parent=b"12345"),                        # 5-byte parent
                    span({**gateway_attrs(), "cotserve.e2e_ms": "slow"}, now),          # garbage type
                    span({**gateway_attrs(), "cotserve.kv_used_fraction_at_admission": [0.1, 0.2]}, now),
                    span({k: v for k, v in gateway_attrs().items() if k != "cotserve.ttft_ms"}, now),  # missing
                ]
                failed = span(gateway_attrs(), now, error=True)  # a failed request: no latency, not malformed
                other = span({"weird": b"\x00\x01", "nested": [1, "a", 2.5]}, now, name="something else")
                resp = await otlp.Export(export_request([bad[0], good, *bad[1:], failed, other]))
                assert resp.partial_success.rejected_spans == 5
                assert "span" in resp.partial_success.error_message and "trace_id must be 16 bytes" in resp.partial_success.error_message
                assert (await otlp.Export(export_request([]))).partial_success.rejected_spans == 0
                stats = await tel.GetStats(telemetry_pb2.GetStatsRequest())
                assert (stats.spans_received, stats.spans_malformed, stats.requests_aggregated, stats.requests_failed) == (8, 5, 1, 1)
                m = await asyncio.to_thread(scrape, running.cfg.metrics_port)  # the same counts, for Prometheus
                assert [sample(m, f"cotserve_telemetry_{name}_total") for name in
                        ("spans_received", "spans_malformed", "requests_aggregated", "requests_failed")] == [8, 5, 1, 1]
                # the one good request, as the histogram Grafana's heatmaps read: each of its four latencies once,
                # labelled with its version, class and KV bucket (10% -> 0-25); its 12 ms TTFT between 10 and 25 ms
                hist = {(dict(labels)["metric"], dict(labels)["le"]): v for (name, labels), v in m.items()
                        if name == "cotserve_telemetry_request_latency_seconds_bucket"}
                counts = {dict(labels)["metric"]: (v, dict(labels)) for (name, labels), v in m.items()
                          if name == "cotserve_telemetry_request_latency_seconds_count"}
                assert {k: v for k, (v, _) in counts.items()} == {"ttft": 1, "e2e": 1, "tpot": 1, "queue": 1}
                labels = counts["ttft"][1]
                assert (labels["model_version"], labels["kv_occupancy"]) == ("m@abc", "0-25")
                assert "INTERACTIVE" in labels["sla_class"]
                assert (hist[("ttft", "0.01")], hist[("ttft", "0.025")], hist[("ttft", "+Inf")]) == (0, 1, 1)
                hm = await tel.GetHeatmap(telemetry_pb2.GetHeatmapRequest(metric=telemetry_pb2.LATENCY_METRIC_TTFT))
                assert [(c.model_version, c.count) for c in hm.cells] == [("m@abc", 1)] and 12 <= hm.cells[0].p50_ms < 13
                got = await tel.GetTrace(telemetry_pb2.GetTraceRequest(trace_id=other.trace_id))
                assert got.spans[0].attributes["nested"] == "1,a,2.5" and got.spans[0].name == "something else"
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await tel.GetHeatmap(telemetry_pb2.GetHeatmapRequest())
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "metric" in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await tel.GetTrace(telemetry_pb2.GetTraceRequest(trace_id=b"x"))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "trace_id: must be 16 bytes" in err.value.details()
        finally:
            await running.stop()

    asyncio.run(main())


def test_aggregates_survive_a_restart(tmp_path):
    state = tmp_path / "telemetry.json"
    now = time.time_ns()

    async def run_once(spans) -> telemetry_pb2.GetHeatmapResponse:
        running = await start_telemetry(TelemetryConfig(port=0, state_file=state))
        try:
            async with grpc.aio.insecure_channel(running.server.address) as ch:
                if spans:
                    await trace_service_pb2_grpc.TraceServiceStub(ch).Export(export_request(spans))
                return await telemetry_pb2_grpc.TelemetryServiceStub(ch).GetHeatmap(
                    telemetry_pb2.GetHeatmapRequest(metric=telemetry_pb2.LATENCY_METRIC_E2E))
        finally:
            await running.stop()

    spans = [span(gateway_attrs(e2e=100.0 + 7 * i, kv_frac=(i % 4) / 4 + 0.01, version=f"m@{i % 3}"), now - i * 10**9)
             for i in range(40)]
    before = asyncio.run(run_once(spans))
    assert sum(c.count for c in before.cells) == 40 and len(before.cells) == 12
    assert state.exists()
    after = asyncio.run(run_once([]))
    assert after == before
