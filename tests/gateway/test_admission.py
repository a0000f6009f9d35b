"""Gateway admission per worker and class (no grpc: the controller on its own event loop)."""

from __future__ import annotations

import asyncio

import pytest

from cotserve.common.errors import ResourceExhausted
from cotserve.common.sampling import SlaClass
from cotserve.gateway.admission import Admission, AdmissionConfig, QueueDeadlineExceeded, WorkerLoad

R, I, B = SlaClass.REALTIME, SlaClass.INTERACTIVE, SlaClass.BATCH
ROOMY = WorkerLoad(kv_blocks_free=90, kv_blocks_total=100, num_waiting_urgent=0)


def make(**kw) -> Admission:
    a = Admission(AdmissionConfig(**kw))
    a.on_stats(ROOMY)
    return a


def run(coro):
    return asyncio.run(coro)


def test_realtime_is_never_queued():
    async def main():
        a = make(interactive_initial_limit=2, batch_limit=0)
        for _ in range(2):
            await a.acquire(I, None)
        a.on_stats(WorkerLoad(0, 100, 50))  # no KV to spare, urgent work waiting
        waits = [await a.acquire(R, 0.01) for _ in range(50)]
        return waits, a.in_flight[R]

    waits, in_flight = run(main())
    assert waits == [0.0] * 50 and in_flight == 50


def test_interactive_waits_for_a_slot_in_order_and_release_grants_it():
    async def main():
        a = make(interactive_initial_limit=2)
        await a.acquire(I, None)
        await a.acquire(I, None)
        order = []

        async def waiter(n):
            await a.acquire(I, 5)
            order.append(n)

        tasks = [asyncio.create_task(waiter(n)) for n in range(3)]
        await asyncio.sleep(0.05)
        assert order == [] and len(a.queues[I]) == 3
        a.release(I)
        await asyncio.sleep(0.01)
        a.release(I)
        a.release(I)
        await asyncio.gather(*tasks)
        return order, a.in_flight[I]

    order, in_flight = run(main())
    assert order == [0, 1, 2] and in_flight == 2


def test_full_queue_is_resource_exhausted_with_retry_after():
    async def main():
        a = make(interactive_initial_limit=2, max_queue_interactive=1, max_queue_batch=1)
        await a.acquire(I, None)
        await a.acquire(I, None)
        t = asyncio.create_task(a.acquire(I, 5))
        await asyncio.sleep(0.01)
        with pytest.raises(ResourceExhausted) as err:
            await a.acquire(I, 5)
        t.cancel()
        return err.value

    err = run(main())
    assert "sla_class INTERACTIVE: the gateway queue for this worker is full (1 waiting)" in err.message
    assert int(err.trailers["retry-after-ms"]) >= 50


def test_deadline_in_the_queue_fails_without_taking_a_slot():
    async def main():
        a = make(interactive_initial_limit=2)
        await a.acquire(I, None)
        await a.acquire(I, None)
        with pytest.raises(QueueDeadlineExceeded, match="in the gateway's INTERACTIVE queue"):
            await a.acquire(I, 0.05)
        return a.in_flight[I], len(a.queues[I])

    assert run(main()) == (2, 0)


def test_cancelled_waiter_leaves_the_queue():
    async def main():
        a = make(interactive_initial_limit=1)
        await a.acquire(I, None)
        t = asyncio.create_task(a.acquire(I, None))
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        a.release(I)
        return a.in_flight[I], len(a.queues[I])

    assert run(main()) == (0, 0)


@pytest.mark.parametrize("load,queued_interactive,admitted", [
    (ROOMY, False, True),
    (WorkerLoad(kv_blocks_free=5, kv_blocks_total=100, num_waiting_urgent=0), False, False),  # < 10% spare
    (WorkerLoad(kv_blocks_free=90, kv_blocks_total=100, num_waiting_urgent=1), False, False),  # urgent waiting there
    (ROOMY, True, False),  # urgent waiting here
])
def test_batch_only_with_spare_kv_and_no_urgent_work_waiting(load, queued_interactive, admitted):
    a = make(interactive_initial_limit=1)
    a.on_stats(load)
    if queued_interactive:
        a.in_flight[I] = 1
        a.queues[I].push(object())  # a waiter placeholder
    assert a.can_start(B) is admitted


def test_held_batch_is_admitted_when_the_worker_frees_up():
    async def main():
        a = make()
        a.on_stats(WorkerLoad(1, 100, 3))
        t = asyncio.create_task(a.acquire(B, 5))
        await asyncio.sleep(0.02)
        assert not t.done()
        a.on_stats(ROOMY)
        return await t, a.in_flight[B]

    queued_ms, in_flight = run(main())
    assert queued_ms >= 15 and in_flight == 1


def test_batch_limit_caps_batch_in_flight():
    async def main():
        a = make(batch_limit=3)
        for _ in range(3):
            await a.acquire(B, None)
        with pytest.raises(QueueDeadlineExceeded):
            await a.acquire(B, 0.02)

    run(main())


def test_batch_restarts_slowly_after_interactive_queued():
    """Once an INTERACTIVE request had to queue, BATCH's ceiling is `batch_restart_limit`: the INTERACTIVE queue
    emptying lets 4 of 20 queued BATCH start, not all 20 (as before); the ceiling doubles at every poll without an
    INTERACTIVE request queueing (the first poll after one does not count), and never passes `batch_limit`."""
    async def main():
        a = make(interactive_initial_limit=1, batch_limit=16, batch_restart_limit=4)
        await a.acquire(I, None)
        second = asyncio.create_task(a.acquire(I, None))
        await asyncio.sleep(0.01)
        batch = [asyncio.create_task(a.acquire(B, None)) for _ in range(20)]
        await asyncio.sleep(0.01)
        started = [a.in_flight[B]]  # nothing while INTERACTIVE waits
        a.release(I)
        await second
        started.append(a.in_flight[B])
        for _ in range(4):
            a.on_stats(ROOMY)
            await asyncio.sleep(0)
            started.append(a.in_flight[B])
        for _ in range(16):
            a.release(B)
        await asyncio.sleep(0.01)
        started.append(a.in_flight[B])
        await asyncio.gather(*batch)
        return started

    assert run(main()) == [0, 4, 4, 8, 16, 16, 4]


def test_batch_ceiling_stays_full_without_interactive_queueing():
    async def main():
        a = make(batch_limit=50, batch_restart_limit=4)
        await a.acquire(I, None)  # INTERACTIVE in flight, never queued
        for _ in range(50):
            await a.acquire(B, 0.01)
        a.on_stats(ROOMY)
        return a.in_flight[B], a.limit[B]

    assert run(main()) == (50, 50)


@pytest.mark.parametrize("p95,start,expected", [(200.0, 8, 4), (50.0, 8, 16), (10.0, 8, 32), (1000.0, 8, 2), (100.0, 8, 8)])
def test_interactive_limit_follows_the_itl_target(p95, start, expected):
    a = make(interactive_initial_limit=start)
    for _ in range(40):
        a.observe_itl(I, p95)
    a.on_stats(ROOMY)
    assert a.limit[I] == expected


@pytest.mark.parametrize("seats,configured,expected", [(64, 0, 128), (4, 0, 8), (0, 0, 32), (64, 40, 40)])
def test_interactive_limit_climbs_to_twice_the_workers_seats_unless_configured(seats, configured, expected):
    """Far under its ITL target, INTERACTIVE may fill the worker's seats and a batch waiting there (a fixed 32 held a
    64-seat worker to half its seats); 32 while the worker's seats are unknown; `interactive_max_limit` when set."""
    a = make(interactive_initial_limit=8, interactive_max_limit=configured)
    for _ in range(3):  # x10 a poll
        for _ in range(40):
            a.observe_itl(I, 10.0)
        a.on_stats(WorkerLoad(90, 100, 0, seats))
    assert a.limit[I] == expected and a.interactive_ceiling() == expected


def test_too_few_samples_leave_the_limit_alone():
    a = make(interactive_initial_limit=8)
    for _ in range(5):
        a.observe_itl(I, 1000.0)
    a.on_stats(ROOMY)
    assert a.limit[I] == 8



def test_queued_ahead_counts_what_a_new_request_of_each_class_would_wait_behind():
    """INTERACTIVE waits behind its own queue only, BATCH behind INTERACTIVE's and its own, REALTIME behind nothing: the
    latency model's place in the gateway's line."""
    async def main():
        a = make(interactive_initial_limit=2, batch_limit=1)
        for cls in (I, I, B):
            await a.acquire(cls, None)
        waiting = [asyncio.create_task(a.acquire(cls, None)) for cls in (I, I, I, B, B)]
        await asyncio.sleep(0.01)
        ahead = {cls: a.queued_ahead(cls) for cls in (R, I, B)}
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return ahead, {cls: len(q) for cls, q in a.queues.items()}

    ahead, queues = run(main())
    assert ahead == {R: 0, I: 3, B: 5} and queues == {I: 0, B: 0}


def test_a_class_queue_is_served_fairly_among_tenants():
    """Tenant a queues five INTERACTIVE requests, then tenant b one: as slots free one at a time, b's is granted
    second, not sixth; a's go in their own order; a request of several samples costs its tenant as many turns."""
    async def main():
        a = make(interactive_initial_limit=1)
        await a.acquire(I, None, "a")  # the one slot
        order: list[str] = []

        async def wait(name: str, tenant: str, cost: int = 1) -> None:
            await a.acquire(I, None, tenant, cost)
            order.append(name)

        tasks = [asyncio.create_task(wait(f"a{i}", "a")) for i in range(5)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(wait("b0", "b", cost=3)))
        tasks.append(asyncio.create_task(wait("b1", "b")))
        await asyncio.sleep(0)
        for _ in range(7):
            a.release(I)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order

    assert run(main()) == ["a0", "b0", "a1", "a2", "a3", "b1", "a4"]
