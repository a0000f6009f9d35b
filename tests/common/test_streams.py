"""Merging a stream's pending chunks (common/streams): every token kept, in order, per sample and part."""

from __future__ import annotations

import asyncio

import pytest

from cotserve.common.streams import ReadAhead, coalesce
from cotserve.common.v1 import common_pb2
from cotserve.gateway.v1 import gateway_pb2
from cotserve.worker.v1 import worker_pb2

R, A = common_pb2.TEXT_PART_REASONING, common_pb2.TEXT_PART_ANSWER


def chunk(cls, index: int, token: int, text: str, part=A, **fields):
    msg = cls(index=index, text=text, part=part, token_ids=[token], logprobs=[-float(token)], **fields)
    return msg


@pytest.mark.parametrize("cls", [worker_pb2.GenerateResponse, gateway_pb2.GenerateStreamResponse])
def test_pending_chunks_merge_per_sample_and_part_keeping_every_token_in_order(cls):
    stop = common_pb2.FINISH_REASON_STOP
    pending = [
        chunk(cls, 0, 1, "<t>", R), chunk(cls, 1, 11, "a", A), chunk(cls, 0, 2, "x", R),
        chunk(cls, 1, 12, "b", A, finish_reason=stop), chunk(cls, 0, 3, "</t>", R),
        chunk(cls, 0, 4, " 7", A), chunk(cls, 0, 5, "3", A, finish_reason=stop),
    ]
    pending[-1].usage.completion_tokens = 7
    pending[-1].timing.total_ms = 5.0
    out = coalesce(pending)
    assert [(c.index, c.part, list(c.token_ids), c.text) for c in out] == [
        (0, R, [1, 2, 3], "<t>x</t>"), (1, A, [11, 12], "ab"), (0, A, [4, 5], " 73"),
    ]
    assert [list(c.logprobs) for c in out] == [[-1, -2, -3], [-11, -12], [-4, -5]]
    assert [c.finish_reason for c in out] == [0, stop, stop]
    assert out[-1].usage.completion_tokens == 7 and out[-1].timing.total_ms == 5.0  # the stream's end is still last


def test_a_finished_sample_or_the_streams_end_starts_a_new_chunk():
    cls = worker_pb2.GenerateResponse
    stop = common_pb2.FINISH_REASON_STOP
    done = chunk(cls, 0, 1, "a", finish_reason=stop)
    later = chunk(cls, 1, 2, "b")
    last = chunk(cls, 0, 3, "c")  # joins nothing: its sample's latest chunk is finished
    last.usage.completion_tokens = 3
    assert [list(c.token_ids) for c in coalesce([done, later, last])] == [[1], [2], [3]]
    # the stream's last chunk does not jump ahead of another sample's chunk to join its own
    a, b, end = chunk(cls, 0, 1, "a"), chunk(cls, 1, 2, "b"), chunk(cls, 0, 3, "c", finish_reason=stop)
    end.usage.completion_tokens = 3
    out = coalesce([a, b, end])
    assert [list(c.token_ids) for c in out] == [[1], [2], [3]] and out[-1].HasField("usage")
    # ... but does join its own when that is the latest chunk
    a, end = chunk(cls, 0, 1, "a"), chunk(cls, 0, 2, "b", finish_reason=stop)
    end.usage.completion_tokens = 2
    (only,) = coalesce([a, end])
    assert list(only.token_ids) == [1, 2] and only.text == "ab" and only.usage.completion_tokens == 2


def test_a_cancelled_samples_last_chunk_carries_no_token_and_merges_cleanly():
    cls = gateway_pb2.GenerateStreamResponse
    a = chunk(cls, 0, 1, "a")
    cancelled = cls(index=0, text="", part=A, finish_reason=common_pb2.FINISH_REASON_CANCELLED)
    (only,) = coalesce([a, cancelled])
    assert list(only.token_ids) == [1] and only.finish_reason == common_pb2.FINISH_REASON_CANCELLED


def test_read_ahead_holds_what_arrives_while_the_consumer_is_busy_then_raises_the_streams_error():
    async def main():
        go, sent = asyncio.Event(), asyncio.Event()

        async def stream():
            yield 0
            await go.wait()
            for i in range(1, 5):
                yield i
            sent.set()
            raise RuntimeError("worker gone")

        reader = ReadAhead(stream())
        first = await reader.pending()
        go.set()
        await sent.wait()  # the consumer was busy while the rest arrived
        rest = await reader.pending()
        with pytest.raises(RuntimeError, match="worker gone"):
            await reader.pending()
        return first, rest

    assert asyncio.run(main()) == ([0], [1, 2, 3, 4])  # what arrived meanwhile comes in one go


def test_read_ahead_ends_with_none_and_close_stops_reading():
    async def main():
        async def short():
            yield "a"

        reader = ReadAhead(short())
        got = [await reader.pending(), await reader.pending()]

        async def endless():
            while True:
                await asyncio.sleep(0.001)
                yield 1

        reader2 = ReadAhead(endless())
        await reader2.pending()
        reader2.close()
        await asyncio.sleep(0.01)
        return got, reader2._task.cancelled()

    got, cancelled = asyncio.run(main())
    assert got == [["a"], None] and cancelled
