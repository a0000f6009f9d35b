"""The gateway's side of a worker's `Multiplex` call (`worker/multiplex.py` has the why and the worker's side): every
request the gateway sends a worker is a stream on one long-lived call, opened lazily, shared by all of them, and
opened again after it breaks.

`WorkerStreams.open` returns a `MuxStream` (`common/multiplex_client.py`, shared with the SDK's Session), read as the
relay reads a Generate call (`pending()`: what has arrived, `close()`: cancel it unless it ended). A stream's failure
is the `grpc.aio.AioRpcError` a Generate call would have raised (its code and message from the worker's
`MultiplexEnd`), so the relay's retry rules do not know the difference. The call breaking (the worker died,
restarted or stopped) fails every stream on it with UNAVAILABLE. A worker that does not have `Multiplex` (an older
build, during a rolling upgrade) answers UNIMPLEMENTED: its requests then go by a Generate call each (`CallStream`),
from the first on: no open is written before the worker has answered the call.

Deadlines: the open carries the request's time left (the worker ends the stream with DEADLINE_EXCEEDED past it),
and the gateway gives up on it at the same moment (and cancels it) if it has not ended by then. Tracing: each stream gets
a CLIENT span named as a Generate call's, whose W3C context the open carries to the worker's span."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider

from cotserve.common.multiplex_client import CallStream, ClientKind, MultiplexClient, MuxStream
from cotserve.common.tracing import MULTIPLEXED_GENERATE, MULTIPLEXED_GENERATE_ATTRIBUTES
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["CallStream", "MuxStream", "WorkerStreams"]


def worker_kind(stub: worker_pb2_grpc.WorkerServiceStub) -> ClientKind:
    """A worker's `Multiplex`, as the gateway calls it."""
    return ClientKind(
        "Multiplex", MULTIPLEXED_GENERATE, MULTIPLEXED_GENERATE_ATTRIBUTES, start=stub.Multiplex,
        open=lambda sid, request, timeout_ms, carrier: worker_pb2.MultiplexRequest(open=worker_pb2.MultiplexOpen(
            stream_id=sid, request=request, timeout_ms=timeout_ms, trace_context=carrier)),
        cancel=lambda sid: worker_pb2.MultiplexRequest(cancel=worker_pb2.MultiplexCancel(stream_id=sid)),
        per_call=lambda request, timeout_s: CallStream(stub.Generate(request, timeout=timeout_s)))


class WorkerStreams(MultiplexClient):
    """Every request this gateway sends one worker, as streams of one Multiplex call."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub, tracer_provider: TracerProvider | None = None,
                 address: str = "") -> None:
        tracer = None if tracer_provider is None else tracer_provider.get_tracer("cotserve.gateway")
        super().__init__(worker_kind(stub), tracer, f"worker {address}")
