"""The MoE router service: operator policy changes (compare-and-set), policy watch, expert load,
and a balancing loop that nudges per-expert bias toward even load."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
import redis.asyncio as aioredis
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider

from prometheus_client import CollectorRegistry, Counter, Gauge

from cotserve.common.v1 import common_pb2
from cotserve.common.errors import CotserveError, InvalidArgument, NotFound
from cotserve.common.metrics import MetricsServer, serve_metrics
from cotserve.common.server import Server, ServiceSpec, run_until_signalled
from cotserve.common.tracing import make_tracer_provider
from cotserve.common import moe_protocol as protocol
from cotserve.router.config import RouterConfig
from cotserve.router.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger("cotserve.router")


class RouterMetrics:
    """The router's Prometheus metrics: policy versions and publishes, load windows folded, expert balance."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.version = Gauge("cotserve_router_policy_version", "Latest expert-policy version this router published.",
                             ["model"], registry=r)
        self.publishes = Counter("cotserve_router_policy_publishes", "Expert policies published, by who asked "
                                 "(operator: SetPolicy; balance: the balancing loop).", ["model", "source"], registry=r)
        self.windows = Counter("cotserve_router_load_windows", "Workers' expert-load windows folded into the "
                               "per-second buckets.", ["model"], registry=r)
        self.balance = Gauge("cotserve_router_expert_balancedness", "Mean over MoE layers of mean / max tokens per "
                             "expert in the last balancing window (1 = perfectly even).", ["model"], registry=r)


class Aborted(CotserveError):
    code = "ABORTED"


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, redis: aioredis.Redis, cfg: RouterConfig) -> None:
        self.redis = redis
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self._cas = redis.register_script(protocol.CAS_SCRIPT)

    async def shape(self, model: str) -> dict:
        raw = await self.redis.get(protocol.shape_key(model))
        if raw is None:
            raise NotFound(f"model: no worker of {model!r} has registered its experts")
        shape = json.loads(raw)
        shape["moe_layers"] = set(shape["moe_layers"])
        return shape

    async def current(self, model: str) -> common_pb2.ExpertPolicy:
        raw = await self.redis.get(protocol.policy_key(model))
        if raw is None:
            return common_pb2.ExpertPolicy(model=model, version=0)
        p = common_pb2.ExpertPolicy()
        p.ParseFromString(raw)
        return p

    async def publish(self, policy: common_pb2.ExpertPolicy, expected_version: int,
                      source: str = "operator") -> common_pb2.ExpertPolicy:
        """Validate, then compare-and-set: the new version is expected_version + 1."""
        if not policy.model:
            raise InvalidArgument("policy.model: required")
        try:
            protocol.validate(policy, **await self.shape(policy.model))
        except protocol.PolicyError as exc:
            raise InvalidArgument(f"policy.{exc}") from None
        out = common_pb2.ExpertPolicy()
        out.CopyFrom(policy)
        out.version = expected_version + 1
        out.trace_context.clear()
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        out.trace_context.update(carrier)
        ok, current = await self._cas(keys=[protocol.policy_key(policy.model), protocol.version_key(policy.model)],
                                      args=[expected_version, out.SerializeToString()])
        if not ok:
            raise Aborted(f"expected_version: {expected_version} is stale; the current version is {current}")
        self.metrics.publishes.labels(policy.model, source).inc()
        self.metrics.version.labels(policy.model).set(out.version)
        return out

    async def GetPolicy(self, request: router_pb2.GetPolicyRequest, context: grpc.aio.ServicerContext) -> router_pb2.GetPolicyResponse:
        return router_pb2.GetPolicyResponse(policy=await self.current(request.model))

    async def SetPolicy(self, request: router_pb2.SetPolicyRequest, context: grpc.aio.ServicerContext) -> router_pb2.SetPolicyResponse:
        policy = await self.publish(request.policy, request.expected_version)
        trace.get_current_span().set_attributes({"cotserve.moe.model": policy.model, "cotserve.moe.version": policy.version})
        log.info("policy %s v%d set by an operator", policy.model, policy.version)
        return router_pb2.SetPolicyResponse(policy=policy)

    async def WatchPolicy(self, request: router_pb2.WatchPolicyRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[router_pb2.WatchPolicyResponse]:
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(protocol.policy_channel(request.model))
        try:
            last = await self.current(request.model)
            yield router_pb2.WatchPolicyResponse(policy=last)
            async for message in pubsub.listen():
                if message.get("type") != "message":
                    continue
                p = common_pb2.ExpertPolicy()
                try:
                    p.ParseFromString(message["data"])
                except Exception:  # noqa: BLE001 - garbage on the channel is not ours to relay
                    continue
                if p.model == request.model and p.version > last.version:
                    last = p
                    yield router_pb2.WatchPolicyResponse(policy=p)
        finally:
            await pubsub.aclose()

    async def GetExpertLoad(self, request: router_pb2.GetExpertLoadRequest, context: grpc.aio.ServicerContext) -> router_pb2.GetExpertLoadResponse:
        window_ms = request.window_ms or int(self.cfg.balance_window_s * 1000)
        load = await expert_load(self.redis, request.model, window_ms / 1000)
        resp = router_pb2.GetExpertLoadResponse(window_ms=window_ms)
        for layer, counts in sorted(load.items()):
            resp.layers.add(layer=layer, tokens_per_expert=counts, balancedness=balancedness(counts))
        return resp


def balancedness(counts: list[int]) -> float:
    """Mean load over max load: 1.0 is perfectly even; 0 when nothing was routed."""
    return (sum(counts) / len(counts)) / max(counts) if counts and max(counts) else 0.0


async def expert_load(redis: aioredis.Redis, model: str, window_s: float) -> dict[int, list[int]]:
    """Tokens per expert per layer over the last `window_s` seconds, from the per-second buckets."""
    shape_raw = await redis.get(protocol.shape_key(model))
    if shape_raw is None:
        raise NotFound(f"model: no worker of {model!r} has registered its experts")
    shape = json.loads(shape_raw)
    now = int(time.time())
    keys = [protocol.load_bucket_key(model, s) for s in range(now - max(1, int(window_s)), now + 1)]
    out = {layer: [0] * shape["num_experts"] for layer in shape["moe_layers"]}
    for bucket in await asyncio.gather(*(redis.hgetall(k) for k in keys)):
        for fld, value in bucket.items():
            layer, expert = (int(x) for x in fld.decode().split(":"))
            if layer in out and expert < shape["num_experts"]:
                out[layer][expert] += int(value)
    return out


async def consume_load(redis: aioredis.Redis, model: str, consumer: str = "router-1") -> int:
    """Fold unread (and previously unacknowledged) load windows into per-second buckets.

    Each window is added and acknowledged in one MULTI/EXEC, so a crash between the two cannot
    happen: a window is counted exactly once across router restarts. Returns windows folded."""
    stream = protocol.load_stream(model)
    try:
        await redis.xgroup_create(stream, protocol.LOAD_GROUP, id="0", mkstream=True)
    except aioredis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    folded = 0
    for start in ("0", ">"):  # our pending entries first (a restart), then new ones
        resp = await redis.xreadgroup(protocol.LOAD_GROUP, consumer, {stream: start}, count=500)
        for _, entries in resp or []:
            for entry_id, fields in entries:
                if not fields:
                    continue
                second = int(fields[b"end_unix_ms"]) // 1000
                key = protocol.load_bucket_key(model, second)
                load = json.loads(fields[b"load"])
                async with redis.pipeline(transaction=True) as pipe:
                    for layer, counts in load.items():
                        for expert, n in enumerate(counts):
                            if n:
                                pipe.hincrby(key, f"{layer}:{expert}", n)
                    pipe.expire(key, protocol.LOAD_BUCKET_TTL_S)
                    pipe.xack(stream, protocol.LOAD_GROUP, entry_id)
                    await pipe.execute()
                folded += 1
    return folded


def sign_rule(bias: list[float], counts: list[int], gamma: float) -> list[float]:
    """b_e += gamma * sign(mean - load_e): under-loaded experts become likelier to be chosen."""
    mean = sum(counts) / len(counts)
    return [b + gamma * ((mean > c) - (mean < c)) for b, c in zip(bias, counts)]


def proportional_rule(bias: list[float], counts: list[int], gamma: float) -> list[float]:
    """b_e += gamma * clip((mean - load_e) / mean, -1, 1): the sign rule's direction, with a step
    that shrinks as an expert nears the mean. Far from balance it moves as fast as the sign rule;
    near it, it stops the ±gamma oscillation the sign rule keeps up around the fixed point, which
    on noisy per-second load windows otherwise costs several points of balancedness."""
    mean = sum(counts) / len(counts)
    if mean == 0:
        return list(bias)
    return [b + gamma * max(-1.0, min(1.0, (mean - c) / mean)) for b, c in zip(bias, counts)]


RULES = {"sign": sign_rule, "proportional": proportional_rule}


async def balance_once(servicer: RouterServicer, model: str) -> common_pb2.ExpertPolicy | None:
    """One balancing round: a new policy version when the load calls for one."""
    load = await expert_load(servicer.redis, model, servicer.cfg.balance_window_s)
    if not any(sum(c) for c in load.values()):
        return None
    servicer.metrics.balance.labels(model).set(sum(map(balancedness, load.values())) / len(load))
    current = await servicer.current(model)
    by_layer = {l.layer: l for l in current.layers}
    new = common_pb2.ExpertPolicy(model=model, top_k=current.top_k)
    changed = False
    for layer, counts in sorted(load.items()):
        old = by_layer.get(layer)
        bias = list(old.expert_bias) if old and old.expert_bias else [0.0] * len(counts)
        nudged = RULES[servicer.cfg.rule](bias, counts, servicer.cfg.gamma) if sum(counts) else bias
        changed |= nudged != bias
        new.layers.add(layer=layer, expert_bias=nudged, disabled_experts=list(old.disabled_experts) if old else [])
    if not changed:
        return None
    return await servicer.publish(new, current.version, source="balance")


async def background(servicer: RouterServicer, cfg: RouterConfig) -> None:
    """Consume load windows and, when on, balance every model's experts."""
    while True:
        try:
            models = cfg.models or sorted({k.decode().split(":")[2] async for k in servicer.redis.scan_iter(f"{protocol.PREFIX}:*:shape")})
            for model in models:
                servicer.metrics.windows.labels(model).inc(await consume_load(servicer.redis, model))
                if cfg.balance:
                    try:
                        p = await balance_once(servicer, model)
                        if p is not None:
                            log.info("balanced %s: v%d", model, p.version)
                    except Aborted:
                        pass  # an operator won the race; next round
        except asyncio.CancelledError:
            raise
        except (aioredis.RedisError, OSError) as exc:
            log.warning("router background round failed: %s", exc)
        await asyncio.sleep(cfg.balance_interval_s)


@dataclass(slots=True)
class RunningRouter:
    server: Server
    redis: aioredis.Redis
    task: asyncio.Task
    servicer: RouterServicer
    metrics_server: MetricsServer | None = None

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.server.stop(grace_s)
        await self.close()

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.redis.aclose()
        if self.metrics_server is not None:
            self.metrics_server.stop()


async def start_router(cfg: RouterConfig, tracer_provider: TracerProvider | None = None) -> RunningRouter:
    cfg.validate()
    redis = aioredis.Redis.from_url(cfg.redis_url)
    servicer = RouterServicer(redis, cfg)
    spec = ServiceSpec("cotserve.router.v1.RouterService",
                       lambda srv: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, srv))
    server = Server([spec], cfg.host, cfg.port, tracer_provider, tls=cfg)
    metrics_server = serve_metrics(servicer.metrics.registry, cfg.host, cfg.metrics_port)
    await server.start()
    task = asyncio.create_task(background(servicer, cfg), name="cotserve-router-background")
    await server.set_serving()
    log.info("SERVING router on %s (redis %s, balancing %s)", server.address, cfg.redis_url, "on" if cfg.balance else "off")
    return RunningRouter(server, redis, task, servicer, metrics_server)


async def serve(cfg: RouterConfig) -> None:
    router = await start_router(cfg, make_tracer_provider("cotserve-router"))
    await run_until_signalled(router.server, cfg.grace_s, on_stop=router.close)
