"""The quota enforcer against a real Redis (the `redis_url` fixture starts one): requests and tokens per minute,
concurrency leases, the refund of what a request reserved and did not use, and the reservation's bound."""

from __future__ import annotations

import asyncio

import pytest

from cotserve.common.errors import ResourceExhausted
from cotserve.gateway.quota import QuotaEnforcer, token_reservation
from cotserve.gateway.tenants import Tenant


def test_redis_limits(redis_url):
    async def main():
        q = QuotaEnforcer.from_url(redis_url)
        try:
            rpm = Tenant("rpm", requests_per_min=5)
            grants = [await q.admit(rpm, 0) for _ in range(5)]
            with pytest.raises(ResourceExhausted, match=r"quota: tenant 'rpm' is over its requests_per_min \(5\)") as err:
                await q.admit(rpm, 0)
            assert 0 < int(err.value.trailers["retry-after-ms"]) <= 12000
            del grants

            conc = Tenant("conc", max_concurrent=2)
            a, b = await q.admit(conc, 0), await q.admit(conc, 0)
            with pytest.raises(ResourceExhausted, match="max_concurrent"):
                await q.admit(conc, 0)
            await q.release(a, 0)
            c = await q.admit(conc, 0)
            for g in (b, c):
                await q.release(g, 0)

            tpm = Tenant("tpm", tokens_per_min=100)
            g1 = await q.admit(tpm, 60)
            with pytest.raises(ResourceExhausted, match="tokens_per_min"):
                await q.admit(tpm, 60)  # 120 reserved would be over 100
            await q.release(g1, 10)  # it used 10: 50 come back
            g2 = await q.admit(tpm, 60)  # 10 + 60 <= 100
            await q.release(g2, 60)
            with pytest.raises(ResourceExhausted, match="this request may use up to 101 tokens"):
                await q.admit(tpm, 101)
        finally:
            await q.close()

    asyncio.run(main())


def test_token_reservation_is_an_upper_bound():
    assert token_reservation("37+48-12=", 64) == 9 + 8 + 64


def test_a_request_of_n_samples_counts_as_n_requests_and_n_concurrent_ones(redis_url):
    async def main():
        q = QuotaEnforcer.from_url(redis_url)
        try:
            conc = Tenant("conc", max_concurrent=4)
            votes = await q.admit(conc, 0, units=3)  # three samples at once: three of the four slots
            with pytest.raises(ResourceExhausted, match=r"max_concurrent \(4\)"):
                await q.admit(conc, 0, units=2)
            one = await q.admit(conc, 0)
            assert await q.renew(votes) and await q.redis.zcard("cotserve:quota:conc:concurrent") == 4
            await q.release(votes, 0)
            await q.release(one, 0)
            assert await q.redis.zcard("cotserve:quota:conc:concurrent") == 0
            with pytest.raises(ResourceExhausted, match="this request runs 5 samples at once"):
                await q.admit(conc, 0, units=5)
            rpm = Tenant("rpm", requests_per_min=5)
            await q.admit(rpm, 0, units=4)
            with pytest.raises(ResourceExhausted, match=r"requests_per_min \(5\)"):
                await q.admit(rpm, 0, units=2)
        finally:
            await q.close()

    asyncio.run(main())


def test_tokens_used_past_the_reservation_are_charged(redis_url):
    async def main():
        q = QuotaEnforcer.from_url(redis_url)
        try:
            tpm = Tenant("tpm", tokens_per_min=100)
            g = await q.admit(tpm, 40)
            await q.release(g, 70)  # early-exit probes computed 30 tokens past the reservation
            with pytest.raises(ResourceExhausted, match="tokens_per_min"):
                await q.admit(tpm, 40)  # 70 + 40 > 100: the 30 were charged
            assert await q.admit(tpm, 30)
            await q.release(g, 70)  # settled once: a second release charges nothing more
        finally:
            await q.close()

    asyncio.run(main())


def test_a_release_that_fails_while_redis_is_frozen_goes_through_once_it_is_back():
    """Redis frozen (SIGSTOP) when a request ends: its release fails (UNAVAILABLE) and is retried in the background
    until it succeeds, so the tenant gets its slot back without waiting for the lease to expire."""
    import os
    import signal

    from cotserve.common.errors import Unavailable
    from cotserve.common.procs import free_port, redis_child, wait_serving

    child, url = redis_child(free_port())
    child.start()
    wait_serving(child, 10, lambda: None)

    async def main():
        q = QuotaEnforcer.from_url(url)
        try:
            tenant = Tenant("t", max_concurrent=1)
            grant = await q.admit(tenant, 0)
            os.kill(child.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(Unavailable):
                    await q.release_or_retry(grant, 0, retry_every_s=0.2)
            finally:
                os.kill(child.proc.pid, signal.SIGCONT)
            deadline = asyncio.get_running_loop().time() + 20
            while q._retries:
                assert asyncio.get_running_loop().time() < deadline, "the release was never retried"
                await asyncio.sleep(0.05)
            assert await q.redis.zcard("cotserve:quota:t:concurrent") == 0
            await q.release(await q.admit(tenant, 0), 0)  # the slot is free again
        finally:
            await q.close()

    try:
        asyncio.run(main())
    finally:
        child.stop(grace_s=2)
