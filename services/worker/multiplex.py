"""The worker's side of `Multiplex`: many Generate streams over one long-lived gRPC call, which is how the gateway
reaches a worker.

Why: a Generate call per request costs a call's set-up at both ends (HTTP/2 stream, headers, the server's handler
task and its interceptors) before the first token can move, and one gRPC message per stream per engine step after
it. Measured on this machine's 2 cores with a bare relay in front of a toy worker (`/tmp` prototype, last round):
a call per request added 0.52-0.63 ms to time to first token over calling the worker directly, one long-lived
bidirectional stream 0.29-0.37 ms. Here every stream's chunks that are ready after an engine step go out as one
`MultiplexResponse`: at 32 streams a step, one message instead of 32 for the gateway to read. Measured through the
real gateway (`cotserve bench baseline`'s TTFT paths, 300 requests one at a time, three runs): the gateway adds
0.77-0.95 ms to TTFT multiplexed against 1.04-1.18 per call; at concurrency 32, stream interval 1, the worker front's
CPU per token 0.061-0.071 -> 0.027-0.028 ms and the gateway's 0.120-0.163 -> 0.082-0.090 ms, 3,802-4,425 ->
5,100-5,116 tok/s (README, the model worker).

Each opened stream runs `WorkerServicer.Generate` (the same code a Generate call runs: stream interval, stop strings,
phases, the abort on cancel) on a task of its own; its chunks and then its end (`MultiplexEnd`: OK, or the status a
Generate call would have failed with) are queued for the call's writer, which sends whatever is queued whenever it
gets to write. A stream ends early when the caller cancels it (`MultiplexCancel`: its request is aborted in the
engine, as a cancelled Generate call's is), when its `timeout_ms` passes (DEADLINE_EXCEEDED), or when the call
itself ends: the caller went away, or the server stopped. Draining (the server stopping), the call refuses new
streams with UNAVAILABLE, so that the gateway sends them to another worker, and ends once its streams have.

Tracing: the call itself is not traced (it is not a request); each stream's span is a SERVER span named as a
Generate call's, a child of the span whose W3C context the open carried, so a request's trace reads as it does over
a Generate call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import aclosing
from typing import TYPE_CHECKING, AsyncIterator, Iterator

import grpc
from opentelemetry import propagate, trace

from cotserve.common.server import error_status
from cotserve.common.tracing import MULTIPLEXED_GENERATE, MULTIPLEXED_GENERATE_ATTRIBUTES
from cotserve.worker.v1 import worker_pb2

if TYPE_CHECKING:
    from cotserve.worker.server import WorkerServicer

log = logging.getLogger("cotserve.rpc")


class MultiplexCall:
    """One Multiplex call: its open streams (a task each) and the chunks ready for its next message."""

    def __init__(self, servicer: "WorkerServicer", context: grpc.aio.ServicerContext,
                 tracer: trace.Tracer | None) -> None:
        self.servicer, self.context, self.tracer = servicer, context, tracer
        self.streams: dict[int, asyncio.Task] = {}
        self.ready: list[worker_pb2.MultiplexChunk] = []
        self.reading = True  # the caller may still open streams
        self.draining = False
        self._wake = asyncio.Event()

    async def serve(self, requests: AsyncIterator[worker_pb2.MultiplexRequest]) -> None:
        """Read opens and cancels on a task; write what is ready until the caller is done (or the server drains)
        and every stream has ended. However the call ends, the streams still open are cancelled (their requests
        aborted in the engine)."""
        await self.context.send_initial_metadata(())  # at once: the caller writes nothing before it has them
        self.servicer.mux_calls.add(self)
        if self.servicer.draining:
            self.draining = True
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            while True:
                if not self.ready:
                    if not self.streams and (self.draining or not self.reading):
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                chunks, self.ready = self.ready, []
                await self.context.write(worker_pb2.MultiplexResponse(chunks=chunks))
        finally:
            self.servicer.mux_calls.discard(self)
            reader.cancel()
            for task in self.streams.values():
                task.cancel()

    def drain(self) -> None:
        self.draining = True
        self._wake.set()

    async def _read(self, requests: AsyncIterator[worker_pb2.MultiplexRequest]) -> None:
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "open":
                    self._open(message.open)
                elif kind == "cancel":
                    task = self.streams.pop(message.cancel.stream_id, None)
                    if task is not None:
                        task.cancel()
        except grpc.aio.AioRpcError:  # (the call broke: serve's write fails or its cancellation ends it)
            pass
        finally:
            self.reading = False
            self._wake.set()

    def _put(self, chunk: worker_pb2.MultiplexChunk) -> None:
        self.ready.append(chunk)
        self._wake.set()

    def _end(self, stream_id: int, code: str, message: str = "") -> None:
        self._put(worker_pb2.MultiplexChunk(stream_id=stream_id, end=worker_pb2.MultiplexEnd(code=code, message=message)))

    def _open(self, op: worker_pb2.MultiplexOpen) -> None:
        if op.stream_id in self.streams:
            # (the open stream is the caller's; this one never started)
            self._end(op.stream_id, "INVALID_ARGUMENT", f"stream_id: {op.stream_id} is already open on this call")
        elif self.draining:
            self._end(op.stream_id, "UNAVAILABLE", "the worker is shutting down")
        else:
            self.streams[op.stream_id] = asyncio.get_running_loop().create_task(self._stream(op))

    @contextlib.contextmanager
    def _span(self, op: worker_pb2.MultiplexOpen) -> Iterator[trace.Span | None]:
        """The stream's SERVER span, current while it runs (`Generate` names it and adds what was asked)."""
        if self.tracer is None:
            yield None
            return
        with self.tracer.start_as_current_span(
                MULTIPLEXED_GENERATE, context=propagate.extract(dict(op.trace_context)), kind=trace.SpanKind.SERVER,
                attributes=MULTIPLEXED_GENERATE_ATTRIBUTES, record_exception=False, set_status_on_exception=False) as span:
            yield span

    async def _stream(self, op: worker_pb2.MultiplexOpen) -> None:
        """One stream: its chunks, then its end (none when cancelled: the caller knows)."""
        sid, start, code, message = op.stream_id, time.monotonic(), "OK", ""
        try:
            with self._span(op) as span:
                try:
                    async with asyncio.timeout(op.timeout_ms / 1000 if op.timeout_ms else None):
                        async with aclosing(self.servicer.Generate(op.request, None)) as responses:
                            async for response in responses:
                                self._put(worker_pb2.MultiplexChunk(stream_id=sid, response=response))
                except TimeoutError:
                    code, message = "DEADLINE_EXCEEDED", f"deadline: {op.timeout_ms} ms passed"
                except Exception as exc:  # noqa: BLE001 - the stream's status, as a Generate call's would be
                    code, message, _ = error_status(exc)
                if span is not None and code != "OK":
                    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code}: {message}"))
            self._end(sid, code, message)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            if self.streams.get(sid) is asyncio.current_task():
                del self.streams[sid]
            self._wake.set()
            log.info("%s (multiplexed) %s %.1fms", MULTIPLEXED_GENERATE, code, (time.monotonic() - start) * 1000)
