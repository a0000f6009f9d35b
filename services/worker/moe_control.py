"""The worker's side of the MoE control plane: follow the routing policy in Redis, report load.

At start the latest policy is read from its key and applied before the worker reports SERVING.
Then new versions arrive on the pub/sub channel; after every (re)connection the key is read again,
since pub/sub drops what is published while a subscriber is away. Versions not newer than the one
in force are ignored by the engine; garbage and policies for another model's shape are logged and
ignored. Each applied version is recorded in `cotserve:moe:{model}:applied:{worker}`, and the
apply is a span whose parent is the publisher's trace context carried in the message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import redis.asyncio as aioredis
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider

from cotserve.common import moe_protocol as protocol
from cotserve.worker.engine import Engine

log = logging.getLogger("cotserve.worker.moe")


class PolicyFollower:
    def __init__(self, redis_url: str, engine: Engine, model: str, worker_id: str,
                 tracer_provider: TracerProvider | None = None, load_window_s: float = 1.0) -> None:
        self.redis = aioredis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.engine = engine
        self.model = model
        self.worker_id = worker_id
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer("cotserve.worker.moe")
        self.load_window_s = load_window_s
        cfg = engine.loaded.config
        self.shape = dict(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                          moe_layers={i for i in range(cfg.num_layers)} if cfg.num_experts else set())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._applied: dict[int, asyncio.Event] = {}
        self._tasks: list[asyncio.Task] = []
        self.num_ignored = 0

    async def start(self) -> None:
        """Apply the current policy (if any) before returning, then follow changes in the background."""
        self._loop = asyncio.get_running_loop()
        self.engine.policy_listeners.append(self._on_applied_threadsafe)
        try:
            shape = {**self.shape, "moe_layers": sorted(self.shape["moe_layers"])}
            await self.redis.set(protocol.shape_key(self.model), json.dumps(shape))
            await self._sync_from_key(wait=True)
        except (aioredis.RedisError, OSError) as exc:
            log.warning("MoE policy: Redis unreachable at start (%s); following it once it is back", exc)
        self._tasks = [asyncio.create_task(self._follow(), name="cotserve-moe-follow"),
                       asyncio.create_task(self._report_load(), name="cotserve-moe-load")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.redis.aclose()

    # ---- policy ------------------------------------------------------------------------------
    def _on_applied_threadsafe(self, version: int) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._record_applied(version)))

    async def _record_applied(self, version: int) -> None:
        for v, event in list(self._applied.items()):
            if v <= version:
                event.set()
        try:
            await self.redis.set(protocol.applied_key(self.model, self.worker_id), str(version))
        except (aioredis.RedisError, OSError) as exc:
            log.warning("MoE policy v%d applied but not recorded in Redis: %s", version, exc)

    async def _sync_from_key(self, wait: bool = False) -> None:
        data = await self.redis.get(protocol.policy_key(self.model))
        if data is not None:
            await self._handle(data, wait=wait)

    async def _handle(self, data: bytes, wait: bool = False) -> None:
        try:
            policy = protocol.parse(data, model=self.model, **self.shape)
        except protocol.PolicyError as exc:
            self.num_ignored += 1
            log.warning("MoE policy message ignored: %s", exc)
            return
        if policy.version <= self.engine.policy_version:
            return
        ctx = propagate.extract(dict(policy.trace_context))
        with self.tracer.start_as_current_span(f"moe.apply_policy v{policy.version}", context=ctx) as span:
            span.set_attributes({"cotserve.moe.version": policy.version, "cotserve.worker": self.worker_id})
            applied = self._applied.setdefault(policy.version, asyncio.Event())
            self.engine.set_routing_policy(protocol.to_routing(policy))
            if wait:
                await applied.wait()

    async def _follow(self) -> None:
        backoff = 0.05
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(protocol.policy_channel(self.model))
                await self._sync_from_key()  # whatever was published while we were away
                backoff = 0.05
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        await self._handle(message["data"])
            except asyncio.CancelledError:
                raise
            except (aioredis.RedisError, OSError) as exc:
                log.warning("MoE policy: lost Redis (%s); reconnecting in %.2fs", type(exc).__name__, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001 - the connection is already gone
                    pass

    # ---- load --------------------------------------------------------------------------------
    async def _report_load(self) -> None:
        while True:
            await asyncio.sleep(self.load_window_s)
            got: asyncio.Future = self._loop.create_future()
            self.engine.request_expert_load(lambda load: self._loop.call_soon_threadsafe(got.set_result, load))
            load = await got
            if not any(sum(v) for v in load.values()):
                continue
            fields = {"worker": self.worker_id, "end_unix_ms": str(int(time.time() * 1000)),
                      "window_s": str(self.load_window_s), "policy_version": str(self.engine.policy_version),
                      "load": json.dumps({str(k): v for k, v in load.items()})}
            try:
                await self.redis.xadd(protocol.load_stream(self.model), fields, maxlen=protocol.LOAD_STREAM_MAXLEN,
                                      approximate=True)
            except (aioredis.RedisError, OSError) as exc:
                log.warning("MoE load window dropped: %s", exc)

