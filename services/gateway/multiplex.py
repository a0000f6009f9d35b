"""The gateway's side of a worker's `Multiplex` call (`worker/multiplex.py` has the why and the worker's side): every
request the gateway sends a worker is a stream on one long-lived call, opened lazily, shared by all of them, and
opened again after it breaks.

`WorkerStreams.open` returns a `MuxStream`, read as the relay reads a Generate call (`pending()`: what has arrived,
`close()`: cancel it unless it ended). A stream's failure is the `grpc.aio.AioRpcError` a Generate call would have
raised (its code and message from the worker's `MultiplexEnd`), so the relay's retry rules do not know the
difference. The call breaking (the worker died, restarted or stopped) fails every stream on it with UNAVAILABLE. A
worker that does not have `Multiplex` (an older build, during a rolling upgrade) answers UNIMPLEMENTED: its requests
then go by a Generate call each, from the first on: no open is written before the worker has answered the call.

Deadlines: the open carries the request's time left (the worker ends the stream with DEADLINE_EXCEEDED past it),
and the gateway gives up on it at the same moment (and cancels it) if it has not ended by then. Tracing: each stream gets
a CLIENT span named as a Generate call's, whose W3C context the open carries to the worker's span."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider

from cotserve.common.streams import ReadAhead
from cotserve.common.tracing import MULTIPLEXED_GENERATE, MULTIPLEXED_GENERATE_ATTRIBUTES
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("cotserve.gateway.pool")
MAX_TIMEOUT_MS = 2**32 - 1


def rpc_error(code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), message)


class CallStream:
    """A request's own Generate call, read ahead (`common/streams.ReadAhead`): the way without `Multiplex`."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub, request: worker_pb2.GenerateRequest,
                 timeout_s: float | None) -> None:
        self.rpc = stub.Generate(request, timeout=timeout_s)
        self.reader = ReadAhead(self.rpc)

    async def pending(self) -> list[worker_pb2.GenerateResponse] | None:
        return await self.reader.pending()

    def close(self) -> None:
        self.rpc.cancel()  # the client went away or we failed: free the worker's pages now
        self.reader.close()


class _Link:
    """One Multiplex call and the streams open on it."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.streams: dict[int, MuxStream] = {}
        # Opens and cancels are written by one task, in order. Never by a request's own task: gRPC cancels the whole
        # call when a task is cancelled while it awaits a write (grpc.aio's `_write`), and a request's task is
        # cancelled whenever its client goes away; every other stream on the call would fail with it.
        self.outbox: asyncio.Queue[worker_pb2.MultiplexRequest] = asyncio.Queue()
        self.reader: asyncio.Task | None = None
        self.writer: asyncio.Task | None = None
        self.answered = asyncio.get_running_loop().create_future()  # the worker's first word: its headers, or an end
        self.ended = False


class MuxStream:
    """One request on a worker's Multiplex call."""

    def __init__(self, owner: "WorkerStreams", link: _Link, stream_id: int, timeout_s: float | None,
                 span: trace.Span | None) -> None:
        self.owner, self.link, self.stream_id = owner, link, stream_id
        self._timer = None if timeout_s is None else asyncio.get_running_loop().call_later(max(0.0, timeout_s), self._expire)
        self.span = span
        self.items: list[worker_pb2.GenerateResponse] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.ended = False
        self._waiter: asyncio.Future | None = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def put(self, response: worker_pb2.GenerateResponse) -> None:
        self.items.append(response)
        self._wake()

    def end(self, code: str, message: str) -> None:
        """The stream's end: OK, or the error `pending` raises once every chunk before it is read."""
        if self.ended:
            return
        self.ended = True
        if code != "OK":
            self.error = rpc_error(getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN), message)
        self._end_span()
        self._wake()

    def _expire(self) -> None:
        """The deadline passed with the stream still open (the worker ends it too; whichever is first)."""
        if not self.ended:
            self.error = rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self.close()
            self._wake()

    def _end_span(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.span is not None:
            if self.error is not None:
                self.span.set_status(trace.Status(trace.StatusCode.ERROR, f"{self.error.code().name}: {self.error.details()}"))
            self.span.end()
            self.span = None

    async def pending(self) -> list[worker_pb2.GenerateResponse] | None:
        """Everything received since the last call, waiting for at least one; None once the stream has ended."""
        while not self.items and not self.ended:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.items:
            items, self.items = self.items, []
            return items
        if self.error is not None:
            raise self.error
        return None

    def close(self) -> None:
        """Done with the stream: cancel it on the worker (its pages freed) unless it has ended."""
        if not self.ended:
            self.ended = True
            self._end_span()
            if self.link.streams.pop(self.stream_id, None) is not None:
                self.owner.cancel(self.link, self.stream_id)


class WorkerStreams:
    """Every request this gateway sends one worker, as streams of one Multiplex call."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub, tracer_provider: TracerProvider | None = None,
                 address: str = "") -> None:
        self.stub, self.address = stub, address
        self.tracer = None if tracer_provider is None else tracer_provider.get_tracer("cotserve.gateway")
        self.unimplemented = False  # the worker has no Multiplex: a Generate call per request
        self._link: _Link | None = None
        self._ids = itertools.count(1)

    async def open(self, request: worker_pb2.GenerateRequest, timeout_s: float | None) -> MuxStream | CallStream:
        """Start `request` on the worker; read what comes back with the stream's `pending()`. The first open (and
        the first after the call broke) starts the call and waits for the worker's headers: one round trip per
        connection, and no open written into a call the worker refuses."""
        link = self._link if self._link is not None or self.unimplemented else self._connect()
        if link is not None and not link.answered.done():
            await asyncio.shield(link.answered)  # every open waits for a new call's first word
        if self.unimplemented or link is None:
            return CallStream(self.stub, request, timeout_s)
        sid = next(self._ids)
        span, carrier = self._span()
        stream = MuxStream(self, link, sid, timeout_s, span)
        if link.ended:
            stream.end("UNAVAILABLE", "the worker's Multiplex call ended")
            return stream
        if timeout_s is not None and timeout_s <= 0:
            stream.end("DEADLINE_EXCEEDED", "Deadline Exceeded")
            return stream
        link.streams[sid] = stream
        timeout_ms = 0 if timeout_s is None else min(MAX_TIMEOUT_MS, max(1, math.ceil(timeout_s * 1000)))
        link.outbox.put_nowait(worker_pb2.MultiplexRequest(open=worker_pb2.MultiplexOpen(
            stream_id=sid, request=request, timeout_ms=timeout_ms, trace_context=carrier)))
        return stream

    def _span(self) -> tuple[trace.Span | None, dict[str, str]]:
        """The stream's CLIENT span (a child of the request's current span) and its W3C context to send."""
        carrier: dict[str, str] = {}
        if self.tracer is None:
            return None, carrier
        span = self.tracer.start_span(MULTIPLEXED_GENERATE, kind=trace.SpanKind.CLIENT,
                                      attributes=MULTIPLEXED_GENERATE_ATTRIBUTES)
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        return span, carrier

    def _connect(self) -> _Link:
        link = self._link = _Link(self.stub.Multiplex())
        loop = asyncio.get_running_loop()
        link.reader = loop.create_task(self._read(link))
        link.writer = loop.create_task(self._write(link))
        return link

    async def _read(self, link: _Link) -> None:
        """Hand each chunk to its stream; when the call ends, every stream still on it fails."""
        code, message = grpc.StatusCode.UNAVAILABLE, "the worker ended its Multiplex call"
        try:
            # The worker sends its headers as the call starts; an older one ends it at once, UNIMPLEMENTED. No open
            # is written before one or the other (an open written into a call that is ending can turn its status
            # into gRPC's INTERNAL, and the UNIMPLEMENTED that says "call it per request" is lost).
            await link.call.initial_metadata()
            if link.call.done():  # ended with its headers: refused (an older worker) or stopping
                status = await link.call.code()
                if status != grpc.StatusCode.OK:
                    code, message = status, await link.call.details() or status.name
                return
            if not link.answered.done():
                link.answered.set_result(None)
            log.debug("worker %s: Multiplex call open", self.address)
            async for response in link.call:
                for chunk in response.chunks:
                    stream = link.streams.get(chunk.stream_id)
                    if stream is None:
                        continue  # (cancelled here; what the worker sent before the cancel reached it)
                    if chunk.HasField("end"):
                        del link.streams[chunk.stream_id]
                        stream.end(chunk.end.code, chunk.end.message)
                    else:
                        stream.put(chunk.response)
        except grpc.aio.AioRpcError as err:
            code, message = err.code(), err.details() or err.code().name
        finally:
            if code == grpc.StatusCode.UNIMPLEMENTED:  # at once (with its headers) or later: the same answer
                self.unimplemented = True
                log.warning("worker %s has no Multiplex (an older build): calling it per request", self.address)
            link.ended = True
            if not link.answered.done():
                link.answered.set_result(None)
            if link.writer is not None:
                link.writer.cancel()  # (the call is over: nothing more to write)
            if self._link is link:
                self._link = None
            streams, link.streams = link.streams, {}
            if streams:
                log.warning("worker %s: its Multiplex call ended (%s: %s) with %d streams open; they fail with it",
                            self.address, code.name, message, len(streams))
            for stream in streams.values():
                stream.end(code.name, message)

    async def _write(self, link: _Link) -> None:
        """Write the call's opens and cancels in order, once the worker has answered it."""
        await link.answered
        while True:
            message = await link.outbox.get()
            try:
                await link.call.write(message)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                # the call has ended (its reader fails the streams it knew); an open that raced it fails here
                if message.HasField("open") and (stream := link.streams.pop(message.open.stream_id, None)) is not None:
                    details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                    stream.end("UNAVAILABLE", f"the worker's Multiplex call ended: {details}")

    def cancel(self, link: _Link, stream_id: int) -> None:
        """Cancel a stream on the worker (written after its open, by the call's writer)."""
        if not link.ended:
            link.outbox.put_nowait(worker_pb2.MultiplexRequest(cancel=worker_pb2.MultiplexCancel(stream_id=stream_id)))
