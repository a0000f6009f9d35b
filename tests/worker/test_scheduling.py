"""Scheduling policies as strategies: chosen by name, and a new one changes the order without touching the scheduler.
No torch, no grpc."""

from __future__ import annotations

import pytest

from cotserve.worker.block_manager import BlockManager
from cotserve.worker.config import WorkerConfig
from cotserve.worker.scheduler import Scheduler
from cotserve.worker.scheduling import (
    POLICIES, Priority, PriorityYield, SchedulingPolicy, StepRules, TenantFair, make_policy,
)
from cotserve.worker.sequence import SamplingParams, Sequence, SlaClass
from tests.worker.test_scheduler import assert_no_leak, run_step


def test_policies_are_chosen_by_name_and_a_bad_name_lists_them():
    assert set(POLICIES) == {"fifo", "priority", "priority-yield", "tenant-fair"}
    assert type(make_policy("fifo")) is SchedulingPolicy and type(make_policy("priority")) is Priority
    p = make_policy("priority-yield", batch_min_share=0.25, max_batch_tokens_when_urgent=64)
    assert type(p) is PriorityYield and (p.batch_min_share, p.max_batch_tokens_when_urgent) == (0.25, 64)
    with pytest.raises(ValueError, match="scheduling: 'lifo', allowed: fifo, priority, priority-yield, tenant-fair"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="scheduling: 'lifo', allowed: fifo, priority, priority-yield, tenant-fair"):
        WorkerConfig(scheduling="lifo").validate()
    with pytest.raises(ValueError, match="batch_min_share: 1.5, allowed 0..1"):
        make_policy("priority", batch_min_share=1.5)


def test_the_default_scheduler_yields_batch_to_urgent_prompts_and_a_worker_shares_between_tenants():
    assert type(Scheduler(BlockManager(8, 4), 4, 64).policy) is PriorityYield
    assert WorkerConfig().scheduling == "tenant-fair" and issubclass(TenantFair, PriorityYield)


def test_fifo_keeps_no_share_for_batch_and_never_pauses_it():
    s = Scheduler(BlockManager(64, 4), 8, 64, make_policy("fifo"))
    s.add(Sequence("b", [1, 2, 3], SamplingParams(max_new_tokens=8), SlaClass.BATCH))
    s.pause_batch(5.0)
    assert s.policy.step_rules(s) == StepRules(batch_cap=64)


class _Lifo(SchedulingPolicy):
    """Newest first: a policy defined outside the scheduler, to show the seam."""

    name = "lifo"

    def key(self, seq):
        return (0, -seq.arrival_time, seq.seq_id)


def test_a_new_policy_changes_the_order_and_nothing_else():
    s = Scheduler(BlockManager(64, 4), 1, 64, _Lifo())
    old = Sequence("old", [1, 2, 3], SamplingParams(max_new_tokens=2), arrival_time=1.0)
    new = Sequence("new", [4, 5, 6], SamplingParams(max_new_tokens=2), arrival_time=2.0)
    s.add(old)
    s.add(new)
    batch = s.schedule()
    assert [i.seq.request_id for i in batch.items] == ["new"]  # one seat: the newest takes it
    run_step(s, batch)
    assert_no_leak(s)


def fair_run(policy: str, seats: int = 2) -> list[str]:
    """Tenant a queues six requests, then tenant b one, all INTERACTIVE, on a scheduler of `seats` seats: the order
    in which they start (each runs to its end before a seat frees)."""
    s = Scheduler(BlockManager(256, 4), seats, 256, make_policy(policy))
    clock = iter(range(1, 100))
    for i in range(6):
        s.add(Sequence(f"a{i}", [1, 2, 3, 4], SamplingParams(max_new_tokens=2), arrival_time=next(clock), tenant="a"))
    s.add(Sequence("b0", [1, 2, 3, 4], SamplingParams(max_new_tokens=2), arrival_time=next(clock), tenant="b"))
    started: list[str] = []
    while s.has_work():
        batch = s.schedule()
        started += [i.seq.request_id for i in batch.items if i.seq.request_id not in started]
        run_step(s, batch)
        for item in batch.items:
            if len(item.seq.output_ids) >= 2:
                s.finish(item.seq, item.seq.status.FINISHED_LENGTH)
    assert_no_leak(s)
    return started


def test_tenant_fair_lets_a_newcomer_start_ahead_of_another_tenants_backlog():
    assert fair_run("priority-yield") == ["a0", "a1", "a2", "a3", "a4", "a5", "b0"]  # arrival order
    assert fair_run("tenant-fair") == ["a0", "b0", "a1", "a2", "a3", "a4", "a5"]  # b's one request goes next


def test_tenant_fair_keeps_classes_first_and_a_preempted_sequence_its_tag():
    s = Scheduler(BlockManager(64, 4), 4, 64, make_policy("tenant-fair"))
    batch_a = Sequence("a", [1, 2], SamplingParams(max_new_tokens=2), SlaClass.BATCH, arrival_time=1.0, tenant="x")
    urgent = Sequence("u", [1, 2], SamplingParams(max_new_tokens=2), SlaClass.REALTIME, arrival_time=2.0, tenant="x")
    s.add(batch_a)
    s.add(urgent)
    assert s.key(urgent) < s.key(batch_a)  # REALTIME first whatever the tags
    tag = batch_a.fair_tag
    while batch_a not in s.running:
        run_step(s, s.schedule())
    s._preempt(batch_a)
    assert batch_a.fair_tag == tag and batch_a in s.waiting


def seats_run(policy: str) -> tuple[list[str], list[str], int]:
    """Tenant a's four long INTERACTIVE requests hold all four seats; then tenant b sends three. Which requests run
    in the step after b's arrive, which wait, and how many preemptions it took."""
    s = Scheduler(BlockManager(256, 4), 4, 256, make_policy(policy))
    for i in range(4):
        s.add(Sequence(f"a{i}", [1, 2, 3, 4], SamplingParams(max_new_tokens=50), arrival_time=float(i), tenant="a"))
    run_step(s, s.schedule())
    assert sorted(q.request_id for q in s.running) == ["a0", "a1", "a2", "a3"]
    for i in range(3):
        s.add(Sequence(f"b{i}", [5, 6, 7, 8], SamplingParams(max_new_tokens=2), arrival_time=10.0 + i, tenant="b"))
    batch = s.schedule()
    run_step(s, batch)
    assert_no_leak(s)
    return (sorted(i.seq.request_id for i in batch.items), sorted(q.request_id for q in s.waiting),
            s.num_preemptions_total)


def test_tenant_fair_gives_a_newcomer_its_share_of_the_seats_at_once():
    """Under `tenant-fair`, a tenant holding every seat gives back the ones over its fair share (seats over the
    tenants with work: 2 of 4 here) the step another tenant's requests arrive, its newest first; the newcomer gets its
    share and no more (its third request waits). Under `priority-yield`, the newcomer waits for a seat to free."""
    ran, waiting, preempted = seats_run("priority-yield")
    assert ran == ["a0", "a1", "a2", "a3"] and waiting == ["b0", "b1", "b2"] and preempted == 0
    ran, waiting, preempted = seats_run("tenant-fair")
    assert ran == ["a0", "a1", "b0", "b1"] and waiting == ["a2", "a3", "b2"] and preempted == 2
