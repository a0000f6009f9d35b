"""`Client` (blocking) and `AsyncClient` (asyncio) for the cotserve gateway."""

from __future__ import annotations

from typing import AsyncIterator, Iterator, Mapping, Sequence

import grpc

from cotserve.common.multiplex_client import CallStream, ClientKind, MultiplexClient
from cotserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cotserve.sdk.errors import from_rpc_error
from cotserve.sdk.options import RequestOptions, Sampling, build_request, with_options
from cotserve.sdk.types import GenerateResult, ModelInfo, Reasoning, StreamChunk, chunk_from_pb, model_from_pb, result_from_pb


class _Base:
    def __init__(self, address: str, *, api_key: str | None = None, timeout_s: float | None = None) -> None:
        self.address = address
        self.api_key = api_key
        self.timeout_s = timeout_s

    def _call_opts(self, timeout_s: float | None, api_key: str | None) -> dict:
        key = api_key if api_key is not None else self.api_key
        return {
            "timeout": timeout_s if timeout_s is not None else self.timeout_s,
            "metadata": (("authorization", f"Bearer {key}"),) if key else None,
        }


def _pem(value: bytes | str | None) -> bytes | None:
    """PEM bytes as given, or read from the path given."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as fh:
        return fh.read()


def _credentials(tls: bool, root: bytes | str | None, cert: bytes | str | None, key: bytes | str | None):
    """Channel credentials (None: plaintext); giving any certificate implies TLS."""
    if not (tls or root is not None or cert is not None):
        return None
    if (cert is None) != (key is None):
        raise ValueError("client_cert / client_key: give both (mutual TLS) or neither")
    return grpc.ssl_channel_credentials(_pem(root), _pem(key), _pem(cert))


class Client(_Base):
    """Blocking client. `Client("127.0.0.1:50051").generate("37+48-12=", max_new_tokens=64)`.

    Every call takes `timeout_s` (the gRPC deadline) and `api_key`, overriding the client's defaults.
    `generate` and `stream` take a request's options as objects (`sampling=Sampling(...)`,
    `options=RequestOptions(...)`, `reasoning=Reasoning(...)`) or each field of `Sampling` and `RequestOptions` as a
    keyword of its own (`max_new_tokens=64, sla="batch"`; a keyword overrides the same field of an object given too):
    `pre_processor` / `post_processor` name sandbox modules run on the prompt / the completed text, `n` draws that
    many samples of the prompt (1..16; the result's `choices`, the chunks' `index`), `cache_salt` narrows who shares
    the worker's cached prompt blocks with this request, `reasoning=Reasoning(max_thinking_tokens=40)` budgets a
    reasoning model's thinking.
    Give a `prompt`, or `messages` (a chat: `[{"role": "user", "content": "..."}]`, each turn with `role`,
    `content` and optionally `reasoning_content`) that the model's chat template renders into its prompt.
    gRPC errors are raised as `cotserve.sdk.errors` exceptions that keep the code and message.
    `tls=True` speaks TLS, trusting the system's CAs, or `root_certificates` (PEM bytes or a file's path) when
    given; `client_cert` and `client_key` (PEM bytes or paths) are presented to a gateway that asks for mutual TLS.
    """

    def __init__(self, address: str, *, api_key: str | None = None, timeout_s: float | None = None, tls: bool = False,
                 root_certificates: bytes | str | None = None, client_cert: bytes | str | None = None,
                 client_key: bytes | str | None = None) -> None:
        super().__init__(address, api_key=api_key, timeout_s=timeout_s)
        creds = _credentials(tls, root_certificates, client_cert, client_key)
        self._channel = grpc.secure_channel(address, creds) if creds is not None else grpc.insecure_channel(address)
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)

    @with_options
    def generate(self, prompt: str = "", *, messages: Sequence[Mapping[str, str]] | None = None,
                 sampling: Sampling | None = None, options: RequestOptions | None = None, reasoning: Reasoning | None = None,
                 timeout_s: float | None = None, api_key: str | None = None) -> GenerateResult:
        req = build_request(gateway_pb2.GenerateRequest, prompt, messages, sampling, options, reasoning)
        try:
            return result_from_pb(self._stub.Generate(req, **self._call_opts(timeout_s, api_key)))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    @with_options
    def stream(self, prompt: str = "", *, messages: Sequence[Mapping[str, str]] | None = None,
               sampling: Sampling | None = None, options: RequestOptions | None = None, reasoning: Reasoning | None = None,
               timeout_s: float | None = None, api_key: str | None = None) -> Iterator[StreamChunk]:
        """Yield one chunk per token; closing the iterator early cancels the request."""
        req = build_request(gateway_pb2.GenerateStreamRequest, prompt, messages, sampling, options, reasoning)
        call = self._stub.GenerateStream(req, **self._call_opts(timeout_s, api_key))
        try:
            for chunk in call:
                yield chunk_from_pb(chunk)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()

    def list_models(self, *, timeout_s: float | None = None, api_key: str | None = None) -> list[ModelInfo]:
        try:
            resp = self._stub.ListModels(gateway_pb2.ListModelsRequest(), **self._call_opts(timeout_s, api_key))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return [model_from_pb(m) for m in resp.models]

    def tokenize(self, text: str, *, model: str = "", timeout_s: float | None = None, api_key: str | None = None) -> list[int]:
        try:
            resp = self._stub.Tokenize(gateway_pb2.TokenizeRequest(text=text, model=model), **self._call_opts(timeout_s, api_key))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return list(resp.token_ids)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def session_kind(stub: gateway_pb2_grpc.GatewayServiceStub, metadata) -> ClientKind:
    """The gateway's `Session` as the SDK calls it (the client's API key on the call), and a GenerateStream call
    where the gateway has none. The SDK records no spans (no span name); a stream's open carries the caller's own
    trace context, if it has one."""
    return ClientKind(
        "Session", "", {}, start=lambda: stub.Session(metadata=metadata),
        open=lambda sid, request, timeout_ms, carrier: gateway_pb2.SessionRequest(open=gateway_pb2.SessionOpen(
            stream_id=sid, request=request, timeout_ms=timeout_ms, trace_context=carrier)),
        cancel=lambda sid: gateway_pb2.SessionRequest(cancel=gateway_pb2.SessionCancel(stream_id=sid)),
        per_call=lambda request, timeout_s: CallStream(stub.GenerateStream(request, timeout=timeout_s, metadata=metadata)))


class AsyncClient(_Base):
    """The same API as `Client`, as coroutines and async iterators (`async with AsyncClient(...)`).

    `multiplex=True`: every `stream` (with the client's own API key) is a stream of one long-lived `Session` call
    to the gateway instead of a GenerateStream call of its own: no call to set up per request, which under a flood
    of other clients' calls kept an urgent request's p99 time to first token at about half the per-call figure
    (`gateway/session.py`). The chunks, errors and deadlines are the same. A stream's chunks are read as they come
    whether or not its iterator is being read (a call of its own would hold them back in gRPC's flow control
    instead), so read each stream you open, or close it. A gateway without `Session` (an older build) is called per
    request. Off by default."""

    def __init__(self, address: str, *, api_key: str | None = None, timeout_s: float | None = None, tls: bool = False,
                 root_certificates: bytes | str | None = None, client_cert: bytes | str | None = None,
                 client_key: bytes | str | None = None, multiplex: bool = False) -> None:
        super().__init__(address, api_key=api_key, timeout_s=timeout_s)
        creds = _credentials(tls, root_certificates, client_cert, client_key)
        self._channel = grpc.aio.secure_channel(address, creds) if creds is not None else grpc.aio.insecure_channel(address)
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)
        self._session = (MultiplexClient(session_kind(self._stub, self._call_opts(None, None)["metadata"]),
                                         address=f"gateway {address}") if multiplex else None)

    @with_options
    async def generate(self, prompt: str = "", *, messages: Sequence[Mapping[str, str]] | None = None,
                       sampling: Sampling | None = None, options: RequestOptions | None = None, reasoning: Reasoning | None = None,
                       timeout_s: float | None = None, api_key: str | None = None) -> GenerateResult:
        req = build_request(gateway_pb2.GenerateRequest, prompt, messages, sampling, options, reasoning)
        try:
            return result_from_pb(await self._stub.Generate(req, **self._call_opts(timeout_s, api_key)))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    @with_options
    async def stream(self, prompt: str = "", *, messages: Sequence[Mapping[str, str]] | None = None,
                     sampling: Sampling | None = None, options: RequestOptions | None = None, reasoning: Reasoning | None = None,
                     timeout_s: float | None = None, api_key: str | None = None) -> AsyncIterator[StreamChunk]:
        req = build_request(gateway_pb2.GenerateStreamRequest, prompt, messages, sampling, options, reasoning)
        if self._session is not None and (api_key is None or api_key == self.api_key):
            try:
                stream = await self._session.open(req, timeout_s if timeout_s is not None else self.timeout_s)
                try:
                    while (items := await stream.pending()) is not None:
                        for item in items:
                            yield chunk_from_pb(item)
                finally:
                    stream.close()
            except grpc.RpcError as err:
                raise from_rpc_error(err) from None
            return
        call = self._stub.GenerateStream(req, **self._call_opts(timeout_s, api_key))
        try:
            async for chunk in call:
                yield chunk_from_pb(chunk)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()

    async def list_models(self, *, timeout_s: float | None = None, api_key: str | None = None) -> list[ModelInfo]:
        try:
            resp = await self._stub.ListModels(gateway_pb2.ListModelsRequest(), **self._call_opts(timeout_s, api_key))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return [model_from_pb(m) for m in resp.models]

    async def tokenize(self, text: str, *, model: str = "", timeout_s: float | None = None,
                       api_key: str | None = None) -> list[int]:
        try:
            resp = await self._stub.Tokenize(gateway_pb2.TokenizeRequest(text=text, model=model),
                                             **self._call_opts(timeout_s, api_key))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return list(resp.token_ids)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
