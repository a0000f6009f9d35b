"""The router service against a real Redis: compare-and-set, validation, watch, load, balancing."""

from __future__ import annotations

import asyncio
import json
import re
import time

import grpc
import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.trace import TracerProvider

from prometheus_client import generate_latest

from cotserve.common.v1 import common_pb2
from cotserve.common import moe_protocol as protocol
from cotserve.router.server import (
    RouterConfig, balance_once, balancedness, consume_load, expert_load, proportional_rule, sign_rule, start_router,
)
from cotserve.router.v1 import router_pb2, router_pb2_grpc
from tests.metrics import parse_metrics, value

SHAPE = {"num_experts": 4, "top_k": 2, "moe_layers": [0, 1]}


def with_router(redis_url, body, **cfg):
    async def main():
        r = aioredis.Redis.from_url(redis_url)
        await r.set(protocol.shape_key("m"), json.dumps(SHAPE))
        router = await start_router(RouterConfig(redis_url=redis_url, port=0, balance=False, **cfg), TracerProvider())
        try:
            async with grpc.aio.insecure_channel(router.server.address) as ch:
                return await body(router_pb2_grpc.RouterServiceStub(ch), r, router)
        finally:
            await router.stop()
            await r.aclose()

    return asyncio.run(main())


def layer_policy(**layer) -> common_pb2.ExpertPolicy:
    p = common_pb2.ExpertPolicy(model="m")
    p.layers.add(**layer)
    return p


def test_set_policy_is_compare_and_set_and_validated(redis_url):
    async def body(stub, r, router):
        assert (await stub.GetPolicy(router_pb2.GetPolicyRequest(model="m"))).policy.version == 0
        v1 = (await stub.SetPolicy(router_pb2.SetPolicyRequest(policy=layer_policy(layer=0, disabled_experts=[3]),
                                                               expected_version=0))).policy
        errors = []
        for req in (
            router_pb2.SetPolicyRequest(policy=layer_policy(layer=0), expected_version=0),  # stale
            router_pb2.SetPolicyRequest(policy=layer_policy(layer=0, expert_bias=[1.0, 2.0]), expected_version=1),
            router_pb2.SetPolicyRequest(policy=layer_policy(layer=7), expected_version=1),
            router_pb2.SetPolicyRequest(policy=layer_policy(layer=1, disabled_experts=[0, 1, 2]), expected_version=1),
            router_pb2.SetPolicyRequest(policy=common_pb2.ExpertPolicy(model="nope"), expected_version=0),
            router_pb2.SetPolicyRequest(policy=layer_policy(layer=1, expert_bias=[0.0, float("nan"), 0.0, 0.0]), expected_version=1),
            router_pb2.SetPolicyRequest(policy=layer_policy(layer=0, expert_bias=[0.0, 0.0, 0.0, float("-inf")]), expected_version=1),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SetPolicy(req)
            errors.append((err.value.code(), err.value.details()))
        stored = common_pb2.ExpertPolicy()
        stored.ParseFromString(await r.get(protocol.policy_key("m")))
        return v1, errors, stored, parse_metrics(generate_latest(router.servicer.metrics.registry).decode())

    v1, errors, stored, m = with_router(redis_url, body)
    assert value(m, "cotserve_router_policy_publishes_total", model="m", source="operator") == 1  # the refused: none
    assert value(m, "cotserve_router_policy_version", model="m") == 1
    assert v1.version == 1 and stored.version == 1 and list(stored.layers[0].disabled_experts) == [3]
    assert "traceparent" in stored.trace_context
    assert errors[0] == (grpc.StatusCode.ABORTED, "expected_version: 0 is stale; the current version is 1")
    assert errors[1] == (grpc.StatusCode.INVALID_ARGUMENT, "policy.layers[0].expert_bias: 2 values, the model has 4 experts")
    assert errors[2][0] == grpc.StatusCode.INVALID_ARGUMENT and "layers[7]: not an MoE layer" in errors[2][1]
    assert errors[3] == (grpc.StatusCode.INVALID_ARGUMENT,
                         "policy.layers[1].disabled_experts: 3 disabled leaves fewer than top_k (2) experts")
    assert errors[4] == (grpc.StatusCode.NOT_FOUND, "model: no worker of 'nope' has registered its experts")
    assert errors[5] == (grpc.StatusCode.INVALID_ARGUMENT, "policy.layers[1].expert_bias[1]: nan is not a finite number")
    assert errors[6] == (grpc.StatusCode.INVALID_ARGUMENT, "policy.layers[0].expert_bias[3]: -inf is not a finite number")


def test_a_worker_refuses_a_non_finite_policy_that_reaches_it():
    """Straight onto the channel, past the router: the worker's parse rejects it, naming the expert."""
    bad = layer_policy(layer=0, expert_bias=[0.0, float("inf"), 0.0, 0.0])
    with pytest.raises(protocol.PolicyError, match=re.escape("layers[0].expert_bias[1]: inf is not a finite number")):
        protocol.parse(bad.SerializeToString(), model="m", num_experts=4, top_k=2, moe_layers={0, 1})


def test_watch_streams_each_new_version(redis_url):
    async def body(stub, r, router):
        seen = []

        async def watch():
            async for msg in stub.WatchPolicy(router_pb2.WatchPolicyRequest(model="m")):
                seen.append(msg.policy.version)
                if len(seen) == 3:
                    return

        task = asyncio.create_task(watch())
        await asyncio.sleep(0.2)
        for v in (0, 1):
            await stub.SetPolicy(router_pb2.SetPolicyRequest(policy=layer_policy(layer=0), expected_version=v))
        await asyncio.wait_for(task, 5)
        return seen

    assert with_router(redis_url, body) == [0, 1, 2]


def window(load: dict[int, list[int]]) -> dict[str, str]:
    return {"worker": "w", "end_unix_ms": str(int(time.time() * 1000)), "window_s": "1", "policy_version": "0",
            "load": json.dumps({str(k): v for k, v in load.items()})}


def test_load_windows_are_counted_exactly_once_across_a_router_restart(redis_url):
    async def main():
        r = aioredis.Redis.from_url(redis_url)
        await r.set(protocol.shape_key("m"), json.dumps(SHAPE))
        stream = protocol.load_stream("m")
        for _ in range(3):
            await r.xadd(stream, window({0: [1, 2, 3, 4], 1: [5, 0, 0, 5]}))
        await r.xgroup_create(stream, protocol.LOAD_GROUP, id="0")
        # a router that read the windows and died before acknowledging them
        await r.xreadgroup(protocol.LOAD_GROUP, "router-1", {stream: ">"}, count=2)
        folded = await consume_load(r, "m")  # the restarted router: its pending two, then the third
        again = await consume_load(r, "m")
        load = await expert_load(r, "m", 10)
        pending = await r.xpending(stream, protocol.LOAD_GROUP)
        await r.aclose()
        return folded, again, load, pending

    folded, again, load, pending = asyncio.run(main())
    assert (folded, again) == (3, 0)
    assert load == {0: [3, 6, 9, 12], 1: [15, 0, 0, 15]}
    assert pending["pending"] == 0


def test_sign_rule_and_balancedness():
    assert sign_rule([0.0, 0.0, 0.0, 0.0], [10, 0, 5, 5], 0.1) == [-0.1, 0.1, 0.0, 0.0]
    assert proportional_rule([0.0, 0.0, 0.0, 0.0], [20, 0, 6, 6], 0.1) == pytest.approx([-0.1, 0.1, 0.025, 0.025])
    assert proportional_rule([1.0, 2.0], [0, 0], 0.1) == [1.0, 2.0]
    assert balancedness([5, 5, 5, 5]) == 1.0 and balancedness([20, 0, 0, 0]) == 0.25 and balancedness([0, 0]) == 0.0


def test_balancing_round_publishes_a_nudged_bias_and_get_expert_load_reports_it(redis_url):
    async def body(stub, r, router):
        await r.xadd(protocol.load_stream("m"), window({0: [30, 10, 0, 0], 1: [10, 10, 10, 10]}))
        await consume_load(r, "m")
        from cotserve.router.server import RouterServicer

        servicer = RouterServicer(r, RouterConfig(redis_url=redis_url, gamma=0.5))
        published = await balance_once(servicer, "m")
        load = await stub.GetExpertLoad(router_pb2.GetExpertLoadRequest(model="m", window_ms=10_000))
        return published, load, parse_metrics(generate_latest(servicer.metrics.registry).decode())

    published, load, m = with_router(redis_url, body)
    assert value(m, "cotserve_router_policy_publishes_total", model="m", source="balance") == 1
    assert round(value(m, "cotserve_router_expert_balancedness", model="m"), 3) == round((1 / 3 + 1) / 2, 3)
    layers = {l.layer: list(l.expert_bias) for l in published.layers}
    assert published.version == 1 and layers[0] == [-0.5, 0.0, 0.5, 0.5] and layers[1] == [0.0] * 4
    assert [list(l.tokens_per_expert) for l in load.layers] == [[30, 10, 0, 0], [10, 10, 10, 10]]
    assert [round(l.balancedness, 3) for l in load.layers] == [0.333, 1.0]


def test_set_policy_reaches_a_worker_in_the_same_trace(redis_url, mixtral):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from cotserve.worker.config import WorkerConfig
    from cotserve.worker.server import start_worker

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def main():
        worker = await start_worker(WorkerConfig(model=mixtral, port=0, max_num_seqs=2, redis_url=redis_url), provider)
        router = await start_router(RouterConfig(redis_url=redis_url, port=0, balance=False), provider)
        try:
            async with grpc.aio.insecure_channel(router.server.address) as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                p = common_pb2.ExpertPolicy(model="tiny-moe")
                p.layers.add(layer=1, disabled_experts=[0])
                start = time.monotonic()
                v = (await stub.SetPolicy(router_pb2.SetPolicyRequest(policy=p, expected_version=0))).policy.version
                while worker.engine.policy_version != v:
                    assert time.monotonic() - start < 5
                    await asyncio.sleep(0.002)
                return v
        finally:
            await router.stop()
            await worker.stop()

    assert asyncio.run(main()) == 1
    spans = exporter.get_finished_spans()
    (set_span,) = [s for s in spans if s.name.endswith("/SetPolicy")]
    (apply_span,) = [s for s in spans if s.name == "moe.apply_policy v1"]
    assert apply_span.context.trace_id == set_span.context.trace_id
    assert apply_span.parent.span_id == set_span.context.span_id
