"""The telemetry service: the standard OTLP trace receiver (`opentelemetry.proto.collector.trace.v1.
TraceService/Export`) and `cotserve.telemetry.v1.TelemetryService` on one gRPC port (4317 by
default, OTLP's own), plus an optional HTTP page that shows the heatmaps and refreshes itself.

Any OTel SDK or an OpenTelemetry Collector can export here. Every span is kept for GetTrace (the
most recent traces only); the gateway's request summary spans become heatmap samples. A malformed
span (bad ids, mistyped or missing attributes on a request span) is counted, skipped and reported
back in OTLP's `partial_success`; it never fails the batch. The service does not trace itself
(its own Export calls would feed back into it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable
from dataclasses import dataclass

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cotserve.common.errors import InvalidArgument
from cotserve.common.metrics import CallbackCollector, MetricsServer, serve_metrics
from cotserve.common.server import Server, ServiceSpec, run_until_signalled
from cotserve.common.v1 import common_pb2
from cotserve.telemetry.config import TelemetryConfig
from cotserve.telemetry.histogram import bucket_upper_bounds
from cotserve.telemetry.store import Aggregator, Malformed, TraceStore, any_value, sample_from_attributes
from cotserve.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc

log = logging.getLogger("cotserve.telemetry")

METRIC_NAMES = {
    telemetry_pb2.LATENCY_METRIC_E2E: "e2e", telemetry_pb2.LATENCY_METRIC_TTFT: "ttft",
    telemetry_pb2.LATENCY_METRIC_TPOT: "tpot", telemetry_pb2.LATENCY_METRIC_QUEUE: "queue",
}
STATUS_CODE_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


def telemetry_registry(state: "TelemetryState") -> CollectorRegistry:
    """The telemetry service's Prometheus metrics, read from its counters at scrape time."""
    def collect() -> Iterable[Metric]:
        counters = {"cotserve_telemetry_spans_received": ("Spans received over OTLP.", state.spans_received),
                    "cotserve_telemetry_spans_malformed": ("Spans rejected as malformed.", state.spans_malformed),
                    "cotserve_telemetry_requests_aggregated": ("Gateway request spans turned into heatmap samples.",
                                                               state.requests_aggregated),
                    "cotserve_telemetry_requests_failed": ("Gateway request spans of failed requests.",
                                                           state.requests_failed)}
        out: list[Metric] = [CounterMetricFamily(name, doc, value=v) for name, (doc, v) in counters.items()]
        out.append(GaugeMetricFamily("cotserve_telemetry_traces_held", "Traces held for GetTrace.",
                                     value=len(state.traces.traces)))
        out.append(GaugeMetricFamily("cotserve_telemetry_slots_held", "Time slots the heatmaps hold.",
                                     value=len(state.aggregator.slots)))
        return out

    registry = CollectorRegistry()
    registry.register(CallbackCollector(collect))
    registry.register(state.latency)
    return registry


LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Bounds of the exported latency histogram (seconds): a millisecond to a minute, about 2.5x apart."""


def kv_occupancy_label(kv_pct: int) -> str:
    """The occupancy bucket as a label value: 0-25, 25-50, 50-75, 75-100 (percent of the worker's KV pool)."""
    return f"{kv_pct}-{kv_pct + 25}"


class TelemetryState:
    """The aggregator, the trace store and the receiver's counters."""

    def __init__(self, cfg: TelemetryConfig) -> None:
        self.aggregator = Aggregator(cfg.slot_s * 1000, cfg.retention_s * 1000, cfg.max_series)
        self.traces = TraceStore(cfg.max_traces)
        self.spans_received = 0
        self.spans_malformed = 0
        self.requests_aggregated = 0
        self.requests_failed = 0
        self.last_error = ""
        # the heatmaps' samples as a Prometheus histogram too (Grafana's heatmap panels in deploy/grafana): one series
        # per latency metric x model version x SLA class x KV occupancy bucket (tenants left out: unbounded)
        self.latency = Histogram("cotserve_telemetry_request_latency_seconds",
                                 "Request latencies from the gateway's request spans, by metric (e2e, ttft, tpot, queue), "
                                 "model version, SLA class and KV-cache occupancy at admission (percent bucket).",
                                 ["metric", "model_version", "sla_class", "kv_occupancy"], buckets=LATENCY_BUCKETS_S,
                                 registry=None)

    def ingest(self, request: trace_service_pb2.ExportTraceServiceRequest) -> tuple[int, str]:
        """Take every span of an OTLP export; returns (spans rejected, first error message)."""
        rejected, first_error = 0, ""
        for rs in request.resource_spans:
            service = ""
            for kv in rs.resource.attributes:
                if kv.key == "service.name" and kv.value.WhichOneof("value") == "string_value":
                    service = kv.value.string_value
            for ss in rs.scope_spans:
                for span in ss.spans:
                    self.spans_received += 1
                    try:
                        self._ingest_span(service, span)
                    except Malformed as exc:
                        self.spans_malformed += 1
                        rejected += 1
                        first_error = first_error or f"span {span.span_id.hex() or '?'} ({span.name!r}): {exc}"
        if first_error:
            self.last_error = first_error
        return rejected, first_error

    def _ingest_span(self, service: str, span) -> None:
        if len(span.trace_id) != 16 or not any(span.trace_id) or len(span.span_id) != 8 or not any(span.span_id):
            raise Malformed("trace_id must be 16 bytes and span_id 8 bytes, not all zero")
        if span.parent_span_id and len(span.parent_span_id) != 8:
            raise Malformed("parent_span_id must be empty or 8 bytes")
        summary = any(kv.key == "cotserve.component" and kv.value.string_value == "gateway" for kv in span.attributes)
        if summary:
            if span.end_time_unix_nano < span.start_time_unix_nano:
                raise Malformed("ends before it starts")
            if span.status.code == STATUS_CODE_ERROR:
                self.requests_failed += 1  # a failed request has no latency to aggregate
            else:
                attrs = {kv.key: any_value(kv.value) for kv in span.attributes}
                sample = sample_from_attributes(attrs, span.end_time_unix_nano)
                if self.aggregator.add(sample):
                    self.requests_aggregated += 1
                    key = sample.key
                    for metric, ms in sample.latencies_ms.items():
                        self.latency.labels(metric, key.model_version, key.sla_class,
                                            kv_occupancy_label(key.kv_pct)).observe(ms / 1000)
        self.traces.add(span.trace_id, service, span)


class OtlpTraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, state: TelemetryState) -> None:
        self.state = state

    async def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context) -> trace_service_pb2.ExportTraceServiceResponse:
        rejected, error = self.state.ingest(request)
        resp = trace_service_pb2.ExportTraceServiceResponse()
        if rejected:
            resp.partial_success.rejected_spans = rejected
            resp.partial_success.error_message = error
        return resp


def _attr_string(v) -> str:
    value = any_value(v)
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def heatmap(state: TelemetryState, request: telemetry_pb2.GetHeatmapRequest) -> telemetry_pb2.GetHeatmapResponse:
    metric = METRIC_NAMES.get(request.metric)
    if metric is None:
        raise InvalidArgument("metric: must be one of LATENCY_METRIC_E2E, _TTFT, _TPOT, _QUEUE")
    sla = None
    if request.sla_class:
        if request.sla_class not in common_pb2.SlaClass.values():
            raise InvalidArgument(f"sla_class: unknown value {request.sla_class}")
        sla = common_pb2.SlaClass.Name(request.sla_class).removeprefix("SLA_CLASS_")
    agg = state.aggregator
    args = (metric, sla, request.tenant or None, request.model_version or None, request.window_ms)
    resp = telemetry_pb2.GetHeatmapResponse(slot_ms=agg.slot_ms, metric=request.metric, bucket_upper_ms=bucket_upper_bounds())
    for (version, kv_pct), h in sorted(agg.matrix(*args).items()):
        resp.cells.add(model_version=version, kv_occupancy_pct=kv_pct, count=h.count,
                       p50_ms=h.quantile(0.50), p95_ms=h.quantile(0.95), p99_ms=h.quantile(0.99))
    for (version, slot), h in sorted(agg.time_view(*args).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        idx = sorted(h.counts)
        resp.slices.add(model_version=version, start_unix_ms=slot, bucket_indexes=idx, counts=[h.counts[i] for i in idx])
    return resp


class TelemetryServicer(telemetry_pb2_grpc.TelemetryServiceServicer):
    def __init__(self, state: TelemetryState) -> None:
        self.state = state

    async def GetHeatmap(self, request: telemetry_pb2.GetHeatmapRequest, context) -> telemetry_pb2.GetHeatmapResponse:
        return heatmap(self.state, request)

    async def GetTrace(self, request: telemetry_pb2.GetTraceRequest, context) -> telemetry_pb2.GetTraceResponse:
        if len(request.trace_id) != 16:
            raise InvalidArgument(f"trace_id: must be 16 bytes, got {len(request.trace_id)}")
        resp = telemetry_pb2.GetTraceResponse()
        for service, span in self.state.traces.get(request.trace_id):
            resp.spans.add(span_id=span.span_id, parent_span_id=span.parent_span_id, name=span.name, service_name=service,
                           kind=span.kind, start_unix_nano=span.start_time_unix_nano, end_unix_nano=span.end_time_unix_nano,
                           event_names=[e.name for e in span.events],
                           attributes={kv.key: _attr_string(kv.value) for kv in span.attributes})
        return resp

    async def GetStats(self, request: telemetry_pb2.GetStatsRequest, context) -> telemetry_pb2.GetStatsResponse:
        s = self.state
        return telemetry_pb2.GetStatsResponse(
            spans_received=s.spans_received, spans_malformed=s.spans_malformed, requests_aggregated=s.requests_aggregated,
            traces_held=len(s.traces.traces), slots_held=len(s.aggregator.slots), requests_failed=s.requests_failed,
        )


@dataclass(slots=True)
class RunningTelemetry:
    server: Server
    state: TelemetryState
    cfg: TelemetryConfig
    http: Any  # the page's aiohttp runner, when served
    http_port: int | None
    saver: asyncio.Task | None
    metrics_server: MetricsServer | None = None

    def save(self) -> None:
        if self.cfg.state_file is not None and self.state.aggregator.dirty:
            self.state.aggregator.save(self.cfg.state_file)

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.server.stop(grace_s)
        await self.close()

    async def close(self) -> None:
        if self.saver is not None:
            self.saver.cancel()
        if self.http is not None:
            await self.http.cleanup()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self.save()


async def _save_periodically(running: RunningTelemetry) -> None:
    while True:
        await asyncio.sleep(running.cfg.save_interval_s)
        try:
            running.save()
        except OSError as exc:
            log.error("cannot save telemetry state to %s: %s", running.cfg.state_file, exc)


async def start_telemetry(cfg: TelemetryConfig) -> RunningTelemetry:
    cfg.validate()
    state = TelemetryState(cfg)
    if cfg.state_file is not None:
        n = state.aggregator.load(cfg.state_file)
        log.info("telemetry state %s: %d series restored", cfg.state_file, n)
    specs = [
        ServiceSpec("opentelemetry.proto.collector.trace.v1.TraceService",
                    lambda srv: trace_service_pb2_grpc.add_TraceServiceServicer_to_server(OtlpTraceServicer(state), srv)),
        ServiceSpec("cotserve.telemetry.v1.TelemetryService",
                    lambda srv: telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server(TelemetryServicer(state), srv)),
    ]
    server = Server(specs, cfg.host, cfg.port, tracer_provider=None, tls=cfg)
    http, http_port = None, None
    if cfg.http_port is not None:
        from cotserve.telemetry.page import start_http

        http, http_port = await start_http(lambda request: heatmap(state, request), cfg.host, cfg.http_port,
                                           cfg.ssl_context(client_auth=False) if cfg.http_tls else None)
    metrics_server = serve_metrics(telemetry_registry(state), cfg.host, cfg.metrics_port)
    await server.start()
    await server.set_serving()
    running = RunningTelemetry(server, state, cfg, http, http_port, None, metrics_server)
    if cfg.state_file is not None:
        running.saver = asyncio.create_task(_save_periodically(running))
    scheme = "https" if cfg.http_tls and cfg.tls_cert else "http"
    page = f", heatmaps on {scheme}://{cfg.host}:{http_port}/" if http_port else ""
    log.info("SERVING telemetry (OTLP traces + TelemetryService) on %s%s", server.address, page)
    return running


async def serve(cfg: TelemetryConfig) -> None:
    running = await start_telemetry(cfg)
    await run_until_signalled(running.server, cfg.grace_s, on_stop=running.close)
