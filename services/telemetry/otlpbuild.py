"""Building OTLP export requests by hand: malformed-input tests and the receiver benchmark use them."""

from __future__ import annotations

import os

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2 as otlp_common
from opentelemetry.proto.trace.v1 import trace_pb2


def kv(key: str, value) -> otlp_common.KeyValue:
    v = otlp_common.AnyValue()
    if isinstance(value, bool):
        v.bool_value = value
    elif isinstance(value, int):
        v.int_value = value
    elif isinstance(value, float):
        v.double_value = value
    elif isinstance(value, (list, tuple)):
        v.array_value.values.extend(kv("x", x).value for x in value)
    else:
        v.string_value = value
    return otlp_common.KeyValue(key=key, value=v)


def gateway_attrs(ttft: float = 20.0, e2e: float = 200.0, queue: float = 1.0, tpot: float | None = 5.0, kv_frac: float = 0.1,
                  version: str = "m@abc", sla: str = "SLA_CLASS_INTERACTIVE", tenant: str = "default") -> dict:
    attrs = {"cotserve.component": "gateway", "cotserve.model_version": version, "cotserve.sla_class": sla,
             "cotserve.tenant": tenant, "cotserve.kv_used_fraction_at_admission": kv_frac, "cotserve.ttft_ms": ttft,
             "cotserve.e2e_ms": e2e, "cotserve.queue_ms": queue}
    if tpot is not None:
        attrs["cotserve.tpot_ms"] = tpot
    return attrs


def span(attrs: dict, end_ns: int, name: str = "generate m", trace_id: bytes | None = None, span_id: bytes | None = None,
         parent: bytes = b"", error: bool = False) -> trace_pb2.Span:
    s = trace_pb2.Span(trace_id=trace_id or os.urandom(16), span_id=span_id or os.urandom(8), parent_span_id=parent,
                       name=name, kind=trace_pb2.Span.SPAN_KIND_SERVER,
                       start_time_unix_nano=end_ns - 1_000_000, end_time_unix_nano=end_ns,
                       attributes=[kv(k, v) for k, v in attrs.items()])
    if error:
        s.status.code = trace_pb2.Status.STATUS_CODE_ERROR
    return s


def export_request(spans: list, service: str = "cotserve-gateway") -> trace_service_pb2.ExportTraceServiceRequest:
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(kv("service.name", service))
    rs.scope_spans.add().spans.extend(spans)
    return req
