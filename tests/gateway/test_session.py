"""The gateway's `Session` (`gateway/session.py`) as the SDK uses it (`AsyncClient(multiplex=True)`): the answers are
a GenerateStream call's to the token, each stream fails alone with the status (and trailers) its own call would have
had, a cancel or a deadline reaches the worker, the call's API key is checked (and its tenant's classes) for every
stream, and a gateway without Session (an older build) is called per request. Real worker and gateway, in this
process."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from cotserve.gateway.admission import AdmissionConfig
from cotserve.bench.relay import BareRelay
from cotserve.gateway.v1 import gateway_pb2_grpc
from cotserve.gateway.tenants import add_key
from cotserve.sdk import AsyncClient, DeadlineExceeded, InvalidArgument, PermissionDenied, ResourceExhausted, Unauthenticated
from cotserve.worker.v1 import worker_pb2_grpc
from tests.gateway.test_multiplex import PROMPTS, wait_idle, worker_and_gateway


async def streamed(client: AsyncClient, prompt: str, **kw) -> list:
    return [c async for c in client.stream(prompt, **kw)]


def test_session_streams_give_what_a_call_per_request_gives():
    async def main():
        async with worker_and_gateway(max_num_seqs=8) as (worker, gateway):
            servicer = gateway.servicer
            kw = dict(max_new_tokens=40, ignore_eos=True, logprobs=True, timeout_s=60)
            async with AsyncClient(gateway.server.address) as per_call:
                via_calls = await asyncio.gather(*(streamed(per_call, p, **kw) for p in PROMPTS))
            assert not servicer.mux_calls
            seen: list[int] = []

            async def watch() -> None:
                while True:
                    seen.append(len(servicer.mux_calls))
                    await asyncio.sleep(0.002)

            watching = asyncio.get_running_loop().create_task(watch())
            async with AsyncClient(gateway.server.address, multiplex=True) as muxed:
                via_session = await asyncio.gather(*(streamed(muxed, p, **kw) for p in PROMPTS))
                link = muxed._session._link
                assert link is not None and not link.streams  # every stream ended and was let go
            watching.cancel()
            assert max(seen) == 1  # the four requests: one Session call
            for a, b in zip(via_session, via_calls):
                assert [t for c in a for t in c.token_ids] == [t for c in b for t in c.token_ids]
                assert len([t for c in a for t in c.token_ids]) == 40
                assert "".join(c.text for c in a) == "".join(c.text for c in b)
                assert [x for c in a for x in c.logprobs] == [x for c in b for x in c.logprobs]
                assert a[-1].finish_reason == b[-1].finish_reason == "length"
            await wait_idle(worker)

    asyncio.run(main())


def test_a_bad_request_fails_its_own_stream_and_no_other():
    async def main():
        async with worker_and_gateway(max_num_seqs=8) as (_, gateway):
            async with AsyncClient(gateway.server.address, multiplex=True) as client:
                good = asyncio.get_running_loop().create_task(
                    streamed(client, "12+30=", max_new_tokens=30, ignore_eos=True, timeout_s=60))
                with pytest.raises(InvalidArgument) as err:
                    await streamed(client, "1+1=", max_new_tokens=4, temperature=-1.0)
                assert "temperature" in err.value.message
                chunks = await good
                assert sum(len(c.token_ids) for c in chunks) == 30
                # the session is still there for the next request
                assert sum(len(c.token_ids) for c in await streamed(client, "2+2=", max_new_tokens=4)) == 4
                assert len(gateway.servicer.mux_calls) == 1

    asyncio.run(main())


def test_a_full_queue_answers_a_session_stream_with_its_retry_after():
    async def main():
        # one BATCH request runs, one waits, the third finds the queue full
        async with worker_and_gateway(max_num_seqs=8, admission=AdmissionConfig(batch_limit=1, max_queue_batch=1)) as (_, gateway):
            async with AsyncClient(gateway.server.address, multiplex=True) as client:
                long = dict(max_new_tokens=200, ignore_eos=True, sla="batch", timeout_s=60)
                running = client.stream("1+2+3=", **long)
                assert (await running.__anext__()).token_ids
                waiting = asyncio.get_running_loop().create_task(streamed(client, "4+5=", **long))
                while not any(gateway.pool.workers[0].admission.queues.values()):
                    await asyncio.sleep(0.01)
                with pytest.raises(ResourceExhausted) as err:
                    await streamed(client, "6+7=", **long)
                assert "queue" in err.value.message and err.value.retry_after_ms is not None and err.value.retry_after_ms > 0
                await running.aclose()
                assert sum(len(c.token_ids) for c in await waiting) == 200

    asyncio.run(main())


def test_a_cancel_and_a_deadline_reach_the_worker_through_the_session():
    async def main():
        async with worker_and_gateway(max_num_seqs=8) as (worker, gateway):
            async with AsyncClient(gateway.server.address, multiplex=True) as client:
                stream = client.stream("1+2+3=", max_new_tokens=250, ignore_eos=True, timeout_s=60)
                assert (await stream.__anext__()).token_ids
                await stream.aclose()  # the consumer is done: the stream is cancelled on the gateway and the worker
                await wait_idle(worker)
                with pytest.raises(DeadlineExceeded):
                    await streamed(client, "1+2+3=", max_new_tokens=250, ignore_eos=True, timeout_s=0.1)
                await wait_idle(worker)
                chunks = await streamed(client, "2+2=", max_new_tokens=4)
                assert chunks[-1].finish_reason == "length"
            for _ in range(100):  # the client closed: its Session call ends on the gateway too
                if not gateway.servicer.mux_calls:
                    break
                await asyncio.sleep(0.05)
            assert not gateway.servicer.mux_calls

    asyncio.run(main())


def test_a_gateway_without_session_is_called_per_request():
    """An older gateway build (here the bare relay, which has GenerateStream only) answers Session UNIMPLEMENTED: the
    SDK sends that request and every later one as a call of its own."""
    async def main():
        async with worker_and_gateway(max_num_seqs=8) as (worker, _):
            async with contextlib.AsyncExitStack() as stack:
                channel = await stack.enter_async_context(grpc.aio.insecure_channel(worker.server.address))
                relay = grpc.aio.server()
                gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
                    BareRelay(worker_pb2_grpc.WorkerServiceStub(channel)), relay)
                port = relay.add_insecure_port("127.0.0.1:0")
                await relay.start()
                stack.push_async_callback(relay.stop, None)
                async with AsyncClient(f"127.0.0.1:{port}", multiplex=True) as client:
                    first = await streamed(client, "12+30=", max_new_tokens=8, ignore_eos=True, timeout_s=30)
                    assert client._session.unimplemented
                    again = await streamed(client, "12+30=", max_new_tokens=8, ignore_eos=True, timeout_s=30)
                assert [t for c in first for t in c.token_ids] == [t for c in again for t in c.token_ids]
                assert len([t for c in first for t in c.token_ids]) == 8

    asyncio.run(main())


def test_a_session_is_one_tenant_and_its_key_is_checked_for_every_stream(tmp_path):
    path = tmp_path / "tenants.toml"
    key = add_key(path, "acme")  # INTERACTIVE and BATCH, no limits (no Redis)

    async def main():
        async with worker_and_gateway(max_num_seqs=8, tenants_file=path) as (_, gateway):
            address = gateway.server.address
            async with AsyncClient(address, multiplex=True, api_key="cs-not-a-key") as stranger:
                with pytest.raises(Unauthenticated):
                    await streamed(stranger, "1+1=", max_new_tokens=2)
            async with AsyncClient(address, multiplex=True, api_key=key) as acme:
                assert sum(len(c.token_ids) for c in await streamed(acme, "1+1=", max_new_tokens=3)) == 3
                with pytest.raises(PermissionDenied):  # the tenant's classes hold for each stream
                    await streamed(acme, "1+1=", max_new_tokens=2, sla="realtime")
                with pytest.raises(Unauthenticated):  # another key for one request: a call of its own, with that key
                    await streamed(acme, "1+1=", max_new_tokens=2, api_key="cs-someone-else")
                assert sum(len(c.token_ids) for c in await streamed(acme, "2+2=", max_new_tokens=3)) == 3
                assert len(gateway.servicer.mux_calls) == 1

    asyncio.run(main())


def test_one_session_may_not_open_more_streams_than_its_cap():
    """`max_session_streams`: past it, one more stream on the same call is RESOURCE_EXHAUSTED naming the limit (one
    client cannot fill the workers' queues through one call); once one ends, a new one is served."""
    async def main():
        async with worker_and_gateway(max_num_seqs=8, max_session_streams=2) as (worker, gateway):
            async with AsyncClient(gateway.server.address, multiplex=True) as client:
                long = dict(max_new_tokens=200, ignore_eos=True, timeout_s=60)
                first, second = client.stream("1+2=", **long), client.stream("3+4=", **long)
                assert (await first.__anext__()).token_ids and (await second.__anext__()).token_ids
                with pytest.raises(ResourceExhausted) as err:
                    await streamed(client, "5+6=", max_new_tokens=4)
                assert "2 streams are open on this call, at most 2 allowed (max_session_streams)" in err.value.message
                await first.aclose()
                while len(next(iter(gateway.servicer.mux_calls)).streams) > 1:
                    await asyncio.sleep(0.01)
                assert sum(len(c.token_ids) for c in await streamed(client, "5+6=", max_new_tokens=4)) == 4
                await second.aclose()
            await wait_idle(worker)

    asyncio.run(main())
