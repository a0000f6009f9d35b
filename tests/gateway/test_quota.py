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
