"""Continuous-batching scheduler with SLA-class priority. No torch, no grpc.

Schedule by tokens, not phases: each step hands every scheduled sequence a number of tokens to
compute (its whole remaining prompt, a chunk of it, or the one token of a decode) within a
per-step token budget. Sequences are taken in priority order (SLA class, then arrival), so within
a class running decodes go before a newer long prompt and are never starved by it. When KV
blocks run out, the lowest-priority sequence is preempted (blocks freed, recomputed later).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from cotserve.worker.block_manager import NO_HIT, BlockManager, CacheHit, capacity_tokens, long_rope_root
from cotserve.worker.scheduling import PriorityYield, SchedulingPolicy
from cotserve.worker.sequence import SamplingParams, Sequence, SequenceStatus, SlaClass, TraceEvent

MAX_BATCH_PAUSE_S = 60.0
"""The longest one `pause_batch` may ask for: a pause is a lease its asker renews while it lasts, so that BATCH goes on
by itself when the asker (a gateway) stops asking or is gone."""


def check_batch_pause(seconds: float) -> None:
    """ValueError naming the allowed range unless 0 <= `seconds` <= MAX_BATCH_PAUSE_S."""
    if not 0.0 <= seconds <= MAX_BATCH_PAUSE_S:  # NaN fails both comparisons
        raise ValueError(f"pause_batch: {seconds} s, allowed 0..{MAX_BATCH_PAUSE_S:g}")


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
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), done before the forward pass

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


def is_stop_token(params: SamplingParams, eos_token_ids: frozenset[int], token: int) -> bool:
    """`token` ends a sequence of `params`: one of its stop_token_ids, or end of sequence unless it ignores that (the
    scheduler's rule, and the worker front's when it makes the text)."""
    return token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)


class WaitingQueue:
    """The sequences waiting to be scheduled, always in the policy's `key` order (a binary search as each joins or
    leaves), counted as they come and go: per class, the urgent ones with prompt tokens to compute, and per request
    (probes aside), so no step sorts or scans it. Read it as a sequence; change it only through `add` and `remove`."""

    __slots__ = ("key", "seqs", "by_class", "urgent_prompts", "requests", "tenants")

    def __init__(self, key: Callable[[Sequence], tuple]) -> None:
        self.key = key
        self.seqs: list[Sequence] = []
        self.by_class = [0] * len(SlaClass)  # waiting sequences (probes included) per class
        self.urgent_prompts = 0  # waiting REALTIME/INTERACTIVE sequences with prompt tokens to compute
        self.requests: dict[str, int] = {}  # request id -> its waiting sequences (not probes)
        self.tenants: list[dict[str, int]] = [{} for _ in SlaClass]  # per class: tenant -> its waiting sequences

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.seqs)

    def __getitem__(self, i: int) -> Sequence:
        return self.seqs[i]

    def __contains__(self, seq: object) -> bool:
        return seq in self.seqs

    @property
    def num_urgent(self) -> int:
        return len(self.seqs) - self.by_class[SlaClass.BATCH]

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.seqs, seq, key=self.key)
        self._count(seq, 1)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out (found by its key: the keys are distinct); nothing when it is not here."""
        i = bisect.bisect_left(self.seqs, self.key(seq), key=self.key)
        if i < len(self.seqs) and self.seqs[i] is seq:
            del self.seqs[i]
            self._count(seq, -1)

    def _count(self, seq: Sequence, n: int) -> None:
        """Count `seq` joining (n = 1) or leaving (-1). What is counted of it does not change while it waits: nothing
        computes a waiting sequence (one preempted starts again from no computed tokens)."""
        self.by_class[seq.sla_class] += n
        tenants = self.tenants[seq.sla_class]
        if tenants.get(seq.tenant, 0) + n:
            tenants[seq.tenant] = tenants.get(seq.tenant, 0) + n
        else:
            del tenants[seq.tenant]
        if seq.sla_class != SlaClass.BATCH and seq.num_computed_tokens < len(seq) - 1:
            self.urgent_prompts += n
        if not seq.is_probe:
            left = self.requests.get(seq.request_id, 0) + n
            if left:
                self.requests[seq.request_id] = left
            else:
                del self.requests[seq.request_id]


def walk(running: list[Sequence], waiting: list[Sequence], key: Callable[[Sequence], tuple],
         admitting: Callable[[], bool]) -> Iterator[Sequence]:
    """Running and waiting sequences (each list in `key` order) merged in `key` order, the waiting ones only while
    `admitting()`: once one cannot be admitted, strict priority admits nothing newer this step, so the rest of the
    queue is not walked (the queue is kept in order: a copy of it, not a sort)."""
    i = j = 0
    while i < len(running) or (j < len(waiting) and admitting()):
        if j < len(waiting) and admitting() and (i == len(running) or key(waiting[j]) < key(running[i])):
            j += 1
            yield waiting[j - 1]
        else:
            i += 1
            yield running[i - 1]


class Scheduler:
    """Waiting and running queues over one `BlockManager`, in the order of a scheduling policy (SLA-class priority
    with BATCH yielding to urgent prompts by default).

    Rules (each has a test in tests/worker/test_scheduler.py):
    - Every step walks running and waiting sequences in the policy's `key` order within a token budget; the waiting
      ones only up to the first it cannot admit (strict priority: nothing newer is admitted past it), so a step's
      cost follows its batch, not the queue (`WaitingQueue` keeps that order and its counts: no step sorts or scans
      it).
    - When blocks run short, the victim is the lowest-priority sequence not yet scheduled this
      step whose priority is at most the requester's: BATCH before INTERACTIVE, newest first,
      never a more urgent class for a less urgent one.
    - A waiting sequence may take the seat of a running one of a strictly less urgent class
      when `max_num_seqs` is reached, so REALTIME joins the very next step.
    - A waiting sequence starts from the longest chain of cached blocks of its tokens (prefix
      cache) and computes the rest; when its next block is being computed this step by another
      sequence, it waits a step and takes it from the cache instead of computing it twice.
    - A sequence whose samples fork once its prompt is computed (`group_size` > 1) is admitted only when there are
      seats for all of them, and holds them until they fork (`seats_taken`): never more than `max_num_seqs` run.
    - What BATCH work may do in a step (a share of the budget kept for it, a cap while urgent work is present,
      sitting steps out for urgent prompts or while paused) is the scheduling policy's (`scheduling.py`): the
      scheduler asks it once per step and enforces its `StepRules`.

    Only the engine thread calls it. Every path that ends a sequence (`finish`, `abort`) frees
    its blocks, so no block outlives its sequence.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: SchedulingPolicy | None = None, max_model_len: int = 2**31 - 1,
                 eos_token_ids: frozenset[int] = frozenset(), long_rope_after: int | None = None) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy if policy is not None else PriorityYield()
        self.key = self.policy.key
        self.batch_yielded = False  # the last step ran no BATCH work because of an urgent prompt
        self.num_batch_yields_total = 0
        self.batch_paused_until = 0.0  # time.monotonic() until which BATCH sits out every step with urgent work
        self.num_batch_paused_steps_total = 0
        self.max_model_len = max_model_len
        self.long_rope_after = long_rope_after  # LongRoPE: a longer sequence takes the long factors at every position
        self.eos_token_ids = eos_token_ids
        self.waiting = WaitingQueue(self.key)
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0
        bm = block_manager  # the longest sequence the pool holds alone
        self.capacity_tokens = capacity_tokens(bm.num_blocks, bm.block_size, bm.windows, max_num_batched_tokens)

    def add(self, seq: Sequence) -> None:
        if seq.max_len > self.capacity_tokens:  # at its longest it needs more KV than the whole pool
            raise ValueError(f"sequence of up to {seq.max_len} tokens exceeds the KV pool ({self.capacity_tokens} tokens)")
        seq.status = SequenceStatus.WAITING
        self.policy.on_add(seq)
        self.waiting.add(seq)

    @property
    def seats_taken(self) -> int:
        """Batch seats held: a running sequence's own, and the seats its samples still to fork have reserved."""
        return sum(s.group_size for s in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_batch_work(self) -> bool:
        """A BATCH sequence waits or runs."""
        return bool(self.waiting.by_class[SlaClass.BATCH]) or any(s.sla_class == SlaClass.BATCH for s in self.running)

    def has_urgent_prompt(self) -> bool:
        """A REALTIME/INTERACTIVE sequence, waiting or running, has prompt tokens to compute."""
        return self.waiting.urgent_prompts > 0 or any(
            s.sla_class != SlaClass.BATCH and s.num_computed_tokens < len(s) - 1 for s in self.running)

    def pause_batch(self, seconds: float) -> None:
        """Pause BATCH for `seconds` from now (what a pause means is the policy's: see `scheduling.Priority`); 0 ends
        a pause now. A later call replaces the
        pause in force, so a caller keeps BATCH paused by asking again before its pause ends."""
        check_batch_pause(seconds)
        self.batch_paused_until = time.monotonic() + seconds if seconds > 0 else 0.0

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        for victim in self.policy.rebalance(self):  # seats the policy takes back first (tenant-fair: over-share work)
            self._preempt(victim, requeue=True)
            batch.preempted.append(victim)
        rules = self.policy.step_rules(self)
        paused, may_yield, reserve, batch_cap = rules.paused, rules.may_yield, rules.reserve, rules.batch_cap
        used_urgent = used_batch = 0
        scheduled: set[int] = set()
        admission_blocked = urgent_prompt = yielded = False
        for seq in self._by_priority(lambda: not admission_blocked):
            if seq.status == SequenceStatus.PREEMPTED and seq in batch.preempted:
                continue  # preempted a moment ago in this very step
            is_batch = seq.sla_class == SlaClass.BATCH
            if is_batch and paused:
                break  # every urgent sequence came first (priority order): BATCH sits every paused step out
            if is_batch and urgent_prompt and may_yield:
                yielded = True  # every urgent sequence came first (priority order): BATCH sits this step out
                break
            limit = self.max_num_batched_tokens - used_urgent - used_batch
            if is_batch:
                limit = min(limit, batch_cap - used_batch)
            else:
                limit -= max(0, reserve - used_batch)
            running = seq.status == SequenceStatus.RUNNING
            hit = NO_HIT if running or admission_blocked else self.block_manager.find_cached(seq)
            if hit.pending:
                continue  # its next blocks are being computed this step: take them from the cache next step
            start = len(hit.blocks) * self.block_manager.block_size if hit.blocks else seq.num_computed_tokens
            n = min(len(seq) - start, limit)
            if n <= 0:
                continue
            target = start + n
            if running:
                if not self.block_manager.fits_in_place(seq, target):  # else nothing to allocate, nobody to preempt
                    if not self._make_room(seq, target, batch, scheduled, allow_self=True):
                        continue
                    self.block_manager.allocate(seq, target, hit)
            else:
                if admission_blocked:
                    continue
                if not self._admit(seq, start, target, hit, batch, scheduled):
                    admission_blocked = True  # strict priority: nothing newer jumps ahead of it
                    continue
                self.block_manager.allocate(seq, target, hit)
            batch.items.append(ScheduledSeq(seq, n))
            scheduled.add(seq.seq_id)
            if is_batch:
                used_batch += n
            else:
                used_urgent += n
                urgent_prompt = urgent_prompt or start < len(seq) - 1
        else:  # no BATCH sequence was reached: one still waiting past a blocked admission sits this step out as well
            yielded = admission_blocked and urgent_prompt and may_yield and self.waiting.by_class[SlaClass.BATCH] > sum(
                s.sla_class == SlaClass.BATCH for s in batch.preempted)  # those wait too (this step skips them)
        return self._end_step(batch, paused, yielded)

    def _end_step(self, batch: ScheduledBatch, paused: bool, yielded: bool) -> ScheduledBatch:
        if paused:  # a pause is not a yield: the every-other-step rule counts only yields
            yielded = False
            self.num_batch_paused_steps_total += self.has_batch_work()
        self.batch_yielded = yielded
        self.num_batch_yields_total += yielded
        if batch.items:  # an empty batch runs nothing: planned copies wait for the next one
            batch.block_copies = self.block_manager.take_copies()
        return batch

    def _by_priority(self, admitting: Callable[[], bool]) -> Iterator[Sequence]:
        """The step's walk (`walk`) over the running and the waiting sequences as of its start."""
        return walk(sorted(self.running, key=self.key), self.waiting.seqs[:], self.key, admitting)

    def _admit(self, seq: Sequence, start: int, target: int, hit: CacheHit, batch: ScheduledBatch,
               scheduled: set[int]) -> bool:
        """Move a waiting `seq` to running with room for `target` tokens (a seat and blocks, preempting less urgent
        work when it must, as `_can_admit` judged possible); False when it cannot be admitted this step."""
        if not self._can_admit(seq, target, scheduled, hit) or not (
            self._make_seat(seq, batch, scheduled) and self._make_room(seq, target, batch, scheduled, False, hit)
        ):
            return False
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.policy.on_admit(seq)
        if not seq.num_preemptions:
            bm = self.block_manager
            seq.kv_used_fraction_at_admission = bm.num_used_blocks / bm.num_blocks
            seq.num_cached_tokens = min(start, len(seq.prompt_ids))
        seq.record(TraceEvent.SCHEDULED)
        self.running.append(seq)
        return True

    def advance(self, batch: ScheduledBatch) -> None:
        """After the forward pass: the scheduled tokens are computed; full blocks join the prefix cache."""
        for item in batch.items:
            item.seq.num_computed_tokens += item.num_tokens
            self.block_manager.register_computed(item.seq)

    def append_token(self, seq: Sequence, token: int, logprob: float | None = None) -> str | None:
        """After a step, for each token generated for `seq` (sampled, or forced by a reasoning control), in order:
        the token joins the sequence, and a sequence it ends is finished here (blocks freed): "stop" for one of its
        stop tokens (its stop_token_ids; end of sequence unless ignore_eos), "length" at max_new_tokens or the
        model's length; None while it goes on. Stop strings need text, so the engine finishes those (`finish`)."""
        seq.append(token, logprob)
        if self.is_stop_token(seq, token):
            self.finish(seq, SequenceStatus.FINISHED_STOPPED)
            return "stop"
        if len(seq.output_ids) >= seq.params.max_new_tokens or len(seq) >= self.max_model_len:
            self.finish(seq, SequenceStatus.FINISHED_LENGTH)
            return "length"
        if len(seq) - 1 == self.long_rope_after and seq.status == SequenceStatus.RUNNING:
            self._preempt(seq)  # every key again, rotated by the long factors, under a hash root of their own
            seq.cache_root, seq.block_hashes = long_rope_root(seq.cache_root), []
        return None

    def is_stop_token(self, seq: Sequence, token: int) -> bool:
        return is_stop_token(seq.params, self.eos_token_ids, token)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """`children` (samples of `parent`'s prompt) join the running batch sharing `parent`'s
        computed blocks; each takes the seat `parent` reserved for it."""
        for child in children:
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            child.first_scheduled_time, child.fair_tag = parent.first_scheduled_time, parent.fair_tag
            child.kv_used_fraction_at_admission = parent.kv_used_fraction_at_admission
            child.num_cached_tokens = parent.num_cached_tokens
            self.running.append(child)
        parent.group_size = 1

    def fork_probe(self, parent: Sequence, probe: Sequence) -> bool:
        """An early-exit `probe` of `parent` joins the running batch sharing `parent`'s computed blocks
        (copy-on-write); False, changing nothing, when no batch seat or free block is left for it now."""
        if self.seats_taken >= self.max_num_seqs or self.block_manager.num_free_blocks < 2:
            return False
        self.block_manager.fork(parent, probe)
        probe.status = SequenceStatus.RUNNING
        probe.first_scheduled_time = parent.first_scheduled_time
        self.running.append(probe)
        return True

    def _victims(self, seq: Sequence, scheduled: set[int], allow_self: bool) -> list[Sequence]:
        key = self.key(seq)
        return [r for r in self.running
                if r.seq_id not in scheduled and (self.key(r) > key or (allow_self and r is seq))]

    def _can_admit(self, seq: Sequence, num_tokens: int, scheduled: set[int], hit: CacheHit) -> bool:
        """Whether preempting lower-priority work could seat `seq` and hold `num_tokens`: checked
        first, so nobody is preempted for an admission that fails anyway."""
        victims = self._victims(seq, scheduled, False)
        taken = self.seats_taken
        if taken + seq.group_size > self.max_num_seqs:
            less_urgent = sum(v.group_size for v in victims if self.key(v)[0] > self.key(seq)[0])
            if taken - less_urgent + seq.group_size > self.max_num_seqs:
                return False
        reclaimable = self.block_manager.num_free_blocks + sum(map(self.block_manager.num_held_blocks, victims))
        return self.block_manager.num_new_blocks(seq, num_tokens, hit) <= reclaimable

    def _make_room(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch, scheduled: set[int],
                   allow_self: bool, hit: CacheHit = NO_HIT) -> bool:
        """Preempt lowest-priority sequences until `seq` can hold `num_tokens`; False if it cannot
        (or, when `allow_self`, if `seq` itself was the lowest and got preempted)."""
        while not self.block_manager.can_allocate(seq, num_tokens, hit):
            candidates = self._victims(seq, scheduled, allow_self)
            if not candidates:
                return False
            victim = max(candidates, key=self.key)
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _make_seat(self, seq: Sequence, batch: ScheduledBatch, scheduled: set[int]) -> bool:
        """Free batch seats for a waiting `seq` (and its samples to come) by preempting a strictly less urgent class."""
        while self.seats_taken + seq.group_size > self.max_num_seqs:
            candidates = [r for r in self._victims(seq, scheduled, False) if self.key(r)[0] > self.key(seq)[0]]
            if not candidates:
                return False
            victim = max(candidates, key=self.key)
            self._preempt(victim)
            batch.preempted.append(victim)
        return True

    def _preempt(self, seq: Sequence, requeue: bool = False) -> None:
        """Take `seq` off the batch (its blocks freed; it is recomputed when readmitted). It keeps its place in the
        waiting order, unless `requeue`: then the policy places it as if it had just arrived (`on_add`)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        seq.record(TraceEvent.PREEMPTED)
        self.num_preemptions_total += 1
        if requeue:
            self.policy.on_add(seq)
        self.waiting.add(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence with a finished `status` and free its blocks (again on a finished one: only the status)."""
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
        if seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)
