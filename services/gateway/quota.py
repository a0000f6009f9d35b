"""Tenant limits enforced in Redis, so they hold across every gateway sharing it.

- requests/min and tokens/min: GCRA (a token bucket as a "theoretical arrival time") in one Lua
  script each, timed by Redis' own clock so gateways' clocks do not matter. Tokens are reserved
  up front at an upper bound (prompt bytes + 8 special tokens + max_new_tokens, per sample) and
  settled when the request ends with what it computed: the unused part refunded, tokens past the
  reservation (early-exit probes') charged.
- concurrency: a sorted set of leases (one member per sample of a request -> expiry), so a gateway
  that dies mid-request cannot leak a slot for longer than the lease (one minute); the gateway
  renews a request's lease every 20 seconds while its stream lives, so a long generation keeps its
  slots. A release that fails (Redis down or frozen) is retried in the background until it
  succeeds or the lease has expired anyway.
- A request of n samples counts as n requests and n concurrent ones: what a limit counts is the
  sequences a worker runs, whatever the request that fans out into them.
- Redis trouble is UNAVAILABLE naming the dependency (its address and the client's exception go to the
  log only): limits that cannot be checked are not waived.

Keys: `cotserve:quota:{tenant}:rpm`, `...:tpm`, `...:concurrent`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

import redis
import redis.asyncio as aioredis

from cotserve.common.errors import ResourceExhausted, Unavailable
from cotserve.gateway.tenants import Tenant

log = logging.getLogger("cotserve.gateway.quota")
PREFIX = "cotserve:quota"
LEASE_MS = 60 * 1000
RENEW_EVERY_S = LEASE_MS / 1000 / 3
SPECIAL_TOKENS_ALLOWANCE = 8

# KEYS[1] = bucket; ARGV = interval_ms (per unit), capacity (units), cost (units).
# Returns {allowed (1/0), retry_after_ms}.
_GCRA = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local interval = tonumber(ARGV[1])
local tau = interval * tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local new_tat = tat + cost * interval
if new_tat - now > tau then
  return {0, math.ceil(new_tat - tau - now)}
end
redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil(new_tat - now) + 1000)
return {1, 0}
"""

# KEYS[1] = bucket; ARGV = interval_ms, units to give back.
_REFUND = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
local new_tat = math.max(now, tat - tonumber(ARGV[1]) * tonumber(ARGV[2]))
if new_tat <= now then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil(new_tat - now) + 1000)
end
return 1
"""

# KEYS[1] = bucket; ARGV = interval_ms, units to charge (past a reservation: never refused, it was used).
_CHARGE = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tat = math.max(now, tonumber(redis.call('GET', KEYS[1]) or now)) + tonumber(ARGV[1]) * tonumber(ARGV[2])
redis.call('SET', KEYS[1], tostring(tat), 'PX', math.ceil(tat - now) + 1000)
return 1
"""

# KEYS[1] = lease set; ARGV = limit, lease id, lease ms, units. Returns 1 when leased (members id:1..id:units).
_LEASE = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local units = tonumber(ARGV[4])
if redis.call('ZCARD', KEYS[1]) + units > tonumber(ARGV[1]) then
  return 0
end
for k = 1, units do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2] .. ':' .. k)
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""


# KEYS[1] = lease set; ARGV = lease id, lease ms, units. Pushes a live lease's expiry out; returns 0 when it is gone.
_RENEW = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if not redis.call('ZSCORE', KEYS[1], ARGV[1] .. ':1') then
  return 0
end
for k = 1, tonumber(ARGV[3]) do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1] .. ':' .. k)
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""

T = TypeVar("T")


def _redis_guarded(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Redis errors become UNAVAILABLE with a message that names the dependency, not its address."""
    @functools.wraps(fn)
    async def call(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except redis.RedisError as exc:
            log.warning("tenant-limits store (Redis) failed in %s: %r", fn.__name__, exc)
            raise Unavailable("quota: the tenant-limits store (Redis) is unavailable; retry later") from None
    return call


def token_reservation(prompt: str, max_new_tokens: int) -> int:
    """An upper bound on a request's prompt + completion tokens, known before tokenizing."""
    return len(prompt.encode()) + SPECIAL_TOKENS_ALLOWANCE + max_new_tokens


@dataclass(slots=True)
class Grant:
    """What a request holds until it ends: a concurrency lease (of `units` slots) and a token reservation."""

    tenant: Tenant
    lease_id: str | None
    reserved_tokens: int
    units: int = 1
    renewed_at: float = field(default_factory=time.monotonic)  # when its lease was taken or last renewed
    released: bool = False  # its lease is given back (a release retried after a failure does not do it twice)

    def members(self) -> list[str]:
        return [f"{self.lease_id}:{k}" for k in range(1, self.units + 1)]


class QuotaEnforcer:
    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self._gcra = client.register_script(_GCRA)
        self._refund = client.register_script(_REFUND)
        self._charge = client.register_script(_CHARGE)
        self._retries: set[asyncio.Task] = set()  # releases retried in the background
        self._lease = client.register_script(_LEASE)
        self._renew = client.register_script(_RENEW)

    @classmethod
    def from_url(cls, url: str) -> "QuotaEnforcer":
        # a frozen or unreachable Redis fails the request in seconds (UNAVAILABLE) rather than holding it
        return cls(aioredis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0))

    async def close(self) -> None:
        for task in self._retries:
            task.cancel()
        await asyncio.gather(*self._retries, return_exceptions=True)
        await self.redis.aclose()

    @staticmethod
    def _exhausted(tenant: Tenant, what: str, retry_after_ms: int) -> ResourceExhausted:
        return ResourceExhausted(f"quota: tenant {tenant.name!r} is over its {what}",
                                 trailers={"retry-after-ms": str(max(1, int(retry_after_ms)))})

    @_redis_guarded
    async def admit(self, tenant: Tenant, reserve_tokens: int, units: int = 1) -> Grant:
        """Take a concurrency lease of `units` slots, `units` requests and `reserve_tokens` tokens (a request of `units`
        samples), or raise ResourceExhausted."""
        key = f"{PREFIX}:{tenant.name}"
        lease_id = None
        if tenant.max_concurrent is not None:
            if units > tenant.max_concurrent:
                raise self._exhausted(tenant, f"max_concurrent ({tenant.max_concurrent}): this request runs {units} "
                                              "samples at once", 60000)
            lease_id = uuid.uuid4().hex
            if not await self._lease(keys=[f"{key}:concurrent"], args=[tenant.max_concurrent, lease_id, LEASE_MS, units]):
                raise self._exhausted(tenant, f"max_concurrent ({tenant.max_concurrent})", 100)
        grant = Grant(tenant, lease_id, reserve_tokens if tenant.tokens_per_min is not None else 0, units)
        try:
            if tenant.requests_per_min is not None:
                ok, wait = await self._gcra(keys=[f"{key}:rpm"],
                                            args=[60000 / tenant.requests_per_min, tenant.requests_per_min, units])
                if not ok:
                    raise self._exhausted(tenant, f"requests_per_min ({tenant.requests_per_min})", wait)
            if tenant.tokens_per_min is not None:
                if reserve_tokens > tenant.tokens_per_min:
                    raise self._exhausted(tenant, f"tokens_per_min ({tenant.tokens_per_min}): this request may use "
                                                  f"up to {reserve_tokens} tokens", 60000)
                ok, wait = await self._gcra(keys=[f"{key}:tpm"], args=[60000 / tenant.tokens_per_min, tenant.tokens_per_min, reserve_tokens])
                if not ok:
                    raise self._exhausted(tenant, f"tokens_per_min ({tenant.tokens_per_min})", wait)
        except BaseException:
            if lease_id is not None:
                await self.redis.zrem(f"{key}:concurrent", *grant.members())
            raise
        return grant

    @_redis_guarded
    async def renew(self, grant: Grant) -> bool:
        """Push the grant's concurrency lease out by another LEASE_MS; False when it had expired."""
        if grant.lease_id is None:
            return True
        if grant.released:
            return False
        renewed = bool(await self._renew(keys=[f"{PREFIX}:{grant.tenant.name}:concurrent"],
                                         args=[grant.lease_id, LEASE_MS, grant.units]))
        if renewed:
            grant.renewed_at = time.monotonic()
        return renewed

    @_redis_guarded
    async def release(self, grant: Grant, used_tokens: int) -> None:
        """The request ended: drop its lease and settle its tokens, giving back what it reserved but did not use and
        charging what it used past the reservation. Idempotent: a retry after a failure settles once."""
        key = f"{PREFIX}:{grant.tenant.name}"
        if grant.lease_id is not None and not grant.released:
            await self.redis.zrem(f"{key}:concurrent", *grant.members())
            grant.released = True
        if grant.reserved_tokens:
            unused, interval = grant.reserved_tokens - used_tokens, 60000 / grant.tenant.tokens_per_min
            if unused > 0:
                await self._refund(keys=[f"{key}:tpm"], args=[interval, unused])
            elif unused < 0:
                await self._charge(keys=[f"{key}:tpm"], args=[interval, -unused])
            grant.reserved_tokens = 0

    async def release_or_retry(self, grant: Grant, used_tokens: int, retry_every_s: float = 1.0) -> None:
        """`release`; when Redis fails it, retried in the background every `retry_every_s` until it succeeds or the
        lease has expired by itself (a lease held for a request that ended is a slot the tenant lost). Raises the
        first failure (UNAVAILABLE), so that the caller can log it."""
        try:
            await self.release(grant, used_tokens)
        except Unavailable:
            task = asyncio.create_task(self._retry_release(grant, used_tokens, retry_every_s))
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)
            raise

    async def _retry_release(self, grant: Grant, used_tokens: int, retry_every_s: float) -> None:
        expires = grant.renewed_at + LEASE_MS / 1000  # then the lease is gone by itself, and its minute has passed
        while time.monotonic() < expires:
            await asyncio.sleep(retry_every_s)
            try:
                await self.release(grant, used_tokens)
            except Unavailable:
                continue
            log.info("tenant %s: a failed quota release went through on retry", grant.tenant.name)
            return
