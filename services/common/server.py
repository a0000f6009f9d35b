"""How every cotserve service starts: grpc.aio server, error interceptor, health, reflection,
graceful stop on SIGTERM. A service is a servicer plus a config dataclass."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from opentelemetry.sdk.trace import TracerProvider

from cotserve.common.errors import CotserveError
from cotserve.common.tracing import server_interceptors

log = logging.getLogger("cotserve.rpc")


def _status(exc: CotserveError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, CotserveError):
        await context.abort(_status(exc), exc.message, trailing_metadata=tuple(exc.trailers.items()))
    log.error("internal error: %r", exc, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns `CotserveError` into its status, anything else into INTERNAL (logged once), and logs
    one INFO line per request: method, status, duration."""

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(("/grpc.health", "/grpc.reflection")):
            return handler
        method = details.method
        kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start, code = time.monotonic(), "OK"
                try:
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


@dataclass(slots=True)
class ServiceSpec:
    """One gRPC service to host: its full name (for health and reflection) and how to add it."""

    name: str
    add: Callable[[grpc.aio.Server], None]


class Server:
    """A running service. Health starts NOT_SERVING and turns SERVING on `set_serving()`."""

    def __init__(self, specs: list[ServiceSpec], host: str, port: int, tracer_provider: TracerProvider | None = None) -> None:
        interceptors = [*server_interceptors(tracer_provider), ErrorInterceptor()]
        self.server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for spec in specs:
            spec.add(self.server)
        self.names = [s.name for s in specs]
        self.tracer_provider = tracer_provider
        reflection.enable_server_reflection([*self.names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise OSError(f"port: cannot bind {host}:{port} (in use, or not an address of this machine)")
        self.address = f"{host}:{self.port}"

    async def _set(self, status: int) -> None:
        for name in ["", *self.names]:
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def start(self) -> None:
        await self.server.start()
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def set_serving(self) -> None:
        await self._set(health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush(2000)


async def run_until_signalled(server: Server, grace_s: float, on_stop: Callable[[], Awaitable[None] | None] | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain in-flight calls for up to `grace_s` seconds."""
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
