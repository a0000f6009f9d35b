"""SLA-class rules of the scheduler (issue: SLA classes end to end). No torch, no grpc."""

from __future__ import annotations

import itertools

import pytest

from cotserve.worker.block_manager import BlockManager
from cotserve.worker.scheduler import Scheduler
from cotserve.worker.scheduling import make_policy
from cotserve.worker.sequence import SamplingParams, Sequence, SequenceStatus, SlaClass
from tests.worker.test_scheduler import assert_no_leak, run_step

R, I, B = SlaClass.REALTIME, SlaClass.INTERACTIVE, SlaClass.BATCH
_clock = itertools.count(1)


def seq(cls: SlaClass, prompt_len: int = 4, max_new_tokens: int = 16, name: str = "") -> Sequence:
    """A sequence that arrives now (strictly after every earlier one)."""
    s = Sequence(name or f"{cls.name}-{prompt_len}", list(range(1, prompt_len + 1)),
                 SamplingParams(max_new_tokens=max_new_tokens), cls)
    s.arrival_time = float(next(_clock))
    return s


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, share=0.1, yields=True) -> Scheduler:
    policy = make_policy("priority-yield" if yields else "priority", batch_min_share=share)
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, policy)


def test_orders_by_class_then_arrival():
    s = make(budget=4, yields=False)  # BATCH keeps ceil(10% of 4) = 1 token per step; urgent work gets 3
    b, i1, i2, r = seq(B), seq(I), seq(I), seq(R)
    for q in (b, i1, i2, r):
        s.add(q)
    first_seen = []
    batch = s.schedule()
    assert [(x.seq, x.num_tokens) for x in batch.items] == [(r, 3), (b, 1)]
    for _ in range(6):
        first_seen += [x.seq for x in batch.items if x.seq not in first_seen]
        run_step(s, batch)
        batch = s.schedule()
    assert first_seen == [r, b, i1, i2]


def test_realtime_takes_a_batch_seat_and_joins_the_very_next_step():
    s = make(max_num_seqs=2)
    b1, b2 = seq(B), seq(B)
    s.add(b1)
    s.add(b2)
    run_step(s, s.schedule())
    r = seq(R)
    s.add(r)
    batch = s.schedule()
    assert r in [i.seq for i in batch.items] and r.status == SequenceStatus.RUNNING
    assert batch.preempted == [b2]  # the newest BATCH gives up its seat
    assert len(s.running) == 2
    assert_no_leak(s)


def test_interactive_does_not_take_the_seat_of_interactive():
    s = make(max_num_seqs=1)
    old = seq(I)
    s.add(old)
    run_step(s, s.schedule())
    s.add(seq(I))
    batch = s.schedule()
    assert [i.seq for i in batch.items] == [old] and batch.preempted == []


def test_kv_shortage_preempts_batch_first_then_interactive_never_realtime():
    # 6 blocks of 4 tokens. Arrival order: BATCH (oldest), INTERACTIVE, REALTIME: each holds 2 blocks.
    s = make(num_blocks=6, block_size=4)
    b, i, r = seq(B, 7), seq(I, 7), seq(R, 7)
    for q in (b, i, r):
        s.add(q)
    run_step(s, s.schedule())  # each: 7 tokens computed, 8 tokens long, 2 blocks; pool full
    run_step(s, s.schedule())  # each reaches 9 tokens on the next step: needs a 3rd block
    batch = s.schedule()
    assert batch.preempted[0] is b  # the oldest, but least urgent, goes first
    assert r in [x.seq for x in batch.items]
    assert_no_leak(s)
    # Drain the realtime sequence's needs further: interactive is the next victim, realtime never.
    while i.status == SequenceStatus.RUNNING:
        run_step(s, batch)
        batch = s.schedule()
    assert r.status == SequenceStatus.RUNNING and i.status == SequenceStatus.PREEMPTED
    assert all(p.sla_class != R for p in batch.preempted)


def test_an_interactive_needing_blocks_preempts_itself_rather_than_realtime():
    s = make(num_blocks=4, block_size=4)
    r, i = seq(R, 7, max_new_tokens=4), seq(I, 8, max_new_tokens=4)
    s.add(r)
    s.add(i)
    batch = s.schedule()  # r: 2 blocks (7 tokens), i: 2 blocks (8 tokens, full)
    run_step(s, batch)
    batch = s.schedule()  # i needs a 3rd block; the only other sequence is REALTIME
    assert batch.preempted == [i]
    assert [x.seq for x in batch.items] == [r]


def test_preempted_sequence_is_readmitted_before_newer_work_of_its_class():
    s = make(num_blocks=4, block_size=4, max_num_seqs=4)
    old, r = seq(I, 8, max_new_tokens=4, name="old"), seq(R, 4, max_new_tokens=2)
    s.add(old)
    run_step(s, s.schedule())  # old: 8 prompt tokens computed + 1 sampled, 2 blocks (full)
    s.add(r)
    newer = seq(I, 4, max_new_tokens=2, name="newer")
    s.add(newer)
    big = seq(R, 5, max_new_tokens=2)
    s.add(big)
    batch = s.schedule()  # realtime work needs 3 blocks; 2 free: old is preempted
    assert old in batch.preempted
    for q in (r, big):
        s.finish(q, SequenceStatus.FINISHED_STOPPED)
    batch = s.schedule()
    admitted = [x.seq for x in batch.items]
    assert admitted.index(old) < admitted.index(newer) if newer in admitted else admitted[0] is old
    assert_no_leak(s)


@pytest.mark.parametrize("yields", [False, True])
def test_batch_keeps_its_minimum_share_of_the_token_budget(yields):
    """Its share of every step, or (yielding to urgent prompts) of every other step; a step it sits out gives the
    whole budget to the urgent prompts."""
    s = make(num_blocks=256, block_size=16, budget=100, share=0.1, yields=yields)
    for _ in range(5):
        s.add(seq(I, 200, max_new_tokens=4))  # interactive prompts that alone would fill every step
    b = seq(B, 50, max_new_tokens=4)
    s.add(b)
    batch_tokens, totals = [], []
    for _ in range(4):
        batch = s.schedule()
        totals.append(batch.num_tokens)
        batch_tokens.append(sum(x.num_tokens for x in batch.items if x.seq is b))
        run_step(s, batch)
    assert totals == [100] * 4
    assert batch_tokens == ([0, 10, 0, 10] if yields else [10, 10, 10, 10])
    assert s.num_batch_yields_total == (2 if yields else 0)


def test_without_batch_work_interactive_uses_the_whole_budget():
    s = make(num_blocks=256, block_size=16, budget=100, share=0.1)
    s.add(seq(I, 300))
    assert s.schedule().num_tokens == 100


def test_failed_admission_preempts_nobody():
    s = make(num_blocks=3, block_size=4, max_num_seqs=4)
    r = seq(R, 6, max_new_tokens=2)
    s.add(r)
    run_step(s, s.schedule())  # r holds 2 blocks; 1 free
    huge = seq(I, 11, max_new_tokens=1)  # needs 3 blocks: cannot fit while r runs (r is more urgent)
    s.add(huge)
    batch = s.schedule()
    assert batch.preempted == [] and huge.status == SequenceStatus.WAITING


def test_fifo_mode_ignores_classes():
    s = Scheduler(BlockManager(64, 4), 2, 64, make_policy("fifo"))
    b1, b2 = seq(B), seq(B)
    s.add(b1)
    s.add(b2)
    run_step(s, s.schedule())
    r = seq(R)
    s.add(r)
    batch = s.schedule()
    assert r not in [i.seq for i in batch.items] and batch.preempted == []  # no seat taken from BATCH


def test_disabled_admission_forwards_everything():
    from cotserve.gateway.admission import Admission, AdmissionConfig, WorkerLoad

    a = Admission(AdmissionConfig(enabled=False, batch_limit=0))
    a.on_stats(WorkerLoad(0, 100, 10))
    assert a.can_start(B) and a.can_start(I)


def test_batch_prefill_is_capped_while_urgent_work_is_present():
    s = Scheduler(BlockManager(256, 16), 8, 1000, make_policy("priority-yield", 0.1, max_batch_tokens_when_urgent=300))
    big = [seq(B, 400, max_new_tokens=4) for _ in range(2)]
    for q in big:
        s.add(q)
    first = s.schedule()
    assert first.num_tokens == 800  # alone, BATCH may use the whole budget
    run_step(s, first)
    more = [seq(B, 400, max_new_tokens=4) for _ in range(2)]
    for q in more:
        s.add(q)
    urgent = seq(I, 8, max_new_tokens=4)
    s.add(urgent)
    def tokens_by_class(batch):
        return {c: sum(x.num_tokens for x in batch.items if x.seq.sla_class == c) for c in (I, B)}

    batch = s.schedule()
    assert tokens_by_class(batch) == {I: 8, B: 0}  # the urgent prompt's step: BATCH sits it out
    run_step(s, batch)
    assert tokens_by_class(s.schedule()) == {I: 1, B: 300}  # 2 decodes + 298 prefill tokens, not 800


def test_a_step_with_an_urgent_prompt_runs_no_batch_and_batch_never_sits_out_twice_in_a_row():
    s = make(num_blocks=256, block_size=4, max_num_seqs=16, budget=64)
    flood = [seq(B, 4, max_new_tokens=50) for _ in range(6)]
    for q in flood:
        s.add(q)
    run_step(s, s.schedule())
    run_step(s, s.schedule())  # BATCH decoding, nothing urgent
    arrivals = []
    classes_per_step = []
    for step in range(6):  # an urgent arrival every step
        arrivals.append(seq(R if step % 2 else I, 5, max_new_tokens=8))
        s.add(arrivals[-1])
        batch = s.schedule()
        classes_per_step.append({x.seq.sla_class for x in batch.items})
        prompts = [x.seq for x in batch.items if x.num_tokens > 1]
        run_step(s, batch)
        if B not in classes_per_step[-1]:
            assert prompts == [arrivals[-1]]  # BATCH sat out for this step's urgent prompt, and only then
    # steps alternate: an urgent prompt alone, then urgent prompt + urgent decodes + every BATCH decode
    assert [B in c for c in classes_per_step] == [False, True, False, True, False, True]
    assert s.num_batch_yields_total == 3
    # with only urgent decodes left, BATCH runs every step
    batch = s.schedule()
    assert {x.seq for x in batch.items if x.seq.sla_class == B} == set(flood)
    assert_no_leak(s)


def test_fifo_and_the_switch_off_never_make_batch_yield():
    for s in (Scheduler(BlockManager(64, 4), 8, 64, make_policy("fifo")), make(yields=False)):
        b = seq(B, 4)
        s.add(b)
        run_step(s, s.schedule())
        s.add(seq(I, 5))
        assert b in [x.seq for x in s.schedule().items]
        assert s.num_batch_yields_total == 0


def test_batch_waiting_past_a_blocked_admission_still_sits_out_a_step_of_urgent_prompt():
    """One seat, an INTERACTIVE sequence in it still computing its prompt (8 tokens a step), a second INTERACTIVE
    waiting for the seat (tried with the budget left: no seat, admission blocked) and a BATCH waiting behind it: the
    step computes the urgent prompt only and counts as BATCH sitting out, as when the walk reached the BATCH sequence
    itself (the walk now stops at the blocked admission)."""
    s = make(max_num_seqs=1, budget=8)
    i1, i2, b = seq(I, prompt_len=12), seq(I), seq(B)
    s.add(i1)
    run_step(s, s.schedule())  # i1 takes the seat: 8 of its 12 prompt tokens
    s.add(i2)
    s.add(b)
    batch = s.schedule()
    assert [(x.seq, x.num_tokens) for x in batch.items] == [(i1, 4)]
    assert s.batch_yielded and s.num_batch_yields_total == 1
    assert list(s.waiting) == [i2, b]


def _brute_force(s: Scheduler) -> tuple:
    """What the scheduler's running counts of its waiting queue stand for, recomputed from the queue itself."""
    w = list(s.waiting)
    running_ids = {q.request_id for q in s.running}
    return (w == sorted(w, key=s.key), [sum(q.sla_class == c for q in w) for c in SlaClass],
            sum(q.sla_class != B and q.num_computed_tokens < len(q) - 1 for q in w),
            {r: sum(q.request_id == r for q in w) for r in {q.request_id for q in w}},
            len({q.request_id for q in w} - running_ids))


def test_the_waiting_queue_stays_in_order_and_its_counts_stay_true_through_admission_preemption_and_aborts():
    """The queue is kept sorted and counted as it changes (no step sorts or scans it): after every step of a random
    mix of arrivals of every class, short and long prompts, preemptions (a small pool), finishes and aborts, it is
    in priority order and every count equals the one recomputed from it."""
    import random

    rng = random.Random(11)
    s = make(num_blocks=24, block_size=4, max_num_seqs=6, budget=16)
    live: list[Sequence] = []
    preempted = longest = 0
    for step in range(400):
        for _ in range(rng.choice((0, 0, 1, 2))):
            q = seq(rng.choice((R, I, B, B)), prompt_len=rng.choice((1, 3, 9, 17)), max_new_tokens=rng.randint(1, 12),
                    name=f"req-{rng.randint(0, 30)}")  # names repeat: several sequences of one request id
            s.add(q)
            live.append(q)
        batch = s.schedule()
        preempted += len(batch.preempted)
        run_step(s, batch)
        for q in [x.seq for x in batch.items]:
            if q.status == SequenceStatus.RUNNING and len(q.output_ids) >= q.params.max_new_tokens:
                s.finish(q, SequenceStatus.FINISHED_LENGTH)
        if live and rng.random() < 0.1:
            s.abort(rng.choice(live))  # waiting, running or finished already
        live = [q for q in live if not q.is_finished]
        in_order, by_class, urgent_prompts, requests, waiting_requests = _brute_force(s)
        assert in_order, step
        assert s.waiting.by_class == by_class and s.waiting.urgent_prompts == urgent_prompts, step
        assert s.waiting.requests == requests and s.waiting.num_urgent == by_class[R] + by_class[I], step
        assert len(s.waiting.requests) - sum(r in s.waiting.requests for r in {q.request_id for q in s.running}) \
            == waiting_requests
        assert_no_leak(s)
        longest = max(longest, len(s.waiting))
    assert preempted > 10 and longest >= 10  # the mix did preempt, and queued


def test_paused_batch_sits_out_every_step_with_urgent_work_keeps_its_pages_and_runs_capped_without_it():
    s = make(num_blocks=256, block_size=4, max_num_seqs=16, budget=64)
    s.policy.max_batch_tokens_when_urgent = 16
    flood = [seq(B, 4, max_new_tokens=50) for _ in range(4)]
    for q in flood:
        s.add(q)
    run_step(s, s.schedule())
    urgent = seq(I, 5, max_new_tokens=20)
    s.add(urgent)
    s.pause_batch(30.0)
    pages = {q.seq_id: list(q.block_table) for q in flood}
    for _ in range(5):  # the prompt, then decodes: not one step with BATCH in it (yielding would let every other in)
        batch = s.schedule()
        assert [x.seq for x in batch.items] == [urgent]
        run_step(s, batch)
    assert all(q.status == SequenceStatus.RUNNING and q in s.running for q in flood)
    assert {q.seq_id: list(q.block_table) for q in flood} == pages  # seats and pages kept
    assert s.num_batch_paused_steps_total == 5 and s.num_batch_yields_total == 0
    s.abort(urgent)
    piled = [seq(B, 40) for _ in range(4)]  # BATCH arrivals during the pause: 160 prompt tokens
    for q in piled:
        s.add(q)
    batch = s.schedule()  # no urgent work: BATCH goes on though the pause lasts, within the urgent-time cap
    assert set(flood) <= {x.seq for x in batch.items}
    assert sum(x.num_tokens for x in batch.items) == 16  # 4 decodes + 12 prompt tokens: not the budget's 64
    run_step(s, batch)
    urgent2 = seq(I, 5, max_new_tokens=20)
    s.add(urgent2)
    batch = s.schedule()
    assert [x.seq for x in batch.items] == [urgent2]  # its prompt, BATCH paused
    run_step(s, batch)
    s.pause_batch(0)  # ended: urgent2 decodes and, no urgent prompt to yield to, every BATCH decodes beside it
    batch = s.schedule()
    assert set(flood) | {urgent2} <= {x.seq for x in batch.items}
    run_step(s, batch)
    assert_no_leak(s)


@pytest.mark.parametrize("seconds", [-1.0, 61.0, float("nan")])
def test_a_pause_out_of_range_is_refused_naming_the_range(seconds):
    s = make()
    with pytest.raises(ValueError, match=r"pause_batch: .* allowed 0\.\.60"):
        s.pause_batch(seconds)
    assert s.batch_paused_until == 0.0


def test_a_pause_ends_by_itself(monkeypatch):
    import cotserve.worker.scheduler as sched
    now = [1000.0]
    monkeypatch.setattr(sched.time, "monotonic", lambda: now[0])
    s = make(num_blocks=256, max_num_seqs=16, budget=64, yields=False)
    b = seq(B, 4)
    s.add(b)
    run_step(s, s.schedule())
    i = seq(I, 5, max_new_tokens=20)
    s.add(i)
    s.pause_batch(2.0)
    run_step(s, s.schedule())
    assert b not in [x.seq for x in s.schedule().items]
    now[0] += 2.01  # the lease ran out and nobody renewed it
    assert b in [x.seq for x in s.schedule().items]
