"""The gateway sends a worker its requests as streams of one Multiplex call (`gateway/multiplex.py`): the answers are
a Generate call's to the token, a client's cancel or deadline reaches the worker, and a worker without Multiplex (an
older build) is called per request, the first request included. Real worker and gateway, in this process."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from cotserve.common.v1 import common_pb2
from cotserve.gateway.config import GatewayConfig
from cotserve.gateway.server import start_gateway
from cotserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import WorkerServicer, start_worker
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

PROMPTS = ["37+48-12=", "5*6+1=", "12+30=", "9-4="]


def request(prompt: str, **sampling) -> gateway_pb2.GenerateStreamRequest:
    return gateway_pb2.GenerateStreamRequest(prompt=prompt, sampling=common_pb2.SamplingParams(**sampling))


async def answers(address: str, n: int = 40) -> list[list[gateway_pb2.GenerateStreamResponse]]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)

        async def one(p: str):
            return [c async for c in stub.GenerateStream(request(p, max_new_tokens=n, ignore_eos=True, logprobs=True),
                                                          timeout=60)]
        return await asyncio.gather(*(one(p) for p in PROMPTS))


async def wait_idle(worker, timeout_s: float = 5.0) -> None:
    async with grpc.aio.insecure_channel(worker.server.address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        for _ in range(int(timeout_s / 0.05)):
            s = await stub.Stats(worker_pb2.StatsRequest())
            if s.kv_blocks_used == 0 and s.num_running_seqs == 0 and s.num_waiting_seqs == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the worker still holds work: {s}")


@contextlib.asynccontextmanager
async def worker_and_gateway(max_num_seqs: int = 8, engine_process: bool = False, **gateway_settings):
    """A worker (its engine on a thread unless `engine_process`) and a gateway in front of it, in this process."""
    worker = await start_worker(WorkerConfig(engine_process=engine_process, port=0, max_num_seqs=max_num_seqs))
    gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], **gateway_settings))
    try:
        yield worker, gateway
    finally:
        await gateway.stop()
        await worker.stop()


def flat(chunks, field: str) -> list:
    return [x for c in chunks for x in getattr(c, field)]


def test_streams_of_one_call_give_what_a_call_per_request_gives():
    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=8))
        muxed = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address]))
        per_call = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], worker_multiplex=False))
        try:
            calls_seen: list[int] = []
            watching = asyncio.get_running_loop().create_task(watch(worker.servicer, calls_seen))
            via_calls = await answers(per_call.server.address)
            watching.cancel()
            assert max(calls_seen, default=0) == 0  # no Multiplex call
            calls_seen.clear()
            watching = asyncio.get_running_loop().create_task(watch(worker.servicer, calls_seen))
            via_mux = await answers(muxed.server.address)
            watching.cancel()
            assert max(calls_seen) == 1  # the four requests: one Multiplex call
            for a, b in zip(via_mux, via_calls):
                assert flat(a, "token_ids") == flat(b, "token_ids") and len(flat(a, "token_ids")) == 40
                assert "".join(c.text for c in a) == "".join(c.text for c in b)
                assert flat(a, "logprobs") == flat(b, "logprobs")
                assert a[-1].usage.completion_tokens == 40 and a[-1].finish_reason == b[-1].finish_reason
            assert len(muxed.pool.workers[0].streams._link.streams) == 0  # every stream ended and was let go
        finally:
            await muxed.stop()
            await per_call.stop()
            await worker.stop()

    async def watch(servicer: WorkerServicer, seen: list[int]) -> None:
        while True:
            seen.append(len(servicer.mux_calls))
            await asyncio.sleep(0.002)

    asyncio.run(main())


def test_a_client_cancel_and_a_deadline_reach_the_worker_through_the_multiplexed_call():
    async def main():
        async with worker_and_gateway(max_num_seqs=8) as (worker, gateway):
            async with grpc.aio.insecure_channel(gateway.server.address) as ch:
                stub = gateway_pb2_grpc.GatewayServiceStub(ch)
                call = stub.GenerateStream(request("1+2+3=", max_new_tokens=250, ignore_eos=True), timeout=60)
                assert (await call.read()).token_ids
                call.cancel()
                await wait_idle(worker)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.GenerateStream(request("1+2+3=", max_new_tokens=250, ignore_eos=True), timeout=0.1):
                        pass
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await wait_idle(worker)
                # the call is still there for the next request
                (chunks,) = [[c async for c in stub.GenerateStream(request("2+2=", max_new_tokens=4), timeout=30)]]
                assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert len(worker.servicer.mux_calls) == 1

    asyncio.run(main())


def test_a_worker_without_multiplex_is_called_per_request_from_the_first_request_on(monkeypatch):
    # an older worker build: its servicer has no Multiplex, which gRPC answers UNIMPLEMENTED
    monkeypatch.setattr(WorkerServicer, "Multiplex", worker_pb2_grpc.WorkerServiceServicer.Multiplex)

    async def main():
        async with worker_and_gateway(max_num_seqs=8) as (worker, gateway):
            first = await answers(gateway.server.address, n=8)
            assert all(len(flat(a, "token_ids")) == 8 for a in first)
            assert gateway.pool.workers[0].streams.unimplemented
            again = await answers(gateway.server.address, n=8)
            assert [flat(a, "token_ids") for a in again] == [flat(a, "token_ids") for a in first]

    asyncio.run(main())


def test_an_engine_that_dies_mid_stream_ends_the_multiplexed_streams_unavailable_and_nothing_hangs():
    """The engine process killed while a stream runs through the gateway: the client gets UNAVAILABLE naming the
    engine, the next request fails at once (the worker is out of rotation, no other serves the model), no hang."""
    import os
    import signal

    async def main():
        async with worker_and_gateway(max_num_seqs=4, engine_process=True, worker_wait_s=0) as (worker, gateway):
            async with grpc.aio.insecure_channel(gateway.server.address) as ch:
                stub = gateway_pb2_grpc.GatewayServiceStub(ch)
                call = stub.GenerateStream(request("1+2+3=", max_new_tokens=250, ignore_eos=True), timeout=30)
                assert (await call.read()).token_ids
                os.kill(worker.engine.pid, signal.SIGKILL)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "engine" in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as again:
                    await asyncio.wait_for(answers(gateway.server.address, n=4), 10)
                assert again.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_many_streams_cancelled_timed_out_and_finished_at_once_leave_nothing_behind():
    """24 requests at once on one call: a third cancelled by their clients after a few chunks, a third past a short
    deadline, a third read to the end. Every finished one has all its tokens; the cancels reached the engine (the
    cancelled requests asked for 250 tokens: had they run on, the engine would have generated 3,920 in all);
    afterwards the worker holds no page or sequence, and neither end of the call keeps a stream."""
    import random

    async def main():
        rng = random.Random(7)
        async with worker_and_gateway(max_num_seqs=32) as (worker, gateway):
            async with grpc.aio.insecure_channel(gateway.server.address) as ch:
                stub = gateway_pb2_grpc.GatewayServiceStub(ch)

                async def one(i: int) -> str:
                    kind = ("cancel", "deadline", "finish")[i % 3]
                    call = stub.GenerateStream(request(f"{i}+{i}=", max_new_tokens=250 if kind == "cancel" else 120,
                                                       ignore_eos=True),
                                               timeout=0.15 if kind == "deadline" else 60)
                    tokens = 0
                    try:
                        while (chunk := await call.read()) is not grpc.aio.EOF:
                            tokens += len(chunk.token_ids)
                            if kind == "cancel" and tokens >= rng.randint(1, 20):
                                call.cancel()
                                return "cancelled"
                    except grpc.aio.AioRpcError as err:
                        return err.code().name
                    return f"finished {tokens}"

                results = await asyncio.gather(*(one(i) for i in range(24)))
            assert results[2::3] == ["finished 120"] * 8
            assert results[0::3] == ["cancelled"] * 8
            assert set(results[1::3]) <= {"DEADLINE_EXCEEDED", "finished 120"} and "DEADLINE_EXCEEDED" in results[1::3]
            await wait_idle(worker)
            generated = worker.engine.stats().num_generated_tokens_total
            assert generated <= 8 * 120 + 8 * 120 + 8 * 125, generated  # the cancelled ones stopped well short of 250
            await asyncio.sleep(0.1)  # (the cancels' writes and the worker's stream tasks finish)
            (call,) = worker.servicer.mux_calls
            assert call.streams == {} and gateway.pool.workers[0].streams._link.streams == {}

    asyncio.run(main())


def test_clients_that_cancel_at_once_do_not_break_the_call_other_streams_are_on():
    """Requests cancelled by their clients as soon as sent (the gateway may be writing their open just then) cost
    the other streams on the worker's call nothing: a long stream running beside 120 of them finishes whole."""
    async def main():
        async with worker_and_gateway(max_num_seqs=8) as (worker, gateway):
            async with grpc.aio.insecure_channel(gateway.server.address) as ch:
                stub = gateway_pb2_grpc.GatewayServiceStub(ch)
                long = stub.GenerateStream(request("1+2+3=", max_new_tokens=200, ignore_eos=True), timeout=60)
                tokens = len((await long.read()).token_ids)

                async def cancelled_at_once(i: int, delay_s: float) -> None:
                    call = stub.GenerateStream(request(f"{i}+1=", max_new_tokens=50), timeout=60)
                    await asyncio.sleep(delay_s)
                    call.cancel()

                await asyncio.gather(*(cancelled_at_once(i, (i % 12) * 0.00025) for i in range(120)))
                while (chunk := await long.read()) is not grpc.aio.EOF:
                    tokens += len(chunk.token_ids)
                assert tokens == 200 and await long.code() == grpc.StatusCode.OK
            await wait_idle(worker)

    asyncio.run(main())
