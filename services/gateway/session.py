"""The gateway's `Session`: many GenerateStream requests over one long-lived call from a client (the SDK's
`AsyncClient(multiplex=True)`), each run by the relay exactly as a GenerateStream call's request is; the call is
`common/multiplex.MultiplexCall`, as the worker's Multiplex is.

Why: under a flood of new calls (a BATCH client's streams arriving in waves as its requests finish together) each new
call costs the gateway's process several trips through gRPC's completion queue and the event loop before its handler
runs, and a wave of them delays every call behind it, an urgent one included. A request opened on a Session is one
message on a call already accepted, so it waits on none of that; and the gateway writes every stream's ready chunks
in one message. `cotserve bench isolation` (tenant B on a Session against a call per request) and `cotserve bench
baseline` measure both.
"""

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
                         lambda op: servicer.relay.counted(op.request, SessionStream(metadata, op.timeout_ms)), tracer,
                         max_streams=servicer.max_session_streams, limit_name="max_session_streams")
