"""A worker's Multiplex call: many Generate streams over one gRPC call, spoken to as the gateway does (a real worker
process over loopback; one in this process for the drain)."""

from __future__ import annotations

import asyncio
import queue
import time

import grpc
import pytest

from cotserve.common.v1 import common_pb2
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import wait_worker_idle


def gen(prompt: str, **sampling) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(prompt_text=prompt, sampling=common_pb2.SamplingParams(**sampling))


class Mux:
    """One Multiplex call from a synchronous client: opens and cancels sent from a queue, messages read on demand."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub) -> None:
        self.outbox: queue.Queue = queue.Queue()
        self.call = stub.Multiplex(iter(self.outbox.get, None), timeout=60)
        self.messages: list[worker_pb2.MultiplexResponse] = []

    def open(self, stream_id: int, request: worker_pb2.GenerateRequest, timeout_ms: int = 0) -> None:
        self.outbox.put(worker_pb2.MultiplexRequest(open=worker_pb2.MultiplexOpen(
            stream_id=stream_id, request=request, timeout_ms=timeout_ms)))

    def cancel(self, stream_id: int) -> None:
        self.outbox.put(worker_pb2.MultiplexRequest(cancel=worker_pb2.MultiplexCancel(stream_id=stream_id)))

    def read_until_ended(self, *stream_ids: int) -> dict[int, tuple[list[worker_pb2.GenerateResponse], worker_pb2.MultiplexEnd]]:
        """Each stream's chunks and end, reading until every one of `stream_ids` has ended."""
        chunks: dict[int, list] = {i: [] for i in stream_ids}
        ends: dict[int, worker_pb2.MultiplexEnd] = {}
        while len(ends) < len(stream_ids):
            message = next(self.call)
            self.messages.append(message)
            for c in message.chunks:
                if c.HasField("end"):
                    ends[c.stream_id] = c.end
                else:
                    chunks.setdefault(c.stream_id, []).append(c.response)
        return {i: (chunks[i], ends[i]) for i in stream_ids}

    def close(self) -> None:
        self.outbox.put(None)


@pytest.fixture
def stub(demo_worker):
    with grpc.insecure_channel(demo_worker) as ch:
        yield worker_pb2_grpc.WorkerServiceStub(ch)


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_streams_on_one_call_are_what_generate_calls_give_and_share_messages(stub, demo_worker):
    reqs = {1: gen("37+48-12=", max_new_tokens=40, ignore_eos=True, logprobs=True),
            7: gen("5*6+1=", max_new_tokens=64, ignore_eos=True)}
    alone = {i: list(stub.Generate(r, timeout=60)) for i, r in reqs.items()}
    mux = Mux(stub)
    for i, r in reqs.items():
        mux.open(i, r)
    got = mux.read_until_ended(1, 7)
    mux.close()
    assert list(mux.call) == []  # the caller is done and no stream is open: the call ends, OK
    for i in reqs:
        chunks, end = got[i]
        assert end.code == "OK" and end.message == ""
        assert tokens(chunks) == tokens(alone[i]) and len(tokens(chunks)) == reqs[i].sampling.max_new_tokens
        assert "".join(c.text for c in chunks) == "".join(c.text for c in alone[i])
        assert [x for c in chunks for x in c.logprobs] == [x for c in alone[i] for x in c.logprobs]
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert chunks[-1].usage.completion_tokens == reqs[i].sampling.max_new_tokens
    # the steps both streams decoded in went out as one message each
    assert any({c.stream_id for c in m.chunks} == {1, 7} for m in mux.messages)
    wait_worker_idle(demo_worker)


def test_a_cancelled_stream_is_aborted_and_the_call_goes_on(stub, demo_worker):
    mux = Mux(stub)
    mux.open(1, gen("1+2+3=", max_new_tokens=250, ignore_eos=True))
    first = next(mux.call)
    assert first.chunks[0].stream_id == 1 and first.chunks[0].response.token_ids
    assert stub.Stats(worker_pb2.StatsRequest()).kv_blocks_used > 0
    mux.cancel(1)
    mux.open(2, gen("2+2=", max_new_tokens=8))
    got = mux.read_until_ended(2)
    assert got[2][1].code == "OK"
    stats = wait_worker_idle(demo_worker)
    assert stats.kv_blocks_free == 32 * 16
    # stream 1 never ends: a cancelled stream gets nothing more once the cancel has been read (at most what was
    # already on its way before it)
    assert not any(c.stream_id == 1 and c.HasField("end") for m in mux.messages for c in m.chunks)
    mux.close()
    assert list(mux.call) == []


def test_a_stream_error_ends_that_stream_with_its_status_not_the_call(stub, demo_worker):
    mux = Mux(stub)
    mux.open(1, gen("1+1=", temperature=-1))
    mux.open(2, gen("1+1=", max_new_tokens=200, ignore_eos=True))
    mux.open(2, gen("2+2=", max_new_tokens=4))  # stream 2 is open: refused, and the open stream 2 goes on
    mux.open(3, worker_pb2.GenerateRequest(prompt_text="1+1=", prompt_token_ids=[1, 2]))
    got = mux.read_until_ended(1, 2, 3)  # (stream 2's first end: the refused open's)
    assert got[1][1].code == "INVALID_ARGUMENT" and "temperature" in got[1][1].message and not got[1][0]
    assert got[3][1].code == "INVALID_ARGUMENT" and "prompt" in got[3][1].message
    assert got[2][1].code == "INVALID_ARGUMENT" and "stream_id: 2 is already open" in got[2][1].message
    rest, end = mux.read_until_ended(2)[2]
    assert end.code == "OK" and len(tokens(got[2][0] + rest)) == 200  # the first stream 2, whole
    mux.close()
    wait_worker_idle(demo_worker)


def test_a_stream_past_its_deadline_ends_deadline_exceeded_and_frees_its_pages(stub, demo_worker):
    mux = Mux(stub)
    mux.open(1, gen("1+2+3=", max_new_tokens=250, ignore_eos=True), timeout_ms=50)
    chunks, end = mux.read_until_ended(1)[1]
    assert end.code == "DEADLINE_EXCEEDED" and "50 ms" in end.message
    assert len(tokens(chunks)) < 250
    mux.close()
    wait_worker_idle(demo_worker)


def test_the_caller_going_away_aborts_every_stream_it_had_open(stub, demo_worker):
    mux = Mux(stub)
    for i in (1, 2):
        mux.open(i, gen(f"{i}+{i}=", max_new_tokens=250, ignore_eos=True))
    seen: set[int] = set()
    while seen != {1, 2}:
        seen |= {c.stream_id for c in next(mux.call).chunks}
    assert stub.Stats(worker_pb2.StatsRequest()).num_running_seqs == 2
    mux.call.cancel()
    wait_worker_idle(demo_worker)


def test_a_stopping_worker_finishes_its_streams_refuses_new_ones_and_ends_the_call():
    """The drain: a stream in flight finishes whole, a stream opened meanwhile is UNAVAILABLE (the gateway sends it
    elsewhere), and the call ends as soon as its streams have, well before the grace period."""
    from cotserve.worker.config import WorkerConfig
    from cotserve.worker.server import start_worker

    async def scenario() -> None:
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4))
        try:
            async with grpc.aio.insecure_channel(worker.server.address) as ch:
                call = worker_pb2_grpc.WorkerServiceStub(ch).Multiplex()
                await call.write(worker_pb2.MultiplexRequest(open=worker_pb2.MultiplexOpen(
                    stream_id=1, request=gen("1+2=", max_new_tokens=250, ignore_eos=True))))
                first = await call.read()
                assert first.chunks[0].stream_id == 1
                started = time.monotonic()
                stopping = asyncio.get_running_loop().create_task(worker.stop(20))
                while not worker.servicer.draining:
                    await asyncio.sleep(0.001)
                await call.write(worker_pb2.MultiplexRequest(open=worker_pb2.MultiplexOpen(
                    stream_id=2, request=gen("1+1=", max_new_tokens=4))))
                got: dict[int, list] = {1: list(first.chunks), 2: []}
                while (message := await call.read()) is not grpc.aio.EOF:
                    for c in message.chunks:
                        got[c.stream_id].append(c)
                assert await call.code() == grpc.StatusCode.OK
                await stopping
                assert time.monotonic() - started < 10
            assert [c.end.code for c in got[2]] == ["UNAVAILABLE"] and "shutting down" in got[2][0].end.message
            assert got[1][-1].end.code == "OK"
            assert sum(len(c.response.token_ids) for c in got[1]) == 250
        finally:
            await worker.stop(0)

    asyncio.run(scenario())
