"""The worker front's per-request inbox: a held stream's coroutine is woken only when it has something to write."""

from __future__ import annotations

import asyncio

from cotserve.worker.outputs import NO_TOKEN, RequestOutput
from cotserve.worker.server import StreamInbox, _Held


def out(token: int, **kw) -> RequestOutput:
    return RequestOutput("r", token, f"<{token}>", None, **kw)


def test_take_waits_for_the_tokens_due_and_no_longer_for_the_last_output_or_an_error():
    async def main():
        inbox = StreamInbox()
        woken: list[list[int]] = []

        async def reader(dues):
            for due in dues:
                woken.append([o.token_id for o in await inbox.take(due)])

        task = asyncio.create_task(reader([1, 8, 8, 8]))
        await asyncio.sleep(0)
        inbox.put(out(10))  # the first token: due 1
        await asyncio.sleep(0)
        assert woken == [[10]]
        for t in range(11, 18):  # seven tokens: the interval (8) holds them, the reader sleeps on
            inbox.put(out(t))
            await asyncio.sleep(0)
        assert woken == [[10]]
        inbox.put(out(18))
        await asyncio.sleep(0)
        assert woken == [[10], list(range(11, 19))]
        inbox.put(out(NO_TOKEN, finish_reason="stop"))  # a tokenless output counts no token
        inbox.put(out(19))
        await asyncio.sleep(0)
        assert len(woken) == 2
        inbox.put(out(20, is_last=True))  # the request's end: at once, whatever is due
        await asyncio.sleep(0)
        assert woken[2] == [NO_TOKEN, 19, 20]
        inbox.put(out(NO_TOKEN, error="engine died"))
        await asyncio.wait_for(task, 1)
        assert woken[3] == [NO_TOKEN]

    asyncio.run(main())


def test_outputs_already_pending_are_taken_without_waiting_and_a_cancelled_take_leaves_them():
    async def main():
        inbox = StreamInbox()
        for t in range(5):
            inbox.put(out(t))
        assert [o.token_id for o in await inbox.take(3)] == [0, 1, 2, 3, 4]
        inbox.put(out(5))
        waiting = asyncio.create_task(inbox.take(4))
        await asyncio.sleep(0)
        waiting.cancel()  # the client went away
        await asyncio.gather(waiting, return_exceptions=True)
        inbox.put(out(6))  # no waiter to wake: kept
        assert [o.token_id for o in await inbox.take(2)] == [5, 6]

    asyncio.run(main())


def test_held_says_how_many_tokens_are_still_due():
    from cotserve.worker.v1 import worker_pb2

    def msg(*ids: int) -> worker_pb2.GenerateResponse:
        return worker_pb2.GenerateResponse(token_ids=list(ids), text="".join(f"<{i}>" for i in ids))

    held = _Held(8, phase=3)  # the first held message waits 3 tokens, every later one 8
    assert held.tokens_due() == 1  # nothing written yet: the first token goes at once
    held.add(msg(1))
    assert [list(m.token_ids) for m in held.take(False)] == [[1]] and held.tokens_due() == 3
    held.add(msg(2))
    held.add(msg(3))
    assert held.take(False) == [] and held.tokens_due() == 1
    held.add(msg(4))
    assert [list(m.token_ids) for m in held.take(False)] == [[2, 3, 4]] and held.tokens_due() == 8
