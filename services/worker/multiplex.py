"""The worker's side of `Multiplex`: many Generate streams over one long-lived gRPC call, which is how the gateway
reaches a worker.

Why: a Generate call per request costs a call's set-up at both ends (HTTP/2 stream, headers, the server's handler
task and its interceptors) before the first token can move, and one gRPC message per stream per engine step after
it. Here every stream's chunks that are ready after an engine step go out as one `MultiplexResponse`: at 32 streams a
step, one message instead of 32 for the gateway to read. `cotserve bench baseline` measures what the gateway adds to
time to first token both ways, and the CPU time per token of each process.

Each opened stream runs `WorkerServicer.Generate` (the same code a Generate call runs: stream interval, stop strings,
phases, the abort on cancel); the call itself is `common/multiplex.MultiplexCall` (chunks, ends, cancels, deadlines,
draining: the server stopping refuses new streams with UNAVAILABLE, so that the gateway sends them to another worker,
and tracing), which the gateway's `Session` shares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from cotserve.common.multiplex import MultiplexCall, MultiplexKind
from cotserve.common.tracing import MULTIPLEXED_GENERATE, MULTIPLEXED_GENERATE_ATTRIBUTES
from cotserve.worker.v1 import worker_pb2

if TYPE_CHECKING:
    from cotserve.worker.server import WorkerServicer

MULTIPLEX = MultiplexKind(
    MULTIPLEXED_GENERATE, MULTIPLEXED_GENERATE_ATTRIBUTES,
    chunk=lambda sid, response: worker_pb2.MultiplexChunk(stream_id=sid, response=response),
    end=lambda sid, code, message, trailers: worker_pb2.MultiplexChunk(
        stream_id=sid, end=worker_pb2.MultiplexEnd(code=code, message=message)),
    batch=lambda chunks: worker_pb2.MultiplexResponse(chunks=chunks))


def multiplex_call(servicer: "WorkerServicer", context: grpc.aio.ServicerContext,
                   tracer: trace.Tracer | None) -> MultiplexCall:
    """A Multiplex call of `servicer`: each stream a `Generate` of its open's request (no context: a stream has none)."""
    return MultiplexCall(MULTIPLEX, servicer, context, lambda op: servicer.Generate(op.request, None), tracer)
