"""The caller's side of a multiplexed call (`common/multiplex.py` has the server's): every request one caller sends
one server is a stream on one long-lived call, opened lazily, shared by all of them, and opened again after it
breaks. Two callers use it: the gateway reaching a worker (`Multiplex`, `gateway/multiplex.py`) and the SDK's
AsyncClient reaching a gateway (`Session`, with `multiplex=True`); a `ClientKind` says which.

`MultiplexClient.open` returns a `MuxStream`, read as a streaming call is read through `ReadAhead`
(`pending()`: what has arrived, `close()`: cancel it unless it ended). A stream's failure is the
`grpc.aio.AioRpcError` its own call would have raised (code, message and trailers from the server's end of the
stream), so the caller's error handling does not know the difference. The call breaking (the server died, restarted
or stopped) fails every stream on it with UNAVAILABLE. A server without the method (an older build, during a rolling
upgrade) answers UNIMPLEMENTED: its requests then go by a call each (`ClientKind.per_call`), from the first on: no
open is written before the server has answered the call.

Deadlines: the open carries the request's time left (the server ends the stream with DEADLINE_EXCEEDED past it),
and the caller gives up on it at the same moment (and cancels it) if it has not ended by then. Tracing: each stream
gets a CLIENT span named as its own call's would be, whose W3C context the open carries to the server's span."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import grpc

from cotserve.common.streams import ReadAhead

try:  # the SDK runs without OpenTelemetry (`pip install cotserve`): no spans, no trace context
    from opentelemetry import propagate, trace
except ImportError:  # pragma: no cover - exercised by tests/test_packaging.py's client-only install
    propagate = trace = None

log = logging.getLogger("cotserve.multiplex")
MAX_TIMEOUT_MS = 2**32 - 1


def rpc_error(code: grpc.StatusCode, message: str, trailers: Mapping[str, str] | None = None) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*(trailers or {}).items()), message)


class CallStream:
    """A request's own streaming call, read ahead (`common/streams.ReadAhead`): the way without the method."""

    def __init__(self, rpc: Any) -> None:
        self.rpc = rpc
        self.reader = ReadAhead(rpc)

    async def pending(self) -> list[Any] | None:
        return await self.reader.pending()

    def close(self) -> None:
        self.rpc.cancel()  # the caller went away or failed: the server stops (a worker frees its pages) now
        self.reader.close()


@dataclass(frozen=True, slots=True)
class ClientKind:
    """One multiplexed method as its caller uses it: the call's name in messages, the span name and rpc.* attributes
    of its streams, how the call starts, how an open and a cancel are written, and a request's own call where the
    server lacks the method (an object with `pending()` and `close()`)."""

    call_name: str
    span_name: str
    attributes: dict[str, str]
    start: Callable[[], Any]                                          # () -> the bidirectional call
    open: Callable[[int, Any, int, dict[str, str]], Any]              # (stream id, request, timeout ms, trace context)
    cancel: Callable[[int], Any]                                      # stream id -> the cancel message
    per_call: Callable[[Any, float | None], Any]                      # (request, timeout s) -> its own call, read ahead


class _Link:
    """One multiplexed call and the streams open on it."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.streams: dict[int, MuxStream] = {}
        # Opens and cancels are written by one task, in order. Never by a request's own task: gRPC cancels the whole
        # call when a task is cancelled while it awaits a write (grpc.aio's `_write`), and a request's task is
        # cancelled whenever its client goes away; every other stream on the call would fail with it.
        self.outbox: asyncio.Queue[Any] = asyncio.Queue()
        self.reader: asyncio.Task | None = None
        self.writer: asyncio.Task | None = None
        self.answered = asyncio.get_running_loop().create_future()  # the server's first word: its headers, or an end
        self.ended = False


class MuxStream:
    """One request on a multiplexed call."""

    def __init__(self, owner: "MultiplexClient", link: _Link, stream_id: int, timeout_s: float | None,
                 span: trace.Span | None) -> None:
        self.owner, self.link, self.stream_id = owner, link, stream_id
        self._timer = None if timeout_s is None else asyncio.get_running_loop().call_later(max(0.0, timeout_s), self._expire)
        self.span = span
        self.items: list[Any] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.ended = False
        self._waiter: asyncio.Future | None = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def put(self, response: Any) -> None:
        self.items.append(response)
        self._wake()

    def end(self, code: str, message: str, trailers: Mapping[str, str] | None = None) -> None:
        """The stream's end: OK, or the error `pending` raises once every chunk before it is read (with the
        trailers its call would have had)."""
        if self.ended:
            return
        self.ended = True
        if code != "OK":
            self.error = rpc_error(getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN), message, trailers)
        self._end_span()
        self._wake()

    def _expire(self) -> None:
        """The deadline passed with the stream still open (the server ends it too; whichever is first)."""
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

    async def pending(self) -> list[Any] | None:
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
        """Done with the stream: cancel it on the server (a worker frees its pages) unless it has ended."""
        if not self.ended:
            self.ended = True
            self._end_span()
            if self.link.streams.pop(self.stream_id, None) is not None:
                self.owner.cancel(self.link, self.stream_id)


class MultiplexClient:
    """Every request one caller sends one server, as streams of one multiplexed call (`ClientKind` says which)."""

    def __init__(self, kind: ClientKind, tracer: trace.Tracer | None = None, address: str = "") -> None:
        self.kind, self.address, self.tracer = kind, address, tracer
        self.unimplemented = False  # the server lacks the method: a call per request
        self._link: _Link | None = None
        self._ids = itertools.count(1)

    async def open(self, request: Any, timeout_s: float | None) -> Any:
        """Start `request` on the server; read what comes back with the stream's `pending()` (a `MuxStream`, or
        the kind's own call per request where the server lacks the method). The first open (and the first after
        the call broke) starts the call and waits for the server's headers: one round trip per connection, and no
        open written into a call the server refuses."""
        link = self._link if self._link is not None or self.unimplemented else self._connect()
        if link is not None and not link.answered.done():
            await asyncio.shield(link.answered)  # every open waits for a new call's first word
        if self.unimplemented or link is None:
            return self.kind.per_call(request, timeout_s)
        sid = next(self._ids)
        span, carrier = self._span()
        stream = MuxStream(self, link, sid, timeout_s, span)
        if link.ended:
            stream.end("UNAVAILABLE", f"the {self.kind.call_name} call ended")
            return stream
        if timeout_s is not None and timeout_s <= 0:
            stream.end("DEADLINE_EXCEEDED", "Deadline Exceeded")
            return stream
        link.streams[sid] = stream
        timeout_ms = 0 if timeout_s is None else min(MAX_TIMEOUT_MS, max(1, math.ceil(timeout_s * 1000)))
        link.outbox.put_nowait(self.kind.open(sid, request, timeout_ms, carrier))
        return stream

    def _span(self) -> tuple[trace.Span | None, dict[str, str]]:
        """The stream's CLIENT span (a child of the request's current span) and its W3C context to send."""
        carrier: dict[str, str] = {}
        if self.tracer is None:
            if propagate is not None:
                propagate.inject(carrier)  # the caller's own trace, if it has one: the server's span joins it
            return None, carrier
        span = self.tracer.start_span(self.kind.span_name, kind=trace.SpanKind.CLIENT, attributes=self.kind.attributes)
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        return span, carrier

    def _connect(self) -> _Link:
        link = self._link = _Link(self.kind.start())
        loop = asyncio.get_running_loop()
        link.reader = loop.create_task(self._read(link))
        link.writer = loop.create_task(self._write(link))
        return link

    async def _read(self, link: _Link) -> None:
        """Hand each chunk to its stream; when the call ends, every stream still on it fails."""
        code, message = grpc.StatusCode.UNAVAILABLE, f"the server ended the {self.kind.call_name} call"
        try:
            # The server sends its headers as the call starts; an older one ends it at once, UNIMPLEMENTED. No open
            # is written before one or the other (an open written into a call that is ending can turn its status
            # into gRPC's INTERNAL, and the UNIMPLEMENTED that says "call it per request" is lost).
            await link.call.initial_metadata()
            if link.call.done():  # ended with its headers: refused (an older build) or stopping
                status = await link.call.code()
                if status != grpc.StatusCode.OK:
                    code, message = status, await link.call.details() or status.name
                return
            if not link.answered.done():
                link.answered.set_result(None)
            log.debug("%s: %s call open", self.address, self.kind.call_name)
            async for response in link.call:
                for chunk in response.chunks:
                    stream = link.streams.get(chunk.stream_id)
                    if stream is None:
                        continue  # (cancelled here; what the server sent before the cancel reached it)
                    if chunk.HasField("end"):
                        del link.streams[chunk.stream_id]
                        stream.end(chunk.end.code, chunk.end.message, getattr(chunk.end, "trailers", None))
                    else:
                        stream.put(chunk.response)
        except grpc.aio.AioRpcError as err:
            code, message = err.code(), err.details() or err.code().name
        finally:
            if code == grpc.StatusCode.UNIMPLEMENTED:  # at once (with its headers) or later: the same answer
                self.unimplemented = True
                log.warning("%s has no %s (an older build): calling it per request", self.address, self.kind.call_name)
            link.ended = True
            if not link.answered.done():
                link.answered.set_result(None)
            if link.writer is not None:
                link.writer.cancel()  # (the call is over: nothing more to write)
            if self._link is link:
                self._link = None
            streams, link.streams = link.streams, {}
            if streams:
                log.warning("%s: its %s call ended (%s: %s) with %d streams open; they fail with it",
                            self.address, self.kind.call_name, code.name, message, len(streams))
            for stream in streams.values():
                stream.end(code.name, message)

    async def _write(self, link: _Link) -> None:
        """Write the call's opens and cancels in order, once the server has answered it."""
        await link.answered
        while True:
            message = await link.outbox.get()
            try:
                await link.call.write(message)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                # the call has ended (its reader fails the streams it knew); an open that raced it fails here
                if message.HasField("open") and (stream := link.streams.pop(message.open.stream_id, None)) is not None:
                    details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                    stream.end("UNAVAILABLE", f"the {self.kind.call_name} call ended: {details}")

    def cancel(self, link: _Link, stream_id: int) -> None:
        """Cancel a stream on the server (written after its open, by the call's writer)."""
        if not link.ended:
            link.outbox.put_nowait(self.kind.cancel(stream_id))
