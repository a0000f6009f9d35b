"""Workers follow the MoE routing policy in a real Redis (started by the test)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from cotserve.common.v1 import common_pb2
from cotserve.common import moe_protocol as protocol
from cotserve.sdk import AsyncClient
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker

transformers = pytest.importorskip("transformers")


def policy(version: int, model: str = "tiny-moe", **layer0) -> bytes:
    p = common_pb2.ExpertPolicy(model=model, version=version)
    p.layers.add(layer=0, **layer0)
    return p.SerializeToString()


async def publish(r, data: bytes, model: str = "tiny-moe") -> None:
    await r.set(protocol.policy_key(model), data)
    await r.publish(protocol.policy_channel(model), data)


async def wait_for(predicate, timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "timed out"
        await asyncio.sleep(0.005)
    return time.monotonic() - start


def test_worker_follows_the_policy(mixtral, redis_url):
    async def main():
        r = aioredis.Redis.from_url(redis_url)
        await publish(r, policy(3, disabled_experts=[0]))  # before the worker exists
        worker = await start_worker(WorkerConfig(model=mixtral, port=0, max_num_seqs=4, redis_url=redis_url,
                                                 worker_id="w1"))
        try:
            engine = worker.engine
            assert engine.policy_version == 3  # applied before SERVING
            assert await r.get(protocol.applied_key("tiny-moe", "w1")) == b"3"
            await publish(r, policy(5, expert_bias=[0.0, 0.0, 5.0, 5.0]))
            took = await wait_for(lambda: engine.policy_version == 5)
            for junk in (b"\xff\x00garbage", policy(9, model="other"), policy(9, expert_bias=[1.0]),
                         policy(9, disabled_experts=[0, 1, 2]), policy(4)):
                await r.publish(protocol.policy_channel("tiny-moe"), junk)
            await asyncio.sleep(0.3)
            assert engine.policy_version == 5 and worker.follower.num_ignored == 4  # v4 is older: skipped quietly
            from cotserve.gateway.server import GatewayConfig, start_gateway

            gw = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address]))
            try:
                async with AsyncClient(gw.server.address) as c:
                    res = await c.generate("hello", max_new_tokens=8, ignore_eos=True)
            finally:
                await gw.stop()
            assert len(res.token_ids) == 8
            await asyncio.sleep(1.3)  # one load window
            entries = await r.xrange(protocol.load_stream("tiny-moe"))
            assert entries and entries[-1][1][b"worker"] == b"w1" and entries[-1][1][b"policy_version"] == b"5"
            return took
        finally:
            await worker.stop()
            await r.aclose()

    took = asyncio.run(main())
    assert took < 1.0
