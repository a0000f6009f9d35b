"""OpenTelemetry for every service: one TracerProvider, gRPC server and client instrumentation.

Spans are exported over OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or the traces-specific
variable) is set; otherwise a service runs without instrumentation (nothing would receive its spans).
`OTEL_SERVICE_NAME` overrides the service name. The W3C trace context travels in gRPC metadata, so a
gateway request and its worker stream share one trace.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

@functools.lru_cache(maxsize=512)
def _traced(full_method: str) -> bool:
    """Not traced: health checks, reflection, and the gateway's twice-a-second polls of each worker's
    Stats/Info (they are not requests, and would bury the request traces at the receiver); nor a worker's Multiplex
    call, which lives as long as the gateway's connection, nor a gateway's Session call, which lives as long as a
    client's: each stream they carry has its own spans (`common/multiplex.py`, `gateway/multiplex.py`)."""
    service, _, method = full_method.strip("/").rpartition("/")
    if service == "grpc.health.v1.Health" or service.startswith("grpc.reflection"):
        return False
    if service == "cotserve.gateway.v1.GatewayService":
        return method != "Session"
    return not (service == "cotserve.worker.v1.WorkerService" and method in ("Stats", "Info", "Multiplex"))


def _not_health_or_reflection(details: object) -> bool:
    """The instrumentation's filter, asked on every call: one cached look-up per method name (the library's
    composed filters re-split the name for each condition, about half a millisecond per request)."""
    method = getattr(details, "method", None) or getattr(details, "full_method", "")
    return _traced(method.decode() if isinstance(method, bytes) else method)


def make_tracer_provider(service_name: str, env: dict[str, str] | None = None) -> TracerProvider | None:
    """A provider for `service_name` exporting over OTLP, when the environment says where; otherwise None: no
    instrumentation and no-op spans: spans recorded for no exporter cost every request CPU time and time to first
    token for nothing. `OTEL_TRACES_SAMPLER` (e.g. `parentbased_traceidratio` with
    `OTEL_TRACES_SAMPLER_ARG=0.1`) thins what an exporting provider records."""
    env = os.environ if env is None else env
    if not (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    name = env.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def server_interceptors(provider: TracerProvider | None) -> list[Any]:
    """The gRPC aio server instrumentation (health checks and reflection are not traced)."""
    return [] if provider is None else [aio_server_interceptor(tracer_provider=provider, filter_=_not_health_or_reflection)]


def client_interceptors(provider: TracerProvider | None) -> list[Any]:
    """The gRPC aio client instrumentation: child spans that inject the W3C context."""
    return [] if provider is None else list(aio_client_interceptors(tracer_provider=provider, filter_=_not_health_or_reflection))


MULTIPLEXED_GENERATE = "/cotserve.worker.v1.WorkerService/Generate"
"""The name of a stream's spans on a worker's Multiplex call, at both ends, and of its log line: a Generate call's,
so that a request's trace reads the same either way."""
MULTIPLEXED_GENERATE_ATTRIBUTES = {"rpc.system": "grpc", "rpc.service": "cotserve.worker.v1.WorkerService",
                                   "rpc.method": "Generate"}
"""The rpc.* attributes the gRPC instrumentation gives a Generate call's spans."""
SESSION_GENERATE_STREAM = "/cotserve.gateway.v1.GatewayService/GenerateStream"
"""The name of a stream's span on a gateway's Session call: a GenerateStream call's, as the worker's streams are named
for Generate."""
SESSION_GENERATE_STREAM_ATTRIBUTES = {"rpc.system": "grpc", "rpc.service": "cotserve.gateway.v1.GatewayService",
                                      "rpc.method": "GenerateStream"}


RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 2000)]
"""Channel options for one service calling another on this network: reconnect within two seconds of a
restarted peer coming back (gRPC's default backoff grows to two minutes, longer than a worker restart)."""
