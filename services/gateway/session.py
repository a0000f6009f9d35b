"""The gateway's `Session`: many GenerateStream requests over one long-lived call from a client (the SDK's
`AsyncClient(multiplex=True)`), each run by the relay exactly as a GenerateStream call's request is; the call is
`common/multiplex.MultiplexCall`, as the worker's Multiplex is.

Why: under a BATCH flood of calls (`cotserve bench isolation`: 64 streams of 96 tokens, about 110 new calls a
second arriving in waves as the flood's requests finish together) an INTERACTIVE call waited in the gateway for its
handler to start: 0.6-0.9 ms at the median but 20-40 ms in its slowest requests, against 2.3 ms at p99 with no
flood. Timed in one run (`/tmp` instrumentation: the client's send and the handler's first line, same clock): the
slow ones had 7-26 flood calls accepted ahead of them, and a bare grpc.aio relay (no interceptors, no admission)
showed the same 34 ms p99, while a second gateway process for the urgent tenant alone removed it (2.96 ms): each new
call costs its process several trips through gRPC's completion queue and the event loop before its handler runs,
and a wave of them delays every call behind it; neither a higher CPU priority for the gateway or the client nor the
engine's moved it. A request opened on a Session is one message on a call already accepted: in the same setup
(`/tmp` prototype, the flood still a call per request, interleaved), INTERACTIVE TTFT p99 22 and 15 ms on a Session
against 37 and 31 ms per call; p50 5.5 against 6.2. `cotserve bench isolation` (tenant B on a Session, the flood a
call per request), five runs: p99 under the flood 1.11-1.59x alone against 2.05-2.72x with B a call per request.
At concurrency 32 the gateway writes every stream's ready chunks in one message: `cotserve bench baseline` at stream
interval 1, 9.3-10.6k tok/s against 6.5-7.3k a call per request (README: the isolation paragraph of "SLA classes,
tenants, quotas and metrics", and "The model worker").

The call's metadata authenticates every stream on it (one API key, one tenant per Session); each stream has its own
deadline (its open's `timeout_ms`), its own span, and its end carries the status, message and trailers
(retry-after-ms with RESOURCE_EXHAUSTED) its GenerateStream call would have ended with."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable

import grpc
from opentelemetry import trace

from cotserve.common.multiplex import MultiplexCall, MultiplexKind
from cotserve.common.tracing import SESSION_GENERATE_STREAM, SESSION_GENERATE_STREAM_ATTRIBUTES
from cotserve.gateway.v1 import gateway_pb2

if TYPE_CHECKING:
    from cotserve.gateway.server import GatewayServicer

SESSION = MultiplexKind(
    SESSION_GENERATE_STREAM, SESSION_GENERATE_STREAM_ATTRIBUTES,
    chunk=lambda sid, response: gateway_pb2.SessionChunk(stream_id=sid, response=response),
    end=lambda sid, code, message, trailers: gateway_pb2.SessionChunk(
        stream_id=sid, end=gateway_pb2.SessionEnd(code=code, message=message, trailers=trailers)),
    batch=lambda chunks: gateway_pb2.SessionResponse(chunks=chunks))


class SessionStream:
    """One stream of a Session, as the relay sees a request (`relay.Call`): the call's metadata, its own deadline."""

    def __init__(self, metadata: Iterable[tuple[str, str | bytes]] | None, timeout_ms: int) -> None:
        self.metadata = metadata
        self.deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms else None

    def invocation_metadata(self) -> Iterable[tuple[str, str | bytes]] | None:
        return self.metadata

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


def session_call(servicer: "GatewayServicer", context: grpc.aio.ServicerContext,
                 tracer: trace.Tracer | None) -> MultiplexCall:
    """A Session call of `servicer`: each stream its open's request through `Relay.counted`."""
    metadata = tuple(context.invocation_metadata() or ())
    return MultiplexCall(SESSION, servicer, context,
                         lambda op: servicer.relay.counted(op.request, SessionStream(metadata, op.timeout_ms)), tracer)
