"""Continuous-batching scheduler. No torch, no grpc.

Schedule by tokens, not phases: each step hands every scheduled sequence a number of tokens to
compute (its whole remaining prompt, a chunk of it, or the one token of a decode) within a
per-step token budget. Running sequences go first, oldest first, so decodes are never starved
by a long prompt; waiting sequences fill what budget is left. When KV blocks run out, the newest
running sequence is preempted (blocks freed, recomputed later, placed at the head of the queue).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cotserve.worker.block_manager import BlockManager
from cotserve.worker.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    """`num_tokens` tokens of `seq`, from `seq.num_computed_tokens` on, are computed this step."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


@dataclass(slots=True)
class ScheduledBatch:
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    """Waiting and running queues over one `BlockManager`.

    Only the engine thread calls it. Every path that ends a sequence (`finish`, `abort`)
    frees its blocks, so no block outlives its sequence.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0

    @property
    def capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def can_ever_fit(self, seq: Sequence) -> bool:
        """False when the sequence at its longest needs more KV than the whole pool."""
        return seq.max_len <= self.capacity_tokens

    def add(self, seq: Sequence) -> None:
        if not self.can_ever_fit(seq):
            raise ValueError(f"sequence of up to {seq.max_len} tokens exceeds the KV pool ({self.capacity_tokens} tokens)")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + n, batch):
                break  # `seq` itself was the newest and got preempted
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            batch.items.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        if batch.preempted:
            return batch  # memory is short: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            seq.record("scheduled")
            self.running.append(seq)
            batch.items.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def _make_room(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Preempt the newest running sequences until `seq` can hold `num_tokens`; False if `seq` went."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        seq.record("preempted")
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence with a finished `status` and free its blocks."""
        assert status.is_finished, status
        self._remove(seq)
        seq.status = status

    def abort(self, seq: Sequence) -> bool:
        """Cancel a sequence wherever it is; False when it had already finished."""
        if seq.is_finished:
            return False
        self._remove(seq)
        seq.status = SequenceStatus.FINISHED_ABORTED
        return True

    def _remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
