"""Workers found through DNS (`--worker-dns NAME:PORT`, a Kubernetes headless Service): the gateway re-resolves the
name, takes new workers into rotation and drains the ones that left, within 10 s, with real worker processes. The
resolver is a stub the test controls (an answer of HOST:PORT addresses, as the system's resolver gives for the
Service's pods); the system's own resolver is checked on `localhost`."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cotserve.common.v1 import common_pb2
from cotserve.gateway.config import GatewayConfig, split_name
from cotserve.gateway.pool import resolve_dns
from cotserve.gateway.server import start_gateway
from cotserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cotserve.sdk import AsyncClient
from tests.conftest import start_worker, stop_process, worker_stats
from tests.gateway.test_coalescing import SLOW_READER


@pytest.fixture(scope="module")
def second_worker():
    proc, address = start_worker("--max-num-seqs", "8")
    yield address
    stop_process(proc)


async def _until(condition, timeout_s: float) -> float:
    """Seconds until `condition()` holds (fails after `timeout_s`)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "not within the time allowed"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def test_scale_up_and_down_are_seen_within_ten_seconds_and_a_leaving_worker_is_drained(demo_worker, second_worker):
    answer = {"workers.cotserve.svc": [demo_worker]}
    lookups: list[str] = []

    async def stub(name: str, port: int) -> list[str]:
        lookups.append(name)
        if name not in answer:
            raise OSError(f"{name}: no such name")
        return list(answer[name])

    def healthy(gw) -> set[str]:
        return {w.address for w in gw.pool.workers if w.healthy}

    async def main():
        gw = await start_gateway(GatewayConfig(port=0, worker_dns=["workers.cotserve.svc:50061"], dns_interval_s=1.0,
                                               poll_interval_s=0.2), resolve=stub)
        try:
            await _until(lambda: healthy(gw) == {demo_worker}, 10)
            async with AsyncClient(gw.server.address) as client:
                assert (await client.generate("37+48-12=", max_new_tokens=32)).text.endswith("73")
                answer["workers.cotserve.svc"] = [demo_worker, second_worker]  # scale up
                up_s = await _until(lambda: healthy(gw) == {demo_worker, second_worker}, 10)
                # a stream on one worker whose reader is slow (a small HTTP/2 window: the gateway's relay waits on it,
                # so the stream stays open on the worker's handle), then that worker leaves the answer (scale down)
                before = worker_stats(second_worker).num_requests_finished_total
                channel = grpc.aio.insecure_channel(gw.server.address, options=SLOW_READER)
                stream = gateway_pb2_grpc.GatewayServiceStub(channel).GenerateStream(gateway_pb2.GenerateStreamRequest(
                    prompt="12+30-7+5=", sampling=common_pb2.SamplingParams(max_new_tokens=200, ignore_eos=True,
                                                                            logprobs=True)), timeout=120)
                first = await stream.read()
                on_first = [w for w in gw.pool.workers if w.in_flight][0].address
                answer["workers.cotserve.svc"] = [w for w in (demo_worker, second_worker) if w != on_first]
                down_s = await _until(lambda: on_first not in {w.address for w in gw.pool.workers}, 10)
                assert [w.address for w in gw.pool.draining] == [on_first]  # still carrying the stream
                served = await client.generate("37+48-12=", max_new_tokens=8)  # new work goes to the one left
                rest = []
                while (chunk := await stream.read()) is not grpc.aio.EOF:
                    rest.append(chunk)
                await channel.close()
                await _until(lambda: not gw.pool.draining, 10)  # its stream over: closed
                answer.pop("workers.cotserve.svc")  # the name stops resolving: the pool keeps what it had
                await asyncio.sleep(2.5)
                kept = healthy(gw)
            return up_s, down_s, on_first, served, [first, *rest], before, kept
        finally:
            await gw.stop()

    up_s, down_s, on_first, served, chunks, before, kept = asyncio.run(main())
    remaining = demo_worker if on_first == second_worker else second_worker
    assert up_s <= 10 and down_s <= 10
    assert sum(len(c.token_ids) for c in chunks) == 200  # drained, not cut
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert served.text and worker_stats(remaining).num_requests_finished_total >= 1
    if remaining == second_worker:
        assert worker_stats(second_worker).num_requests_finished_total == before + 1
    assert kept == {remaining} and len(lookups) >= 5


def test_the_system_resolver_and_bad_names():
    addresses = asyncio.run(resolve_dns("localhost", 50061))
    assert "127.0.0.1:50061" in addresses
    assert split_name("workers.ns.svc.cluster.local:50061") == ("workers.ns.svc.cluster.local", 50061)
    for bad in ("workers", "workers:", ":50061", "workers:0", "workers:70000"):
        with pytest.raises(ValueError, match="worker_dns: .* is not NAME:PORT"):
            GatewayConfig(worker_dns=[bad]).validate()
    GatewayConfig(worker_dns=["workers:50061"]).validate()  # no --worker needed with a name
    with pytest.raises(ValueError, match="--worker-dns NAME:PORT"):
        GatewayConfig().validate()
