"""How every cotserve service starts: grpc.aio server, error interceptor, health, reflection,
graceful stop on SIGTERM. A service is a servicer plus a config dataclass."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from google.protobuf.message import DecodeError
from grpc_reflection.v1alpha import reflection

from opentelemetry.sdk.trace import TracerProvider

from cotserve.common.heap import freeze_startup_heap
from cotserve.common.lifetime import ADDRESS_FILE_ENV
from cotserve.common.authz import AuthzInterceptor
from cotserve.common.errors import CotserveError, InvalidArgument
from cotserve.common.tls import TlsSettings
from cotserve.common.tracing import server_interceptors

log = logging.getLogger("cotserve.rpc")
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
"""The largest request message a service accepts unless its config says otherwise (gRPC's own default,
set explicitly so that every server states it); larger ones are RESOURCE_EXHAUSTED before any work."""


def error_status(exc: BaseException) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """The status a handler's exception ends its call with: a `CotserveError`'s own code, message and trailers, or
    INTERNAL for anything else. The exception's text can name internal addresses, paths or data: it goes to the log
    under an id that the client gets instead, so an operator can find the one from the other."""
    if isinstance(exc, CotserveError):
        return exc.code, exc.message, tuple(exc.trailers.items())
    error_id = uuid.uuid4().hex[:16]
    log.error("internal error %s: %r", error_id, exc, exc_info=exc)
    return ("INTERNAL", f"internal error (error id {error_id}; the service's log has the details)",
            (("error-id", error_id),))


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, message, trailers = error_status(exc)
    await context.abort(getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL), message, trailing_metadata=trailers)


_INFRASTRUCTURE = ("/grpc.health", "/grpc.reflection")  # methods the interceptors leave as gRPC made them


class _Undecodable:
    """What a request that failed to parse becomes, so the handler can answer INVALID_ARGUMENT
    (gRPC itself would answer a deserializer's exception with a bare UNKNOWN/INTERNAL)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as exc:
            return _Undecodable(str(exc))
    return parse


def _check_decoded(request: Any) -> None:
    if isinstance(request, _Undecodable):
        why = request.reason.rpartition(": ")[2] or request.reason
        hint = " (every string field must be valid UTF-8)" if "UTF-8" in why else ""
        raise InvalidArgument(f"request: not a valid message: {why}{hint}")


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns `CotserveError` into its status, anything else into INTERNAL (logged once), and logs
    one INFO line per request: method, status, duration."""

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_INFRASTRUCTURE):
            return handler
        method = details.method
        kwargs = dict(request_deserializer=_tolerant(handler.request_deserializer),
                      response_serializer=handler.response_serializer)
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start, code = time.monotonic(), "OK"
                try:
                    _check_decoded(request)
                    return await inner(request, context)
                except grpc.aio.AbortError:
                    code = "ABORTED_BY_HANDLER"
                    raise
                except Exception as exc:  # noqa: BLE001
                    code = exc.code if isinstance(exc, CotserveError) else "INTERNAL"
                    await _abort(context, exc)
                finally:
                    log.info("%s %s %.1fms", method, code, (time.monotonic() - start) * 1000)

            return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start, code = time.monotonic(), "OK"
                try:
                    _check_decoded(request)
                    async for item in inner_stream(request, context):
                        yield item
                except grpc.aio.AbortError:
                    code = "ABORTED_BY_HANDLER"
                    raise
                except asyncio.CancelledError:
                    code = "CANCELLED"
                    raise
                except Exception as exc:  # noqa: BLE001
                    code = exc.code if isinstance(exc, CotserveError) else "INTERNAL"
                    await _abort(context, exc)
                finally:
                    log.info("%s %s %.1fms", method, code, (time.monotonic() - start) * 1000)

            return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
        return handler


class StreamCloser(grpc.aio.ServerInterceptor):
    """The outermost interceptor: runs each server-streaming handler as a coroutine that writes its
    responses and always closes the handler's generator itself, in the call's own task.

    gRPC iterates a streaming handler but does not close it when the call is cancelled while a
    response is being sent: the generator (the OpenTelemetry interceptor's among them) is then
    finalized later by the garbage collector in another task, where OpenTelemetry cannot detach the
    context it attached ("Failed to detach context", one 18-line error per cancelled stream) and
    the span ends late. Closing it here ends every stream's span on time, in the right context."""

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not handler.unary_stream or details.method.startswith(_INFRASTRUCTURE):
            return handler
        inner = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> None:
            responses = inner(request, context)
            if not inspect.isasyncgen(responses):  # a handler that writes for itself
                await responses
                return
            try:
                async for item in responses:
                    await context.write(item)
            finally:
                await responses.aclose()

        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)


def _bind(server: grpc.aio.Server, host: str, port: int, credentials: Any, setting: str) -> int:
    """Add host:port to `server` (over TLS with `credentials`); the port bound, OSError naming `setting` if none."""
    try:
        bound = (server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
                 else server.add_insecure_port(f"{host}:{port}"))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"{setting}: cannot bind {host}:{port} (in use, or not an address of this machine)")
    return bound


@dataclass(slots=True)
class ServiceSpec:
    """One gRPC service to host: its full name (for health and reflection) and how to add it."""

    name: str
    add: Callable[[grpc.aio.Server], None]


class Server:
    """A running service. Health starts NOT_SERVING and turns SERVING on `set_serving()`."""

    def __init__(self, specs: list[ServiceSpec], host: str, port: int, tracer_provider: TracerProvider | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: TlsSettings | None = None) -> None:
        interceptors = [StreamCloser(), *server_interceptors(tracer_provider), ErrorInterceptor()]
        if tls is not None and tls.tls_client_ca is not None:  # callers present certificates: authorize them
            interceptors.insert(0, AuthzInterceptor())
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_message_bytes)])
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for spec in specs:
            spec.add(self.server)
        self.names = [s.name for s in specs]
        self.tracer_provider = tracer_provider
        self.on_stop: list[Callable[[], None]] = []
        """Called as `stop` begins (before gRPC's own drain): what a servicer ends by itself, e.g. long-lived calls
        that carry many requests and would otherwise hold the drain open for the whole grace period."""
        reflection.enable_server_reflection([*self.names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        credentials = tls.server_credentials() if tls is not None else None
        self.tls = credentials is not None
        self.port = _bind(self.server, host, port, credentials, "port")
        self.address = f"{host}:{self.port}"
        self.health_server: grpc.aio.Server | None = None
        """The plaintext health-only port (`TlsSettings.health_port`): the same health states, nothing else."""
        self.health_port = 0
        if tls is not None and tls.health_port:
            self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = _bind(self.health_server, host, tls.health_port, None, "health_port")

    async def _set(self, status: int) -> None:
        for name in ["", *self.names]:
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def start(self) -> None:
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        report = os.environ.pop(ADDRESS_FILE_ENV, None)
        if report:
            tmp = f"{report}.tmp"
            with open(tmp, "w") as fh:
                fh.write(self.address)
            os.replace(tmp, report)

    async def set_serving(self) -> None:
        await self._set(health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float) -> None:
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        for drain in self.on_stop:
            drain()
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush(2000)


async def run_until_signalled(server: Server, grace_s: float, on_stop: Callable[[], Awaitable[None] | None] | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain in-flight calls for up to `grace_s` seconds. Start-up is over when it is
    called: the heap start-up left is frozen first (`common.heap`)."""
    freeze_startup_heap(f"service on {server.address}")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger("cotserve").info("stopping (grace %.1fs)", grace_s)
    await server.stop(grace_s)
    if on_stop is not None:
        result = on_stop()
        if asyncio.iscoroutine(result):
            await result
