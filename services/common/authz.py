"""Which service identity may call which RPC: one table for every service, enforced by one server interceptor.

An identity is the common name of the certificate a caller presents over mutual TLS (`cotserve tls init` issues one
per identity, `IDENTITIES`). A service whose gRPC port asks for client certificates (`--tls-client-ca`) serves an
RPC only to the identities its row names: any other is PERMISSION_DENIED naming the identity and the RPC, and the
refusal is logged. The gateway's own API is public: its callers are tenants, who authenticate with API keys.

The arrows: the gateway calls the workers (generation, their stats, and BATCH pauses on the SLO predictor's
forecasts), the SLO predictor (windows in, forecasts and latency models out) and the sandbox (runs); the operator
(the admin commands) reads and sets what an operator does: MoE policy, modules, exported windows, heatmaps, traces,
pauses. Every service sends its traces to the telemetry service's OTLP receiver (or to a collector that forwards them).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import grpc

log = logging.getLogger("cotserve.authz")

IDENTITIES = ("gateway", "worker", "router", "slo", "sandbox", "telemetry", "operator", "collector")
"""The identities of a cotserve deployment, each a certificate's common name (`collector`: an OpenTelemetry Collector
between the services and the telemetry service, as the compose stack runs one)."""

PUBLIC = frozenset({"*"})
"""A row's callers when anyone may call (the gateway's API: tenants authenticate with API keys)."""

GATEWAY, OPERATOR = frozenset({"gateway"}), frozenset({"operator"})
GATEWAY_OR_OPERATOR = GATEWAY | OPERATOR

POLICY: dict[str, frozenset[str]] = {
    "/cotserve.gateway.v1.GatewayService/GenerateStream": PUBLIC,
    "/cotserve.gateway.v1.GatewayService/Generate": PUBLIC,
    "/cotserve.gateway.v1.GatewayService/ListModels": PUBLIC,
    "/cotserve.gateway.v1.GatewayService/Tokenize": PUBLIC,
    "/cotserve.gateway.v1.GatewayService/Session": PUBLIC,
    "/cotserve.worker.v1.WorkerService/Generate": GATEWAY,
    "/cotserve.worker.v1.WorkerService/Multiplex": GATEWAY,
    "/cotserve.worker.v1.WorkerService/Tokenize": GATEWAY,
    "/cotserve.worker.v1.WorkerService/Info": GATEWAY_OR_OPERATOR,
    "/cotserve.worker.v1.WorkerService/Stats": GATEWAY_OR_OPERATOR,
    "/cotserve.worker.v1.WorkerService/PauseBatch": GATEWAY_OR_OPERATOR,  # the gateway's SLO pauses; an operator's
    "/cotserve.router.v1.RouterService/GetPolicy": OPERATOR,
    "/cotserve.router.v1.RouterService/SetPolicy": OPERATOR,
    "/cotserve.router.v1.RouterService/WatchPolicy": OPERATOR,
    "/cotserve.router.v1.RouterService/GetExpertLoad": OPERATOR,
    "/cotserve.slo.v1.SloService/ReportWindows": GATEWAY,
    "/cotserve.slo.v1.SloService/Forecast": GATEWAY_OR_OPERATOR,
    "/cotserve.slo.v1.SloService/PredictLatency": GATEWAY_OR_OPERATOR,
    "/cotserve.slo.v1.SloService/GetLatencyModel": GATEWAY_OR_OPERATOR,
    "/cotserve.slo.v1.SloService/WatchAdvice": OPERATOR,
    "/cotserve.slo.v1.SloService/ExportWindows": OPERATOR,
    "/cotserve.sandbox.v1.SandboxService/Run": GATEWAY,
    "/cotserve.sandbox.v1.SandboxService/RegisterModule": OPERATOR,
    "/cotserve.sandbox.v1.SandboxService/ListModules": OPERATOR,
    "/cotserve.sandbox.v1.SandboxService/DeleteModule": OPERATOR,
    "/cotserve.telemetry.v1.TelemetryService/GetHeatmap": OPERATOR,
    "/cotserve.telemetry.v1.TelemetryService/GetTrace": OPERATOR,
    "/cotserve.telemetry.v1.TelemetryService/GetStats": OPERATOR,
    "/opentelemetry.proto.collector.trace.v1.TraceService/Export": frozenset(IDENTITIES),
}
"""Every RPC of every service, and who may call it (a test fails when a service has an RPC without a row)."""

OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Infrastructure anyone may call: health checks (the orchestrator's probes) and reflection."""


def identity_of(context: Any) -> str | None:
    """The common name of the certificate the caller presented, None without one."""
    names = (context.auth_context() or {}).get("x509_common_name") or ()
    return names[0].decode() if names else None


def check(method: str, identity: str | None) -> str | None:
    """Why `identity` may not call `method` (None when it may)."""
    if method.startswith(OPEN_METHODS):
        return None
    allowed = POLICY.get(method)
    if allowed is None:
        return f"{method} has no row in the authorization table"
    if allowed is PUBLIC or identity in allowed:
        return None
    return (f"identity {identity or '(no certificate)'!r} may not call {method} "
            f"(allowed: {', '.join(sorted(allowed))})")


def authorizing(method: str, behavior: Callable) -> Callable:
    """`behavior` (any kind of handler of `method`: a coroutine, or an async generator of responses) refusing callers
    the table does not allow: PERMISSION_DENIED, logged."""
    async def refuse(context: Any) -> None:
        why = check(method, identity_of(context))
        if why is not None:
            log.warning("refused: %s", why)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    if inspect.isasyncgenfunction(behavior):
        async def responses(request: Any, context: Any):
            await refuse(context)
            async for item in behavior(request, context):
                yield item
        return responses

    async def call(request: Any, context: Any):
        await refuse(context)
        return await behavior(request, context)
    return call


class AuthzInterceptor(grpc.aio.ServerInterceptor):
    """The server interceptor that enforces `POLICY` (the outermost: nothing runs for a refused caller)."""

    async def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        method = details.method
        for kind, make in (("unary_unary", grpc.unary_unary_rpc_method_handler),
                           ("unary_stream", grpc.unary_stream_rpc_method_handler),
                           ("stream_unary", grpc.stream_unary_rpc_method_handler),
                           ("stream_stream", grpc.stream_stream_rpc_method_handler)):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(authorizing(method, behavior), request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler
