"""The gateway service: the gRPC servicer over the relay (`gateway/relay.py`), the OpenAI HTTP API beside it
(`gateway/http.py`), and the service's start and stop."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from cotserve.common.errors import RelayedError
from cotserve.common.metrics import MetricsServer, serve_metrics
from cotserve.common.multiplex import MultiplexCall, drain_calls
from cotserve.common.server import Server, ServiceSpec, run_until_signalled
from cotserve.common.tracing import make_tracer_provider
from cotserve.gateway.config import GatewayConfig
from cotserve.gateway.http import OpenAIServer
from cotserve.gateway.metrics import GatewayMetrics
from cotserve.gateway.pool import Resolver, WorkerPool, resolve_dns
from cotserve.gateway.processors import Processors
from cotserve.gateway.quota import QuotaEnforcer
from cotserve.gateway.relay import Relay
from cotserve.gateway.session import session_call
from cotserve.gateway.rules import Authenticate, Chain, Grant, PreProcess, Quota, WorkerAdmission
from cotserve.gateway.slo_link import SloLink
from cotserve.gateway.slo_rules import BatchHold, BatchPauses, InteractiveShed
from cotserve.gateway.tenants import TenantRegistry
from cotserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cotserve.worker.v1 import worker_pb2

log = logging.getLogger("cotserve.gateway")


async def collect(chunks: AsyncIterator[gateway_pb2.GenerateStreamResponse]) -> gateway_pb2.GenerateResponse:
    """A whole stream as one response: each sample's chunks joined into its choice, usage and timing from the last
    chunk, the first sample also in the single-completion fields."""
    resp = gateway_pb2.GenerateResponse()
    choices: dict[int, gateway_pb2.Choice] = {}
    texts: dict[int, list[str]] = {}
    async for chunk in chunks:
        choice = choices.get(chunk.index)
        if choice is None:
            choice = choices[chunk.index] = gateway_pb2.Choice(index=chunk.index)
        texts.setdefault(chunk.index, []).append(chunk.text)
        choice.token_ids.extend(chunk.token_ids)  # (none when withheld, none on a cancelled sample's last chunk)
        choice.logprobs.extend(chunk.logprobs)
        choice.token_logprobs.extend(chunk.token_logprobs)
        choice.tool_calls.extend(chunk.tool_calls)
        if chunk.finish_reason:
            choice.finish_reason = chunk.finish_reason
        if chunk.HasField("reasoning_text"):
            choice.reasoning_text, choice.answer_text = chunk.reasoning_text, chunk.answer_text
        if chunk.HasField("self_consistency"):
            resp.self_consistency.CopyFrom(chunk.self_consistency)
        if chunk.HasField("usage"):
            resp.usage.CopyFrom(chunk.usage)
            resp.timing.CopyFrom(chunk.timing)
    for index in sorted(choices):
        choices[index].text = "".join(texts[index])
        resp.choices.append(choices[index])
    if resp.choices:
        first = resp.choices[0]
        resp.text, resp.finish_reason = first.text, first.finish_reason
        if first.HasField("reasoning_text"):
            resp.reasoning_text, resp.answer_text = first.reasoning_text, first.answer_text
        if resp.HasField("self_consistency"):
            resp.answer_text = resp.self_consistency.answer
        resp.token_ids.extend(first.token_ids)
        resp.logprobs.extend(first.logprobs)
    return resp


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    """The gateway's gRPC API: each call handed to the relay with its servicer context as the `Call` (a Session's
    streams each with a `session.SessionStream`)."""

    def __init__(self, relay: Relay, traced: bool = False, max_session_streams: int = 0) -> None:
        self.relay = relay
        self.traced = traced
        self.max_session_streams = max_session_streams  # streams one Session call may have open at once (0: any)
        self.mux_calls: set[MultiplexCall] = set()  # the Session calls open now (each adds and removes itself)
        self.draining = False

    async def Session(self, requests: AsyncIterator[gateway_pb2.SessionRequest],
                      context: grpc.aio.ServicerContext) -> None:
        await session_call(self, context, self.relay.tracer if self.traced else None).serve(requests)

    def drain(self) -> None:
        """The server is stopping: Session calls refuse new streams (UNAVAILABLE) and end once the streams they
        carry have."""
        drain_calls(self)

    async def GenerateStream(self, request: gateway_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        async for chunk in self.relay.counted(request, context):
            yield chunk

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.GenerateResponse:
        return await collect(self.relay.counted(request, context))

    async def ListModels(self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        self.relay.authenticate(context)
        pool = self.relay.pool
        resp = gateway_pb2.ListModelsResponse()
        for name, workers in sorted(pool.models().items()):
            info = workers[0].info
            resp.models.add(name=name, revision=info.model_revision, max_context_tokens=info.max_context_tokens,
                            num_healthy_workers=sum(w.healthy for w in workers),
                            aliases=sorted({a for w in workers for a in w.info.model_aliases}))
        return resp

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.TokenizeResponse:
        self.relay.authenticate(context)
        pool = self.relay.pool
        worker = pool.pick(pool.resolve_model(request.model))
        try:
            resp = await worker.stub.Tokenize(worker_pb2.TokenizeRequest(text=request.text, add_special_tokens=True),
                                              timeout=context.time_remaining())
        except grpc.aio.AioRpcError as err:
            raise RelayedError(err.code().name, err.details() or err.code().name) from None
        return gateway_pb2.TokenizeResponse(token_ids=resp.token_ids)


@dataclass(slots=True)
class RunningGateway:
    server: Server
    pool: WorkerPool
    metrics: GatewayMetrics
    metrics_server: MetricsServer | None = None
    quota: QuotaEnforcer | None = None
    processors: Processors | None = None
    slo: SloLink | None = None
    http: OpenAIServer | None = None
    servicer: GatewayServicer | None = None

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.server.stop(grace_s)
        await self.close()

    async def close(self) -> None:
        """Everything but the gRPC server: the HTTP API, the pool, metrics and the Redis connection."""
        if self.http is not None:
            await self.http.stop()
        if self.slo is not None:
            await self.slo.stop()
        await self.pool.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.quota is not None:
            await self.quota.close()
        if self.processors is not None:
            await self.processors.close()


def default_chain(cfg: GatewayConfig, tenants: TenantRegistry, quota: QuotaEnforcer | None, processors: Processors,
                  slo: SloLink | None, metrics: GatewayMetrics, tracer) -> Chain:
    """The gateway's admission rules, in order (`rules.py`): what a request passes between the edge and a worker."""
    rules: list = [Authenticate(tenants), Grant(tenants, processors)]
    if quota is not None:
        rules.append(Quota(quota))
    rules.append(PreProcess(processors))
    if slo is not None:
        rules += [BatchHold(slo, metrics), InteractiveShed(slo, cfg.targets, metrics)]
        if cfg.slo.pause_batch:
            BatchPauses(slo)  # steers the workers' pauses at every forecast refresh (not a per-request rule)
    rules.append(WorkerAdmission(tracer))
    return Chain(rules)


def tenancy(cfg: GatewayConfig) -> tuple[TenantRegistry, QuotaEnforcer | None]:
    if cfg.tenants_file is None:
        log.info("no tenants file: one open tenant 'default', no API keys checked, no limits")
        return TenantRegistry.open(), None
    registry = TenantRegistry.from_file(cfg.tenants_file)
    limited = [t.name for t in registry.tenants.values() if t.has_limits]
    log.info("tenants from %s: %s", cfg.tenants_file, ", ".join(sorted(registry.tenants)))
    if not limited:
        return registry, None
    if not cfg.redis_url:
        raise ValueError(f"redis_url: tenants {', '.join(limited)} have limits, which are kept in Redis: "
                         "give --redis-url (or COTSERVE_REDIS_URL)")
    return registry, QuotaEnforcer.from_url(cfg.redis_url)


async def start_gateway(cfg: GatewayConfig, tracer_provider: TracerProvider | None = None,
                        resolve: Resolver = resolve_dns) -> RunningGateway:
    """Start the gateway; `resolve` answers `worker_dns` lookups (the system's resolver by default)."""
    cfg.validate()
    upstream = cfg.upstream_credentials()
    pool = WorkerPool(cfg.all_workers(), poll_interval_s=cfg.poll_interval_s, tracer_provider=tracer_provider,
                      admission=cfg.admission, targets=cfg.targets, dns=list(cfg.worker_dns),
                      dns_interval_s=cfg.dns_interval_s, resolve=resolve, credentials=upstream,
                      multiplex=cfg.worker_multiplex)
    metrics = GatewayMetrics(pool)
    tenants, quota = tenancy(cfg)
    processors = Processors(cfg.sandbox_address, cfg.fail_open_modules, tracer_provider, upstream)
    slo = SloLink(cfg.slo, pool, upstream) if cfg.slo.address else None
    tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer("cotserve.gateway")
    chain = default_chain(cfg, tenants, quota, processors, slo, metrics, tracer)
    relay = Relay(pool, metrics, chain, tenants, processors, tracer_provider, slo, cfg.prefix_cache_scope,
                  cfg.max_prompt_chars, cfg.max_prompt_tokens, cfg.worker_wait_s)
    servicer = GatewayServicer(relay, traced=tracer_provider is not None, max_session_streams=cfg.max_session_streams)
    spec = ServiceSpec("cotserve.gateway.v1.GatewayService",
                       lambda srv: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, srv))
    server = Server([spec], cfg.host, cfg.port, tracer_provider, max_message_bytes=cfg.max_request_bytes, tls=cfg)
    server.on_stop.append(servicer.drain)  # long-lived Session calls end with their streams, not at the grace period
    metrics_server = serve_metrics(metrics.registry, cfg.host, cfg.metrics_port)
    await server.start()
    http = None
    if cfg.http_port is not None:
        http = OpenAIServer(relay, cfg.host, cfg.http_port, cfg.max_request_bytes, cfg.ssl_context(),
                            cfg.http_body_timeout_s, cfg.http_max_connections_per_client)
        await http.start()
    health_tasks: set[asyncio.Task] = set()

    def on_workers(any_healthy: bool) -> None:
        """The gateway is SERVING while at least one worker is in rotation, NOT_SERVING otherwise."""
        if any_healthy:
            log.info("a worker is in rotation: SERVING")
        else:
            log.warning("no worker is in rotation: NOT_SERVING until one answers")
        task = asyncio.get_running_loop().create_task(server.set_serving() if any_healthy else server.set_not_serving())
        health_tasks.add(task)
        task.add_done_callback(health_tasks.discard)

    pool.on_change = on_workers
    await pool.start()
    if slo is not None:
        slo.start()
    healthy = [w.address for w in pool.workers if w.healthy]
    log.info("gateway on %s: %d workers (%d healthy now): %s", server.address, len(pool.workers), len(healthy),
             ", ".join(f"{w.address}={w.model or '?'}" for w in pool.workers))
    if http is not None:
        log.info("OpenAI-compatible HTTP API on http://%s:%d/v1", cfg.host, http.port)
    return RunningGateway(server, pool, metrics, metrics_server, quota, processors, slo, http, servicer)


async def serve(cfg: GatewayConfig) -> None:
    gw = await start_gateway(cfg, make_tracer_provider("cotserve-gateway"))
    await run_until_signalled(gw.server, cfg.grace_s, on_stop=gw.close)
