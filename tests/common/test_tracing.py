"""One trace per request across gateway and worker, correctly parented (real OTel SDK, in-memory)."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from cotserve.common.tracing import make_tracer_provider
from cotserve.gateway.server import GatewayConfig, start_gateway
from cotserve.sdk import AsyncClient
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker


def in_memory() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_gateway_and_worker_spans_form_one_trace():
    provider, exporter = in_memory()

    async def main():
        worker = await start_worker(WorkerConfig(port=0, max_num_seqs=4), provider)
        gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address]), provider)
        try:
            exporter.clear()  # forget the pool's start-up polls
            async with AsyncClient(gateway.server.address) as client:
                result = await client.generate("37+48-12=", max_new_tokens=64, sla="batch", temperature=0.0)
            return result, worker.server.address, worker.loaded.revision
        finally:
            await gateway.stop()
            await worker.stop()

    result, worker_address, revision = asyncio.run(main())
    spans = [s for s in exporter.get_finished_spans() if not s.name.endswith(("/Stats", "/Info"))]
    by_id = {s.context.span_id: s for s in spans}
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == ["generate cotserve-demo"]
    root = roots[0]
    assert root.kind == SpanKind.SERVER
    assert {s.context.trace_id for s in spans} == {root.context.trace_id}
    a = root.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "cotserve-demo"
    assert a["gen_ai.request.max_tokens"] == 64 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == 6 and a["gen_ai.usage.output_tokens"] == result.usage.completion_tokens
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("stop",)
    assert a["cotserve.sla_class"] == "SLA_CLASS_BATCH" and a["cotserve.worker"] == worker_address
    assert a["cotserve.ttft_ms"] > 0 and a["cotserve.queue_ms"] >= 0
    assert a["cotserve.component"] == "gateway" and a["cotserve.tenant"] == "default"
    assert a["cotserve.model_version"] == f"cotserve-demo@{revision}"
    assert a["cotserve.e2e_ms"] >= a["cotserve.ttft_ms"]
    assert a["cotserve.tpot_ms"] > 0 and 0 <= a["cotserve.kv_used_fraction_at_admission"] < 1

    (client_span,) = [s for s in spans if s.kind == SpanKind.CLIENT]
    assert client_span.parent.span_id == root.context.span_id
    (worker_span,) = [s for s in spans if s.kind == SpanKind.SERVER and s is not root]
    assert worker_span.name == "generate cotserve-demo"
    assert worker_span.parent.span_id == client_span.context.span_id and worker_span.parent.is_remote
    assert [e.name for e in worker_span.events] == ["scheduled", "first_token", "finished"]
    assert worker_span.attributes["cotserve.sla_class"] == "BATCH"
    assert worker_span.attributes["gen_ai.usage.output_tokens"] == result.usage.completion_tokens
    (queue_span,) = [s for s in spans if s.name == "queue wait"]
    assert queue_span.parent.span_id == root.context.span_id
    phases = sorted((s for s in spans if s.parent is not None and s.parent.span_id == worker_span.context.span_id),
                    key=lambda s: s.start_time)
    assert [s.name for s in phases] == ["queue", "prefill", "decode"]
    event_ts = {e.name: e.timestamp for e in worker_span.events}
    assert phases[0].end_time == phases[1].start_time == event_ts["scheduled"]
    assert phases[1].end_time == phases[2].start_time == event_ts["first_token"]
    assert phases[2].end_time == event_ts["finished"]
    assert worker_span.attributes["cotserve.preemptions"] == 0
    assert worker_span.attributes["cotserve.kv_used_fraction_at_admission"] == a["cotserve.kv_used_fraction_at_admission"]
    assert set(by_id) == {s.context.span_id for s in (root, queue_span, client_span, worker_span, *phases)}


def test_a_session_stream_is_traced_as_its_own_call_would_be_and_the_session_not_at_all():
    provider, exporter = in_memory()

    async def main():
        worker = await start_worker(WorkerConfig(port=0, max_num_seqs=4), provider)
        gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address]), provider)
        try:
            exporter.clear()
            async with AsyncClient(gateway.server.address, multiplex=True) as client:
                for prompt in ("37+48-12=", "5*6+1="):
                    chunks = [c async for c in client.stream(prompt, max_new_tokens=8, ignore_eos=True)]
                    assert sum(len(c.token_ids) for c in chunks) == 8
        finally:
            await gateway.stop()
            await worker.stop()

    asyncio.run(main())
    spans = [s for s in exporter.get_finished_spans() if not s.name.endswith(("/Stats", "/Info"))]
    assert not [s for s in spans if "Session" in s.name or "Multiplex" in s.name]  # the long-lived calls: no spans
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == ["generate cotserve-demo"] * 2  # one trace per stream, named as a call's
    for root in roots:
        assert root.kind == SpanKind.SERVER and root.attributes["cotserve.component"] == "gateway"
        assert root.attributes["rpc.method"] == "GenerateStream" and root.attributes["cotserve.ttft_ms"] > 0
        trace_spans = [s for s in spans if s.context.trace_id == root.context.trace_id]
        (client_span,) = [s for s in trace_spans if s.kind == SpanKind.CLIENT]
        (worker_span,) = [s for s in trace_spans if s.kind == SpanKind.SERVER and s is not root]
        assert client_span.parent.span_id == root.context.span_id
        assert worker_span.parent.span_id == client_span.context.span_id


def test_otlp_exporter_only_when_the_endpoint_is_set():
    assert make_tracer_provider("x", env={}) is None  # no instrumentation: nothing would receive its spans
    provider = make_tracer_provider("x", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
                                              "OTEL_SERVICE_NAME": "custom"})
    (processor,) = provider._active_span_processor._span_processors
    assert type(processor.span_exporter).__name__ == "OTLPSpanExporter"
    assert provider.resource.attributes["service.name"] == "custom"
    provider.shutdown()


def test_health_reflection_and_worker_polls_are_not_traced_requests_are():
    from types import SimpleNamespace

    from cotserve.common.tracing import _not_health_or_reflection

    def traced(method):
        return _not_health_or_reflection(SimpleNamespace(method=method))

    assert not traced("/grpc.health.v1.Health/Check") and not traced(b"/grpc.health.v1.Health/Watch")
    assert not traced("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    assert not traced("/cotserve.worker.v1.WorkerService/Stats") and not traced(b"/cotserve.worker.v1.WorkerService/Info")
    assert traced("/cotserve.worker.v1.WorkerService/Generate") and traced(b"/cotserve.gateway.v1.GatewayService/GenerateStream")
    assert traced("/cotserve.gateway.v1.GatewayService/Stats")  # only the worker's polls are skipped
    # the long-lived calls that carry requests as streams (each stream has its own spans)
    assert not traced("/cotserve.worker.v1.WorkerService/Multiplex")
    assert not traced(b"/cotserve.gateway.v1.GatewayService/Session")
