"""Scheduling policies: the order a step walks sequences in, and the rules BATCH work runs under in that step. No
torch, no grpc.

A policy is a small strategy object the `Scheduler` asks once per step (`step_rules`) and for every ordering
(`key`); the scheduler keeps the token budget, the seats and the KV blocks. Policies are chosen by name from
`POLICIES` (the worker's `--scheduling`); a new one is a subclass here and an entry in that table.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from cotserve.common.fairness import FairClock
from cotserve.worker.sequence import Sequence, SlaClass

if TYPE_CHECKING:
    from cotserve.worker.scheduler import Scheduler


def priority(seq: Sequence) -> tuple[int, float, int]:
    """SLA class (REALTIME first), then arrival (a preempted sequence keeps its original arrival, so it is readmitted
    before newer work of its class)."""
    return (int(seq.sla_class), seq.arrival_time, seq.seq_id)


def arrival_order(seq: Sequence) -> tuple[int, float, int]:
    """Arrival only, every class alike."""
    return (0, seq.arrival_time, seq.seq_id)


@dataclass(slots=True, frozen=True)
class StepRules:
    """What BATCH work may do in one step."""

    batch_cap: int  # BATCH's most tokens this step
    reserve: int = 0  # tokens of the budget kept for BATCH (when it has work and does not sit the step out)
    paused: bool = False  # BATCH sits this step out: paused, and urgent work is present
    may_yield: bool = False  # BATCH sits this step out if an urgent prompt is computed in it


class SchedulingPolicy:
    """The base: first come, first served, no class above another (`fifo`).

    `key` orders the waiting queue, the walk of each step and the choice of preemption victims (the largest key goes
    first); the first element of a key is the sequence's rank, and a sequence may take the seat of a running one only
    of a strictly greater rank. `step_rules` is asked once at the start of every step."""

    name: ClassVar[str] = "fifo"
    by_class: ClassVar[bool] = False  # whether SLA classes rank (and pausing BATCH means anything)

    def key(self, seq: Sequence) -> tuple[int, float, int]:
        return arrival_order(seq)

    def step_rules(self, sched: Scheduler) -> StepRules:
        return StepRules(batch_cap=sched.max_num_batched_tokens)

    def rebalance(self, sched: Scheduler) -> list[Sequence]:
        """Running sequences to preempt at the start of a step, before its walk (none here); the scheduler queues
        each again as if it had just arrived (`on_add`)."""
        return []

    def on_add(self, seq: Sequence) -> None:
        """A new sequence joins the waiting queue (not one back from preemption: it keeps what it had, unless the
        policy's own `rebalance` took its seat)."""

    def on_admit(self, seq: Sequence) -> None:
        """A waiting sequence starts running."""


class Priority(SchedulingPolicy):
    """SLA-class priority (`priority`): REALTIME before INTERACTIVE before BATCH, each in arrival order.

    - BATCH work, when there is any, keeps `batch_min_share` of each step's token budget (in each step it does not
      sit out); while urgent work is present it takes at most `max_batch_tokens_when_urgent` tokens a step (never
      less than its share), so a wave of BATCH prefill cannot stretch the steps urgent sequences wait on.
    - While BATCH is paused (`Scheduler.pause_batch`), no step that has urgent work runs BATCH work: running BATCH
      sequences keep their seats and pages but sit out, and go on in the steps with no urgent work; the steps BATCH
      runs alone during a pause take at most `max_batch_tokens_when_urgent` of its tokens too, so BATCH arrivals that
      piled up are not prefilled together in one long step for the next urgent arrival to wait on."""

    name: ClassVar[str] = "priority"
    by_class: ClassVar[bool] = True

    def __init__(self, batch_min_share: float = 0.1, max_batch_tokens_when_urgent: int = 256) -> None:
        if not 0.0 <= batch_min_share <= 1.0:
            raise ValueError(f"batch_min_share: {batch_min_share}, allowed 0..1")
        if max_batch_tokens_when_urgent < 1:
            raise ValueError(f"max_batch_tokens_when_urgent: {max_batch_tokens_when_urgent}, must be >= 1")
        self.batch_min_share = batch_min_share
        self.max_batch_tokens_when_urgent = max_batch_tokens_when_urgent

    def key(self, seq: Sequence) -> tuple[int, float, int]:
        return priority(seq)

    def may_yield(self, sched: Scheduler) -> bool:
        """Whether BATCH may sit this step out for an urgent prompt (never, under this policy)."""
        return False

    def step_rules(self, sched: Scheduler) -> StepRules:
        urgent = bool(sched.waiting.num_urgent or any(s.sla_class != SlaClass.BATCH for s in sched.running))
        pause = sched.batch_paused_until > 0.0 and time.monotonic() < sched.batch_paused_until
        paused = urgent and pause
        may_yield = paused or self.may_yield(sched)
        reserve = 0
        if not may_yield and sched.has_batch_work():  # a step BATCH sits out keeps no share for it
            reserve = math.ceil(self.batch_min_share * sched.max_num_batched_tokens)
        batch_cap = sched.max_num_batched_tokens
        if urgent or pause:  # paused, BATCH alone keeps its steps short too: an urgent arrival waits on the one running
            batch_cap = max(reserve, self.max_batch_tokens_when_urgent)
        return StepRules(batch_cap=batch_cap, reserve=reserve, paused=paused, may_yield=may_yield)


class PriorityYield(Priority):
    """SLA-class priority where BATCH also yields to urgent prompts (`priority-yield`, the default): a step that
    computes a REALTIME/INTERACTIVE prompt (an arrival, or one back from preemption) runs no BATCH work, so the urgent
    request's first token waits on a step of urgent work only. BATCH yields at most every other step, so a stream of
    urgent arrivals cannot starve it."""

    name: ClassVar[str] = "priority-yield"

    def may_yield(self, sched: Scheduler) -> bool:
        return not sched.batch_yielded and sched.has_urgent_prompt()


class TenantFair(PriorityYield):
    """SLA-class priority with BATCH yielding (`priority-yield`), and within a class a fair share of the steps for
    every tenant (`tenant-fair`): start-time fair queueing. A sequence that joins the queue gets a virtual start tag,
    the later of the class's virtual time and where its tenant's previous sequence's work ends (its prompt and
    max_new_tokens, in tokens), and the class's queue is served in tag order; the virtual time follows the tags of
    the sequences that start. So a tenant that queues a hundred requests does not make another's one request wait
    behind them: the newcomer's tag is about the virtual time now, ahead of the backlog's later tags. A preempted
    sequence keeps its tag, as it keeps its arrival under `priority`; samples and probes share their request's.

    Tags order the queue; seats are shared too (`rebalance`): a tenant holding more than its fair share of a class's
    seats gives the excess back, newest first, the step another tenant of the class waits, so a newcomer does not wait
    for the seats of another's long-running samples to free. With one tenant it orders as `priority-yield`."""

    name: ClassVar[str] = "tenant-fair"

    def __init__(self, batch_min_share: float = 0.1, max_batch_tokens_when_urgent: int = 256) -> None:
        super().__init__(batch_min_share, max_batch_tokens_when_urgent)
        self.clocks = [FairClock() for _ in SlaClass]  # one per class, indexed by its value

    def key(self, seq: Sequence) -> tuple[int, float, int]:
        return (int(seq.sla_class), seq.fair_tag, seq.seq_id)

    def rebalance(self, sched: Scheduler) -> list[Sequence]:
        """Seats back from tenants over their fair share for tenants under it that wait, within each class: a
        class's fair share is the seats over the tenants with work of that class (running or waiting), so a tenant
        alone uses every seat and is the first to give them back when another arrives. The seats the waiting tenants
        could take (up to their share, up to what they wait with) less the free ones are taken from tenants over their
        share, the newest sequences first, none below its tenant's share; each queues again behind its tenant's other
        work. A waiting sequence that then cannot be admitted (its blocks) leaves the seats free: the next step takes
        none, so nothing is preempted over and over."""
        victims: list[Sequence] = []
        free = sched.max_num_seqs - sched.seats_taken
        for cls in SlaClass:
            waiting = sched.waiting.tenants[cls]
            if not waiting:
                continue
            running = [r for r in sched.running if r.sla_class == cls]
            held: dict[str, int] = {}
            for r in running:
                held[r.tenant] = held.get(r.tenant, 0) + r.group_size
            share = sched.max_num_seqs / len(set(held) | set(waiting))
            want = sum(min(n, math.floor(share - held.get(t, 0))) for t, n in waiting.items() if held.get(t, 0) < share)
            need = want - free
            for victim in sorted(running, key=self.key, reverse=True):
                if need <= 0:
                    break
                if held[victim.tenant] - victim.group_size >= share:
                    victims.append(victim)
                    held[victim.tenant] -= victim.group_size
                    need -= victim.group_size
            free = max(0, free - want)
        return victims

    def on_add(self, seq: Sequence) -> None:
        seq.fair_tag = self.clocks[int(seq.sla_class)].tag(seq.tenant, seq.max_len * seq.group_size)

    def on_admit(self, seq: Sequence) -> None:
        self.clocks[int(seq.sla_class)].start(seq.fair_tag)


POLICIES: dict[str, type[SchedulingPolicy]] = {p.name: p for p in (SchedulingPolicy, Priority, PriorityYield, TenantFair)}
"""Every scheduling policy by the name `--scheduling` takes."""


def make_policy(name: str, batch_min_share: float = 0.1, max_batch_tokens_when_urgent: int = 256) -> SchedulingPolicy:
    """The policy called `name`, with the class-priority settings where it takes them; ValueError names the choices."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"scheduling: {name!r}, allowed: {', '.join(POLICIES)}")
    if issubclass(cls, Priority):
        return cls(batch_min_share, max_batch_tokens_when_urgent)
    return cls()
