"""Scheduler and BlockManager: built with small factories, no torch, no grpc."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cotserve.worker.block_manager import BlockManager
from cotserve.worker.scheduler import ScheduledBatch, Scheduler
from cotserve.worker.sequence import SamplingParams, Sequence, SequenceStatus


def make_scheduler(num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget)


def make_sequences(*prompt_lens: int, max_new_tokens: int = 8) -> list[Sequence]:
    return [Sequence(f"r{i}", list(range(1, n + 1)), SamplingParams(max_new_tokens=max_new_tokens))
            for i, n in enumerate(prompt_lens)]


def run_step(s: Scheduler, batch: ScheduledBatch, token: int = 7) -> None:
    """What the engine does after a forward pass: advance, and append a token where sampled."""
    for item in batch.items:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_tokens
        if samples:
            item.seq.output_ids.append(token)


def held_blocks(s: Scheduler) -> int:
    return sum(len(q.block_table) for q in [*s.running, *s.waiting])


def assert_no_leak(s: Scheduler) -> None:
    assert s.block_manager.num_free_blocks + held_blocks(s) == s.block_manager.num_blocks


def test_scheduler_and_block_manager_do_not_import_torch_or_grpc():
    code = ("import sys, cotserve.worker.scheduler, cotserve.worker.block_manager; "
            "bad = {'torch', 'grpc'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prefill_then_decode_one_token_per_step():
    s = make_scheduler()
    (seq,) = make_sequences(6)
    s.add(seq)
    batch = s.schedule()
    assert [(i.seq, i.num_tokens, i.samples) for i in batch.items] == [(seq, 6, True)]
    assert len(seq.block_table) == 2  # 6 tokens in blocks of 4
    run_step(s, batch)
    batch = s.schedule()
    assert [(i.num_tokens, i.samples) for i in batch.items] == [(1, True)]
    assert seq.status == SequenceStatus.RUNNING


def test_long_prompt_is_chunked_and_running_decodes_go_first():
    s = make_scheduler(num_blocks=64, budget=8)
    short, long_ = make_sequences(3, 20)
    s.add(short)
    run_step(s, s.schedule())  # short prefilled, now decoding
    s.add(long_)
    chunks = []
    for _ in range(4):
        batch = s.schedule()
        assert batch.items[0].seq is short and batch.items[0].num_tokens == 1  # decode never starved
        assert batch.num_tokens <= 8
        chunks.append([(i.num_tokens, i.samples) for i in batch.items if i.seq is long_][0])
        run_step(s, batch)
    assert chunks == [(7, False), (7, False), (6, True), (1, True)]
    assert long_.num_computed_tokens == 21


def test_newest_running_sequence_is_preempted_when_blocks_run_out():
    s = make_scheduler(num_blocks=4, block_size=4, budget=64)
    old, new = make_sequences(4, 4, max_new_tokens=8)
    s.add(old)
    s.add(new)
    run_step(s, s.schedule())  # both prefilled: 1 block each, then each decodes into a 2nd block
    run_step(s, s.schedule())  # 2 blocks each: pool full (4 blocks)
    assert s.block_manager.num_free_blocks == 0
    for _ in range(3):
        run_step(s, s.schedule())
    # old needs a third block at length 9: the newest (new) is preempted, its blocks freed
    batch = s.schedule()
    assert batch.preempted == [new]
    assert new.status == SequenceStatus.PREEMPTED and new.block_table == [] and new.num_computed_tokens == 0
    assert s.waiting[0] is new and s.num_preemptions_total == 1
    assert [i.seq for i in batch.items] == [old]
    assert_no_leak(s)
    # once old finishes, new is readmitted and recomputes prompt + its earlier output
    run_step(s, batch)
    s.finish(old, SequenceStatus.FINISHED_LENGTH)
    batch = s.schedule()
    assert [(i.seq, i.num_tokens) for i in batch.items] == [(new, len(new))]
    assert_no_leak(s)


def test_a_sequence_that_is_itself_the_newest_preempts_itself():
    s = make_scheduler(num_blocks=3, block_size=4, budget=64)
    a, b = make_sequences(6, 4, max_new_tokens=4)
    s.add(a)
    s.add(b)
    run_step(s, s.schedule())  # a: 2 blocks (room for 2 more tokens), b: 1 full block; pool full
    batch = s.schedule()  # a fits; b (the newest) needs a new block and preempts itself
    assert batch.preempted == [b] and [i.seq for i in batch.items] == [a]
    assert b.status == SequenceStatus.PREEMPTED and s.waiting[0] is b
    assert_no_leak(s)


def test_admission_stops_at_max_num_seqs_and_token_budget():
    s = make_scheduler(num_blocks=64, max_num_seqs=2, budget=10)
    seqs = make_sequences(4, 4, 4)
    for q in seqs:
        s.add(q)
    batch = s.schedule()
    assert [i.seq for i in batch.items] == seqs[:2]
    assert len(s.waiting) == 1


def test_prompt_that_can_never_fit_is_rejected():
    s = make_scheduler(num_blocks=2, block_size=4)
    (seq,) = make_sequences(6, max_new_tokens=3)  # 9 tokens > 8 slots
    with pytest.raises(ValueError, match="exceeds the KV pool"):
        s.add(seq)


@pytest.mark.parametrize("end", ["finish_running", "abort_running", "abort_waiting", "abort_preempted", "abort_midprefill"])
def test_no_block_leaked_on_any_path(end):
    s = make_scheduler(num_blocks=6, block_size=4, budget=6)
    a, b, c = make_sequences(5, 9, 4, max_new_tokens=6)
    for q in (a, b, c):
        s.add(q)
    batch = s.schedule()
    run_step(s, batch)
    target = {"finish_running": a, "abort_running": a, "abort_waiting": c, "abort_preempted": b, "abort_midprefill": b}[end]
    if end == "abort_preempted":
        while b.status != SequenceStatus.PREEMPTED:
            batch = s.schedule()
            run_step(s, batch)
    if end == "abort_midprefill":
        assert 0 < b.num_computed_tokens < len(b)
    if end == "finish_running":
        s.finish(target, SequenceStatus.FINISHED_STOPPED)
    else:
        assert s.abort(target)
        assert target.status == SequenceStatus.FINISHED_ABORTED
    assert target.block_table == [] and target not in s.running and target not in s.waiting
    assert_no_leak(s)
    assert not s.abort(target)  # aborting a finished sequence is a no-op
    for q in (a, b, c):
        if not q.is_finished:
            s.abort(q)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_status_order_says_finished_in_one_comparison():
    assert all(st.is_finished == (st > SequenceStatus.PREEMPTED) for st in SequenceStatus)
    assert not SequenceStatus.PREEMPTED.is_finished and SequenceStatus.FINISHED_ABORTED.is_finished


def test_block_manager_refuses_double_free_and_over_allocation():
    bm = BlockManager(2, 4)
    (seq,) = make_sequences(3)
    bm.allocate(seq, 8)
    assert bm.num_free_blocks == 0
    (other,) = make_sequences(1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(other, 1)
    bm.free(seq)
    assert bm.num_free_blocks == 2
    bm.free(seq)  # empty table: nothing to free
    assert bm.num_free_blocks == 2


def test_append_token_finishes_a_sequence_on_its_stop_tokens_and_at_its_length_and_frees_its_blocks():
    s = Scheduler(BlockManager(16, 4), 8, 64, max_model_len=12, eos_token_ids=frozenset({1}))
    stops = Sequence("stops", [5, 6, 7], SamplingParams(max_new_tokens=8, stop_token_ids=[9]))
    eos = Sequence("eos", [5, 6, 7], SamplingParams(max_new_tokens=8))
    ignores = Sequence("ignores", [5, 6, 7], SamplingParams(max_new_tokens=2, ignore_eos=True))
    long = Sequence("long", list(range(2, 12)), SamplingParams(max_new_tokens=8))  # 10 prompt tokens, model length 12
    for seq in (stops, eos, ignores, long):
        s.add(seq)
    batch = s.schedule()
    s.advance(batch)
    assert s.append_token(stops, 4, -0.5) is None and stops.output_ids == [4] and stops.output_logprobs == [-0.5]
    assert s.append_token(stops, 9) == "stop" and stops.status == SequenceStatus.FINISHED_STOPPED
    assert s.append_token(eos, 1) == "stop" and eos.status == SequenceStatus.FINISHED_STOPPED
    assert s.append_token(ignores, 1) is None  # end of sequence, ignored ...
    assert s.append_token(ignores, 1) == "length" and ignores.status == SequenceStatus.FINISHED_LENGTH  # ... up to max_new
    assert s.append_token(long, 3) is None and s.append_token(long, 3) == "length"  # the model's length
    assert s.running == [] and s.block_manager.num_free_blocks == 16  # every finished sequence's blocks are back


def test_a_step_walks_the_waiting_queue_only_up_to_the_first_sequence_it_cannot_admit():
    """Two seats, two running, 300 waiting: the step schedules the two running decodes, tries the oldest waiting
    sequence once (no seat: admission blocked, strict priority) and visits none of the other 299; the order of the
    walk is the priority order of running and waiting together."""
    s = make_scheduler(num_blocks=2000, max_num_seqs=2, budget=4096)
    seqs = make_sequences(*[4] * 302)
    for seq in seqs:
        s.add(seq)
    run_step(s, s.schedule())  # the first two admitted and prefilled
    assert [q.request_id for q in s.running] == ["r0", "r1"] and len(s.waiting) == 300
    walked = []
    real = s._by_priority

    def counting(admitting):
        for seq in real(admitting):
            walked.append(seq.request_id)
            yield seq

    s._by_priority = counting
    batch = s.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in batch.items] == [("r0", 1), ("r1", 1)]
    assert walked == ["r0", "r1", "r2"] and len(s.waiting) == 300
    ordered = list(real(lambda: True))  # with admission open: everything, in priority order
    assert [q.request_id for q in ordered] == [f"r{i}" for i in range(302)]


def test_groups_arriving_together_never_take_more_seats_than_there_are():
    """Eight requests of 16 samples on 64 seats: a group's parent holds its samples' seats until they fork, so at
    most four groups run at once and never more than 64 sequences, before or after the forks."""
    s = Scheduler(BlockManager(1024, 4), 64, 4096)
    parents = []
    for i in range(8):
        seq = Sequence(f"g{i}", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=4))
        seq.group_size = 16
        parents.append(seq)
        s.add(seq)
    batch = s.schedule()
    admitted = [item.seq for item in batch.items]
    assert len(admitted) == 4 and s.seats_taken == 64
    run_step(s, batch)
    for parent in admitted:  # the engine forks the samples once the prompt is computed, each drawing its token
        children = [Sequence(parent.request_id, parent.prompt_ids, parent.params, index=k) for k in range(1, 16)]
        s.fork(parent, children)
        for child in children:
            child.output_ids.append(7)
    assert len(s.running) == 64 == s.seats_taken
    batch = s.schedule()
    assert len(batch.items) == 64 and all(p.status == SequenceStatus.WAITING for p in parents[4:])  # they wait
    for seq in list(s.running):
        s.finish(seq, SequenceStatus.FINISHED_STOPPED)
    assert s.block_manager.num_free_blocks == 1024  # shared pages freed once their last holder is done
