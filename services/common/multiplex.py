"""The server's side of a multiplexed call: many streaming requests over one long-lived bidirectional gRPC call.
Two methods use it: the worker's `Multiplex` (how the gateway reaches a worker; `worker/multiplex.py` has the why)
and the gateway's `Session` (how the SDK's AsyncClient reaches the gateway; `gateway/session.py`). What differs
between them (their messages, the handler a stream runs, its span's name) is a `MultiplexKind`.

Each opened stream runs the method's handler for one request (the code a unary-request streaming call runs) on a
task of its own; its chunks and then its end (OK, or the status, message and trailers a call would have failed
with) are queued for the call's writer, which sends whatever is queued whenever it gets to write. A stream ends
early when the caller cancels it (the handler is cancelled, as a cancelled call's is: the worker aborts the request
in the engine), when its `timeout_ms` passes (DEADLINE_EXCEEDED), or when the call itself ends: the caller went
away, or the server stopped. Draining (the server stopping), the call refuses new streams with UNAVAILABLE and ends
once its streams have.

Tracing: the call itself is not traced (it is not a request); each stream's span is a SERVER span named as the
unary-request call's, a child of the span whose W3C context the open carried, so a request's trace reads as it
does over a call of its own. One log line per stream, as the per-call access log has one per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Protocol

import grpc
from opentelemetry import propagate, trace

from cotserve.common.server import error_status

log = logging.getLogger("cotserve.rpc")


@dataclass(frozen=True, slots=True)
class MultiplexKind:
    """One multiplexed method: the span and log name of its streams (the unary-request method they stand for), their
    rpc.* span attributes, and how its messages are made."""

    name: str
    attributes: dict[str, str]
    chunk: Callable[[int, Any], Any]                            # (stream id, a response) -> the chunk message
    end: Callable[[int, str, str, dict[str, str]], Any]         # (stream id, code, message, trailers) -> the chunk
    batch: Callable[[list[Any]], Any]                           # chunks -> the message written


class MultiplexHost(Protocol):
    """The servicer a multiplexed call belongs to: whether its server drains, and the calls open now."""

    draining: bool
    mux_calls: set


def drain_calls(host: MultiplexHost) -> None:
    """The server is stopping: `host`'s multiplexed calls refuse new streams (UNAVAILABLE) and end once the streams
    they carry have."""
    host.draining = True
    for call in list(host.mux_calls):
        call.drain()


class MultiplexCall:
    """One multiplexed call: its open streams (a task each) and the chunks ready for its next message. `run(open)`
    is the handler of one stream's request: its responses, in order; an exception ends the stream with its status."""

    def __init__(self, kind: MultiplexKind, host: MultiplexHost, context: grpc.aio.ServicerContext,
                 run: Callable[[Any], AsyncIterator[Any]], tracer: trace.Tracer | None, max_streams: int = 0,
                 limit_name: str = "") -> None:
        self.kind, self.host, self.context, self.run, self.tracer = kind, host, context, run, tracer
        self.max_streams = max_streams  # streams open at once at most (0: no limit); `limit_name` is its setting
        self.streams: dict[int, asyncio.Task] = {}
        self.ready: list[Any] = []
        self.reading = True  # the caller may still open streams
        self.draining = False
        self.limit_name = limit_name
        self._wake = asyncio.Event()

    async def serve(self, requests: AsyncIterator[Any]) -> None:
        """Read opens and cancels on a task; write what is ready until the caller is done (or the server drains)
        and every stream has ended. However the call ends, the streams still open are cancelled."""
        await self.context.send_initial_metadata(())  # at once: the caller writes nothing before it has them
        self.host.mux_calls.add(self)
        if self.host.draining:
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
                await self.context.write(self.kind.batch(chunks))
        finally:
            self.host.mux_calls.discard(self)
            reader.cancel()
            for task in self.streams.values():
                task.cancel()

    def drain(self) -> None:
        self.draining = True
        self._wake.set()

    async def _read(self, requests: AsyncIterator[Any]) -> None:
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

    def _put(self, chunk: Any) -> None:
        self.ready.append(chunk)
        self._wake.set()

    def _end(self, stream_id: int, code: str, message: str = "", trailers: dict[str, str] | None = None) -> None:
        self._put(self.kind.end(stream_id, code, message, trailers or {}))

    def _open(self, op: Any) -> None:
        if op.stream_id in self.streams:
            # (the open stream is the caller's; this one never started)
            self._end(op.stream_id, "INVALID_ARGUMENT", f"stream_id: {op.stream_id} is already open on this call")
        elif self.draining:
            self._end(op.stream_id, "UNAVAILABLE", "the server is shutting down")
        elif self.max_streams and len(self.streams) >= self.max_streams:
            self._end(op.stream_id, "RESOURCE_EXHAUSTED", f"{len(self.streams)} streams are open on this call, at most "
                      f"{self.max_streams} allowed ({self.limit_name}); open more once some have ended",
                      {"retry-after-ms": "100"})
        else:
            self.streams[op.stream_id] = asyncio.get_running_loop().create_task(self._stream(op))

    @contextlib.contextmanager
    def _span(self, op: Any) -> Iterator[trace.Span | None]:
        """The stream's SERVER span, current while it runs (the handler names it and adds what was asked)."""
        if self.tracer is None:
            yield None
            return
        with self.tracer.start_as_current_span(
                self.kind.name, context=propagate.extract(dict(op.trace_context)), kind=trace.SpanKind.SERVER,
                attributes=self.kind.attributes, record_exception=False, set_status_on_exception=False) as span:
            yield span

    async def _stream(self, op: Any) -> None:
        """One stream: its chunks, then its end (none when cancelled: the caller knows)."""
        sid, start, code, message, trailers = op.stream_id, time.monotonic(), "OK", "", {}
        try:
            with self._span(op) as span:
                try:
                    async with asyncio.timeout(op.timeout_ms / 1000 if op.timeout_ms else None):
                        async with aclosing(self.run(op)) as responses:
                            async for response in responses:
                                self._put(self.kind.chunk(sid, response))
                except TimeoutError:
                    code, message = "DEADLINE_EXCEEDED", f"deadline: {op.timeout_ms} ms passed"
                except Exception as exc:  # noqa: BLE001 - the stream's status, as a call's would be
                    code, message, pairs = error_status(exc)
                    trailers = dict(pairs)
                if span is not None and code != "OK":
                    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code}: {message}"))
            self._end(sid, code, message, trailers)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            if self.streams.get(sid) is asyncio.current_task():
                del self.streams[sid]
            self._wake.set()
            log.info("%s (multiplexed) %s %.1fms", self.kind.name, code, (time.monotonic() - start) * 1000)

