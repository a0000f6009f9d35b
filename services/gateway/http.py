"""The gateway's OpenAI-compatible HTTP API (`--http-port`): `POST /v1/chat/completions`, `POST /v1/completions`,
`GET /v1/models` (and `/v1/models/{id}`), `GET /health` and `GET /openapi.json` (`gateway/openapi.py`), served by
aiohttp on the gateway's
own event loop beside its gRPC server.

Every request goes through the same relay as a gRPC one (`gateway/relay.py`): the tenant's key
(`Authorization: Bearer`), admission, quotas, pre- and post-processors, the worker call with its retry, metrics,
and the trace (a W3C `traceparent` header parents the request's span). Errors are OpenAI's error object
(`{"error": {"message", "type", "param", "code"}}`) with the status the gRPC code maps to (400, 401, 403, 404,
429 with Retry-After, 503, 504); after a stream has started, an error is sent as one last `data: {"error": ...}`
event before `data: [DONE]`.

Why aiohttp: a maintained asyncio HTTP/1.1 server that runs as a site on an event loop someone else owns (the
gateway's, which grpc.aio drives), streams responses without a framework between it and the socket, and needs no
ASGI server process of its own; uvicorn + an ASGI framework would add a second server runtime to configure and a
layer per request for the same four routes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import traceback
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from aiohttp import web
from opentelemetry import propagate, trace

from cotserve.common.errors import CotserveError, NotFound
from cotserve.gateway.openai_api import PARAM_OF, ApiError, Responder, models_json, parse
from cotserve.gateway.relay import Relay
from cotserve.gateway.v1 import gateway_pb2

log = logging.getLogger("cotserve.http")

STATUS_OF = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401,
             "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499,
             "UNIMPLEMENTED": 501, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
"""gRPC status code -> HTTP status of the same error."""
_TYPE_OF = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


MAX_TIMEOUT_MS = 24 * 3600 * 1000
"""The longest deadline `TIMEOUT_HEADER` may ask for (a day)."""


class HttpError(Exception):
    """A request the HTTP layer refuses before it becomes one (the body's size, type or arrival): `status`, and the
    OpenAI error object's message and code."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def response(self) -> web.Response:
        return _json_response(self.status, {"error": {"message": self.message, "type": "invalid_request_error",
                                                      "param": None, "code": self.code}})


TIMEOUT_HEADER = "x-envoy-expected-rq-timeout-ms"
"""The request's deadline, in milliseconds from its arrival: the header Envoy sets from its route's timeout (a
client may send it too). Without it a request has no deadline: a client that gives up closes the connection,
which cancels the request."""


class HttpCall:
    """An HTTP request as the relay's `Call`: its headers are the metadata, `TIMEOUT_HEADER` its deadline."""

    def __init__(self, request: web.Request) -> None:
        self._metadata = [(k.lower(), v) for k, v in request.headers.items()]
        timeout = request.headers.get(TIMEOUT_HEADER)
        self._deadline = None
        if timeout is not None:
            if not timeout.isdigit() or len(timeout) > 12 or not 1 <= int(timeout) <= MAX_TIMEOUT_MS:
                raise ApiError(None, f"{TIMEOUT_HEADER}: {timeout[:40]!r}, expected milliseconds (an integer "
                                     f"1..{MAX_TIMEOUT_MS})")
            self._deadline = time.monotonic() + int(timeout) / 1000

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())


def _param(message: str) -> str | None:
    """The field an error message names, in this API's terms (messages begin `field: ...`)."""
    head = message.partition(":")[0]
    for name, param in PARAM_OF.items():
        if head == name or head.startswith(name + ".") or head.startswith(name + "["):
            return param + head[len(name):]
    return None


def error_body(exc: CotserveError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, OpenAI error object, headers) of an error."""
    status = STATUS_OF.get(exc.code, 500)
    param = exc.param if isinstance(exc, ApiError) else _param(exc.message)
    message = exc.message
    if param is not None and not isinstance(exc, ApiError):
        head, _, rest = message.partition(":")
        message = f"{param}:{rest}" if head != param else message
    code = {404: "model_not_found" if param == "model" else "not_found", 401: "invalid_api_key"}.get(status, exc.code.lower())
    headers: dict[str, str] = {}
    retry_ms = exc.trailers.get("retry-after-ms")
    if retry_ms is not None:
        headers = {"Retry-After": str(max(1, math.ceil(int(retry_ms) / 1000))), "retry-after-ms": retry_ms}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    kind = _TYPE_OF.get(status, "server_error")
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}, headers


def _internal(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    error_id = uuid.uuid4().hex[:16]
    # the exception's type and where it was raised, not its message: that may quote the request (a prompt)
    log.error("internal error %s: %s\n%s", error_id, type(exc).__name__, "".join(traceback.format_tb(exc.__traceback__)))
    message = f"internal error (error id {error_id}; the service's log has the details)"
    return 500, {"error": {"message": message, "type": "server_error", "param": None, "code": "internal"}}, {}


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def client_request_id(value: str | None) -> str | None:
    """A client's `x-request-id`, kept as the response's id and header when it is 1..128 of letters, digits and
    `._:-` (anything else is replaced by one of the gateway's own)."""
    return value if value is not None and _REQUEST_ID.fullmatch(value) else None


def _json_response(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=json.dumps(body, ensure_ascii=False).encode(),
                        content_type="application/json", headers=headers)


def check_text(data: Any) -> None:
    """ApiError naming the field of the first string that is not valid text (a lone surrogate, which JSON's
    \\u escapes can spell but UTF-8 cannot). Iterative: no depth limit of its own."""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(path or None, "not valid text (a lone surrogate, e.g. \\ud800)") from None
        elif isinstance(value, dict):
            todo += [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
            todo += [(path or "request body", k) for k in value]
        elif isinstance(value, list):
            todo += [(f"{path}[{i}]", v) for i, v in enumerate(value)]


def _sse(event: dict[str, Any] | str) -> bytes:
    return b"data: " + (event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)).encode() + b"\n\n"


class PerClientCap(asyncio.Protocol):
    """The connection as aiohttp's request handler sees it, unless its client address already holds `limit` open
    connections: then it is answered 429 in OpenAI's error shape and closed before a byte of it is read, so one
    address cannot hold every file descriptor of the gateway with connections that never send a request."""

    def __init__(self, handler: asyncio.Protocol, open_by_client: dict[str, int], limit: int) -> None:
        self.handler, self.open_by_client, self.limit = handler, open_by_client, limit
        self.client: str | None = None  # set while this connection counts against its address

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if self.open_by_client.get(client, 0) >= self.limit:
            body = json.dumps({"error": {"message": f"too many open connections from this address (limit "
                                                    f"{self.limit}, --http-max-connections-per-client)",
                                         "type": _TYPE_OF[429], "param": None, "code": "too_many_connections"}})
            transport.write(f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"  # type: ignore[attr-defined]
                            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode())
            transport.close()
            return
        self.client = client
        self.open_by_client[client] = self.open_by_client.get(client, 0) + 1
        self.handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client is None:
            return
        left = self.open_by_client[self.client] - 1
        if left:
            self.open_by_client[self.client] = left
        else:
            del self.open_by_client[self.client]
        self.client = None
        self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.client is not None:
            self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.client is not None else None

    def pause_writing(self) -> None:
        if self.client is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.client is not None:
            self.handler.resume_writing()


class CappedSite(web.TCPSite):
    """aiohttp's TCP site with each connection behind a `PerClientCap`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, ssl_context: Any, max_per_client: int) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context)
        self.max_per_client = max_per_client
        self.open_by_client: dict[str, int] = {}

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner; TCPSite.start would bind the plain one
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: PerClientCap(server(), self.open_by_client, self.max_per_client), self._host, self._port,
            ssl=self._ssl_context, backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)
        self._bound_port = self._server.sockets[0].getsockname()[1]


class OpenAIServer:
    """The HTTP API on `host:port` (0 picks a free one; `port` is the bound one once started)."""

    def __init__(self, relay: Relay, host: str, port: int, max_body_bytes: int, ssl_context: Any = None,
                 body_timeout_s: float = 30.0, max_connections_per_client: int = 1024) -> None:
        self.relay, self.host, self.port, self.max_body_bytes = relay, host, port, max_body_bytes
        self.body_timeout_s = body_timeout_s  # a request body must have arrived within this long
        self.max_connections_per_client = max_connections_per_client
        self.ssl_context = ssl_context  # HTTPS with the gateway's certificate when it has one
        self.started = int(time.time())  # the models' `created`: when this gateway began serving them
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_get("/health", self._health)
        app.router.add_get("/openapi.json", self._openapi)
        # handler_cancellation: a client that disconnects cancels its request, streamed or not (the worker's pages
        # are freed at its next step)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = CappedSite(self._runner, self.host, self.port, ssl_context=self.ssl_context,
                          max_per_client=self.max_connections_per_client)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise OSError(f"http_port: cannot bind {self.host}:{self.port} ({exc.strerror})") from None
        self.port = site.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every answer an OpenAI client can read: routing errors and unexpected failures as error objects too,
        and one log line per request."""
        start = time.monotonic()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status, "invalid_request_error")
            message = f"{request.method} {request.path}: {exc.reason}"
            return _json_response(exc.status, {"error": {"message": message, "type": kind, "param": None,
                                                         "code": exc.reason.lower().replace(" ", "_")}})
        except asyncio.CancelledError:
            status = 499
            raise
        except Exception as exc:  # noqa: BLE001 - a bug must not take the server down
            status, body, headers = _internal(exc)
            return _json_response(status, body, headers)
        finally:
            log.info("%s %s %d %.1fms", request.method, request.path, status, (time.monotonic() - start) * 1000)

    async def _body(self, request: web.Request) -> Any:
        """The whole JSON body, however it arrives (in pieces, chunked), up to `max_body_bytes` (413 past it), of
        Content-Type application/json (415 otherwise), within `body_timeout_s` (408); its strings valid text."""
        if request.content_type != "application/json":
            raise HttpError(415, f"Content-Type: {request.content_type[:80]!r}, expected application/json",
                            "unsupported_media_type")
        length = request.content_length
        if length is not None and length > self.max_body_bytes:
            raise HttpError(413, f"request body: {length} bytes, at most {self.max_body_bytes} allowed",
                            "request_too_large")
        try:
            raw = await asyncio.wait_for(self._read_all(request), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise HttpError(408, f"request body: not received within {self.body_timeout_s:g} s", "request_timeout") from None
        try:
            data = json.loads(raw)
        except RecursionError:
            raise ApiError(None, "request body: nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(None, f"request body: not valid JSON ({exc})") from None
        check_text(data)
        return data

    async def _read_all(self, request: web.Request) -> bytes:
        parts, size = [], 0
        while chunk := await request.content.read(1 << 16):
            size += len(chunk)
            if size > self.max_body_bytes:
                raise HttpError(413, f"request body: over {self.max_body_bytes} bytes, at most {self.max_body_bytes} "
                                     "allowed", "request_too_large")
            parts.append(chunk)
        return b"".join(parts)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self.relay.authenticate(HttpCall(request))
        except CotserveError as exc:
            status, body, headers = error_body(exc)
            return _json_response(status, body, headers)
        return _json_response(200, models_json(self.relay.pool.models(), self.started))

    async def _model(self, request: web.Request) -> web.Response:
        """`GET /v1/models/{id}`: one served name or alias, or 404 naming what is served."""
        try:
            self.relay.authenticate(HttpCall(request))
            wanted = request.match_info["model"]
            for entry in models_json(self.relay.pool.models(), self.started)["data"]:
                if entry["id"] == wanted:
                    return _json_response(200, entry)
            self.relay.pool.resolve_model(wanted)  # raises NotFound naming the served models
            raise NotFound(f"model: {wanted!r} is not served here")
        except CotserveError as exc:
            status, body, headers = error_body(exc)
            return _json_response(status, body, headers)

    async def _health(self, request: web.Request) -> web.Response:
        healthy = any(w.healthy for w in self.relay.pool.workers)
        return _json_response(200 if healthy else 503, {"status": "SERVING" if healthy else "NOT_SERVING"})

    async def _openapi(self, request: web.Request) -> web.Response:
        """This API's OpenAPI document (`gateway/openapi.py`); public, as the API's shape is no secret."""
        from importlib.metadata import version

        from cotserve.gateway.openapi import document

        return _json_response(200, document(version("cotserve")))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        context = propagate.extract(request.headers)
        with self.relay.tracer.start_as_current_span(f"{request.method} {request.path}", context=context,
                                                     kind=trace.SpanKind.SERVER) as span:
            span.set_attributes({"http.request.method": request.method, "url.path": request.path})
            response = await self._serve(request, kind, span)
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def _serve(self, request: web.Request, kind: str, span) -> web.StreamResponse:
        """Read, relay, answer: an error before the first chunk is an HTTP error; a stream's later one an event."""
        request_id = client_request_id(request.headers.get("x-request-id")) or uuid.uuid4().hex
        try:
            api = parse(kind, await self._body(request))
            if api.user:
                span.set_attribute("cotserve.user", api.user)
            model = self.relay.pool.resolve_model(api.request.model)
            call = HttpCall(request)
        except HttpError as exc:
            return exc.response()
        except CotserveError as exc:
            return self._failed(span, exc)
        info = next(w.info for w in self.relay.pool.models()[model])
        responder = Responder(api, request_id, model, (info.reasoning_start, info.reasoning_end))
        async with aclosing(self.relay.counted(api.request, call)) as chunks:
            try:
                first = await anext(chunks, None)
            except CotserveError as exc:
                return self._failed(span, exc)
            if api.stream:
                return await self._stream(request, responder, first, chunks, span)
            try:
                whole = [first] if first is not None else []
                whole += [chunk async for chunk in chunks]
            except CotserveError as exc:
                return self._failed(span, exc)
            return _json_response(200, responder.whole(whole), {"x-request-id": request_id})

    @staticmethod
    def _failed(span, exc: CotserveError) -> web.Response:
        status, body, headers = error_body(exc)
        span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
        return _json_response(status, body, headers)

    async def _stream(self, request: web.Request, responder: Responder, first: gateway_pb2.GenerateStreamResponse | None,
                      chunks: AsyncIterator[gateway_pb2.GenerateStreamResponse], span) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={**_SSE_HEADERS, "x-request-id": responder.request_id})
        await response.prepare(request)
        try:
            if first is not None:
                await response.write(b"".join(_sse(e) for e in responder.chunk(first)))
            async for chunk in chunks:
                await response.write(b"".join(_sse(e) for e in responder.chunk(chunk)))
        except CotserveError as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
            await response.write(_sse(error_body(exc)[1]))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes out as its last event
            await response.write(_sse(_internal(exc)[1]))
        await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response
