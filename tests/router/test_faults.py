"""Faults of the MoE control plane against real Redis servers started by the test."""

from __future__ import annotations

import asyncio
import subprocess
import time

import redis.asyncio as aioredis

from cotserve.common.v1 import common_pb2
from cotserve.common.procs import redis_child
from cotserve.common import moe_protocol as protocol
from cotserve.worker.sequence import SamplingParams
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker
from tests.conftest import free_port


def start_redis(port: int) -> subprocess.Popen:
    child, _ = redis_child(port)
    child.start()
    return child.proc


async def until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def encoded(version: int, disabled: list[int]) -> bytes:
    p = common_pb2.ExpertPolicy(model="tiny-moe", version=version)
    p.layers.add(layer=0, disabled_experts=disabled)
    return p.SerializeToString()


def test_redis_restart_mid_load_worker_keeps_serving_and_converges(mixtral):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = start_redis(port)

    async def main():
        nonlocal server
        r = aioredis.Redis.from_url(url)

        async def up() -> bool:
            try:
                return bool(await r.ping())
            except (aioredis.RedisError, OSError):
                return False

        await until(up, 10)
        await r.set(protocol.policy_key("tiny-moe"), encoded(1, [0]))
        worker = await start_worker(WorkerConfig(model=mixtral, port=0, max_num_seqs=2, redis_url=url))
        engine = worker.engine
        applied: list[int] = []
        engine.policy_listeners.append(applied.append)
        try:
            assert engine.policy_version == 1
            server.kill()
            server.wait()
            outputs = []
            engine.submit("while-down", list(range(3, 11)), SamplingParams(max_new_tokens=16, ignore_eos=True),
                          outputs.append)

            async def finished() -> bool:
                return any(o.finish_reason for o in outputs)

            await until(finished, 10)  # served while Redis is gone
            server = start_redis(port)  # back, empty (no persistence)
            await until(up, 10)
            # The router's publish (key, then channel) may land before or after the worker resubscribes:
            # either the message or the re-read of the key after the reconnect brings v3 in.
            await r.set(protocol.policy_key("tiny-moe"), encoded(3, [1]))
            await r.publish(protocol.policy_channel("tiny-moe"), encoded(3, [1]))

            async def converged() -> bool:
                return engine.policy_version == 3

            await until(converged, 10)
            await r.publish(protocol.policy_channel("tiny-moe"), encoded(2, [2]))  # stale: must not be applied
            await asyncio.sleep(0.3)
            assert engine.policy_version == 3
            return applied
        finally:
            await worker.stop()
            await r.aclose()

    try:
        applied = asyncio.run(main())
    finally:
        server.kill()
        server.wait()
    assert applied == [3]  # versions applied after start, in order, none out of order
