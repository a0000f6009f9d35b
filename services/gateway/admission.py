"""Per-worker, per-class admission in the gateway ("elastic batch size").

- REALTIME is never queued here: it goes straight to the worker, whose scheduler lets it in at the next step.
- INTERACTIVE has an in-flight limit that follows its inter-token latency target. Every Stats poll, with enough
  recent samples, `limit = clamp(round(target_ms / p95_ms * limit), min, ceiling)`: multiplicative in both
  directions, so it converges in a few polls when load changes, and it reacts to the latency users see (measured
  here, per token) rather than to a proxy. Chosen over AIMD because the additive increase would take tens of polls to
  climb from the minimum to the ceiling. The ceiling is twice the worker's seats (its `max_num_seqs`; 32 until its
  Info says): a full batch running and one waiting in the worker, whose scheduler refills a finished sequence's seat
  in the same step, where a request queued here waits for the stream's end to reach the gateway first. A ceiling
  below the worker's seats would leave seats empty while INTERACTIVE queues here, its inter-token latency far under
  the target.
- BATCH is admitted only while the worker has spare KV blocks and no urgent work waiting (there or in this gateway's
  INTERACTIVE queue), up to a large limit, restarted slowly after urgent work queued here: its in-flight ceiling drops
  to `batch_restart_limit` the moment an INTERACTIVE request has to queue, and doubles at every Stats poll during
  which none did. Without it, a burst's INTERACTIVE queue emptying for a moment would let the whole BATCH queue start
  at once, and the worker's steps grow by that many prefills and decodes while INTERACTIVE keeps arriving.

Waiters queue per class with their own deadlines, each class's queue served fairly among tenants (`FairQueue`:
one tenant's backlog does not make another's requests wait behind it); a full queue is `RESOURCE_EXHAUSTED` with a
`retry-after-ms` estimate. No grpc here: the servicer maps the exceptions.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from cotserve.common.config import Cli, legacy_env
from cotserve.common.errors import ResourceExhausted
from cotserve.common.fairness import FairClock
from cotserve.common.sampling import SlaClass
from cotserve.common.sla import SlaTarget, sla_targets
from cotserve.common.stats import percentile


class QueueDeadlineExceeded(Exception):
    """The request's deadline passed while it waited in the gateway; it never reached a worker."""


INTERACTIVE_CEILING_PER_SEAT = 2  # INTERACTIVE in flight per seat of the worker at most (by default): a batch waiting
UNKNOWN_SEATS_CEILING = 32  # INTERACTIVE's default ceiling while the worker's seats are unknown


@dataclass(slots=True)
class AdmissionConfig:
    """The gateway's per-worker admission settings (a group of `GatewayConfig`: each a setting of `serve gateway`)."""

    enabled: bool = True
    """Per-class admission: limits and queues per worker (--no-admission forwards every request at once, a
    benchmark baseline)."""
    batch_limit: int = 128
    """BATCH requests in flight per worker at most."""
    batch_restart_limit: int = 8
    """BATCH's in-flight ceiling per worker right after an INTERACTIVE request had to queue here; it doubles at every
    poll without one, back up to batch_limit (BATCH restarts slowly after a burst instead of all at once)."""
    max_queue_interactive: int = 256
    """INTERACTIVE requests waiting per worker at most (then RESOURCE_EXHAUSTED)."""
    max_queue_batch: int = 1024
    """BATCH requests waiting per worker at most (then RESOURCE_EXHAUSTED)."""
    interactive_initial_limit: int = 8
    """INTERACTIVE requests in flight per worker at first, before its inter-token latency has been measured."""
    interactive_min_limit: int = 2
    """INTERACTIVE's in-flight limit per worker never goes below this, however slow its tokens."""
    interactive_max_limit: int = 0
    """INTERACTIVE's in-flight ceiling per worker; 0: twice the worker's seats (its max_num_seqs)."""
    batch_min_free_kv_fraction: float = 0.1
    """BATCH starts on a worker only while at least this share of its KV blocks is free (0..1)."""
    min_samples: int = 20
    """Inter-token gaps needed in the window before INTERACTIVE's limit follows their p95."""
    window_s: float = 2.0
    """Seconds of INTERACTIVE inter-token gaps INTERACTIVE's limit follows."""

    CLI: ClassVar[dict[str, Cli]] = {
        "enabled": Cli(name="admission", env=("COTSERVE_ADMISSION",)),
        **legacy_env("batch_limit", "max_queue_interactive", "max_queue_batch"),
        "min_samples": Cli(name="admission_min_samples"),
        "window_s": Cli(name="admission_window_s"),
    }

    def max_queue(self, cls: SlaClass) -> int:
        """Requests of `cls` that may wait per worker."""
        return self.max_queue_interactive if cls == SlaClass.INTERACTIVE else self.max_queue_batch

    def validate(self) -> None:
        """ValueError naming the first setting out of its range."""
        for name in ("batch_limit", "batch_restart_limit", "max_queue_interactive", "max_queue_batch",
                     "interactive_max_limit"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: {getattr(self, name)}, must be >= 0")
        if not 1 <= self.interactive_min_limit <= self.interactive_initial_limit:
            raise ValueError(f"interactive_min_limit / interactive_initial_limit: {self.interactive_min_limit} / "
                             f"{self.interactive_initial_limit}, need 1 <= min <= initial")
        if not 0.0 <= self.batch_min_free_kv_fraction <= 1.0:
            raise ValueError(f"batch_min_free_kv_fraction: {self.batch_min_free_kv_fraction}, allowed 0..1")
        if self.min_samples < 1 or self.window_s <= 0:
            raise ValueError(f"admission_min_samples / admission_window_s: {self.min_samples} / {self.window_s}, "
                             "need >= 1 and > 0")


@dataclass(slots=True)
class WorkerLoad:
    """What the latest Stats poll said."""

    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    num_waiting_urgent: int = 0
    seats: int = 0  # the most sequences the worker runs at once (its Info's max_num_seqs; 0: not known yet)


class FairQueue:
    """One class's waiters on one worker, served in start-time fair order by tenant: a waiter's tag is the later of
    the queue's virtual time and the end of its tenant's queued work (its cost: the request's samples), and the
    lowest tag goes first. One tenant's backlog does not make another's request wait behind it; alone, a tenant's
    waiters go in arrival order. `len`, `bool` and membership as a deque's."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, asyncio.Future]] = []
        self._seq = itertools.count()
        self.clock = FairClock()  # its virtual time is the tag of the latest waiter granted

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __contains__(self, waiter: object) -> bool:
        return any(w is waiter for _, _, w in self._heap)

    def push(self, waiter: asyncio.Future, tenant: str = "", cost: int = 1) -> None:
        heapq.heappush(self._heap, (self.clock.tag(tenant, max(1, cost)), next(self._seq), waiter))

    def pop(self) -> asyncio.Future:
        """The waiter to serve next (lowest tag); the virtual time moves to its tag."""
        tag, _, waiter = heapq.heappop(self._heap)
        self.clock.start(tag)
        return waiter

    def remove(self, waiter: asyncio.Future) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not waiter]
        heapq.heapify(self._heap)


class Admission:
    """The admission state of one worker. All methods run on the gateway's event loop."""

    def __init__(self, config: AdmissionConfig | None = None, targets: dict[SlaClass, SlaTarget] | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.targets = targets or sla_targets()  # INTERACTIVE's inter-token target steers its limit
        self.limit = {SlaClass.INTERACTIVE: self.config.interactive_initial_limit, SlaClass.BATCH: self.config.batch_limit}
        self.in_flight = {c: 0 for c in SlaClass}
        self.queues: dict[SlaClass, FairQueue] = {SlaClass.INTERACTIVE: FairQueue(), SlaClass.BATCH: FairQueue()}
        self.load = WorkerLoad()
        self._itl: deque[tuple[float, float]] = deque()  # (time, ms) of INTERACTIVE inter-token gaps
        self._service_ms: deque[float] = deque(maxlen=64)
        self._restrained = False  # restrain_batch since the last Stats poll

    # ---- the request path -------------------------------------------------------------------
    def can_start(self, cls: SlaClass) -> bool:
        if cls == SlaClass.REALTIME or not self.config.enabled:
            return True
        if self.in_flight[cls] >= self.limit[cls]:
            return False
        if cls == SlaClass.BATCH:
            load = self.load
            spare = load.kv_blocks_total == 0 or load.kv_blocks_free >= self.config.batch_min_free_kv_fraction * load.kv_blocks_total
            urgent_waiting = load.num_waiting_urgent > 0 or bool(self.queues[SlaClass.INTERACTIVE])
            return spare and not urgent_waiting
        return True

    def starts_now(self, cls: SlaClass) -> bool:
        """Whether a request of `cls` arriving now would start at once rather than queue here (`acquire`'s rule)."""
        return cls == SlaClass.REALTIME or not self.config.enabled or (not self.queues[cls] and self.can_start(cls))

    async def acquire(self, cls: SlaClass, timeout_s: float | None, tenant: str = "", cost: int = 1) -> float:
        """Wait for a slot (in `tenant`'s fair turn, `cost` its samples); return the milliseconds spent queued here.

        Raises ResourceExhausted (queue full, with retry-after-ms) or QueueDeadlineExceeded."""
        start = time.monotonic()
        if self.starts_now(cls):
            self.in_flight[cls] += 1
            return 0.0
        queue = self.queues[cls]
        if cls == SlaClass.INTERACTIVE:
            self.restrain_batch()
        if len(queue) >= self.config.max_queue(cls):
            raise ResourceExhausted(
                f"sla_class {cls.name}: the gateway queue for this worker is full ({len(queue)} waiting)",
                trailers={"retry-after-ms": str(self.retry_after_ms(cls))},
            )
        waiter = asyncio.get_running_loop().create_future()
        queue.push(waiter, tenant, cost)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except asyncio.TimeoutError:
            if waiter.done() and not waiter.cancelled():
                self.release(cls)  # granted at the very moment the deadline passed: give it back
            raise QueueDeadlineExceeded(f"deadline passed after {(time.monotonic() - start) * 1000:.0f} ms in the "
                                        f"gateway's {cls.name} queue") from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(cls)
            raise
        finally:
            if waiter in queue:
                queue.remove(waiter)
            if not waiter.done():
                waiter.cancel()
        return (time.monotonic() - start) * 1000

    def release(self, cls: SlaClass, service_ms: float | None = None) -> None:
        self.in_flight[cls] -= 1
        if service_ms is not None:
            self._service_ms.append(service_ms)
        self.pump()

    def pump(self) -> None:
        """Grant queued waiters, urgent class first, while their class may start."""
        for cls in (SlaClass.INTERACTIVE, SlaClass.BATCH):
            queue = self.queues[cls]
            while queue and self.can_start(cls):
                waiter = queue.pop()
                if waiter.done():
                    continue
                self.in_flight[cls] += 1
                waiter.set_result(None)

    def restrain_batch(self) -> None:
        """An INTERACTIVE request has to wait here (or the SLO predictor forecasts an urgent miss, `SloLink`): cut
        BATCH's ceiling to `batch_restart_limit` (those in flight go on; none start until fewer run), to climb back by
        doubling at the polls after it stops (`on_stats`)."""
        self._restrained = True
        self.limit[SlaClass.BATCH] = min(self.limit[SlaClass.BATCH], self.config.batch_restart_limit)

    def _restart_batch(self) -> None:
        """At a Stats poll: BATCH's ceiling doubles (up to `batch_limit`) unless restrained since the last."""
        if not self._restrained:
            cfg = self.config
            self.limit[SlaClass.BATCH] = min(cfg.batch_limit, max(1, 2 * self.limit[SlaClass.BATCH]))
        self._restrained = bool(self.queues[SlaClass.INTERACTIVE])  # still queued: the next poll is not a quiet one either

    def interactive_ceiling(self) -> int:
        """The most INTERACTIVE requests in flight on the worker however low its inter-token latency: the configured
        `interactive_max_limit`, else `INTERACTIVE_CEILING_PER_SEAT` x its seats (`UNKNOWN_SEATS_CEILING` until known)."""
        if self.config.interactive_max_limit:
            return self.config.interactive_max_limit
        seats = self.load.seats
        return INTERACTIVE_CEILING_PER_SEAT * seats if seats else UNKNOWN_SEATS_CEILING

    def queued_ahead(self, cls: SlaClass) -> int:
        """Requests queued here that a new request of `cls` would wait behind: its own class's queue and, for BATCH,
        INTERACTIVE's too (BATCH starts only while no INTERACTIVE waits); REALTIME is never queued."""
        if cls == SlaClass.REALTIME:
            return 0
        ahead = len(self.queues[SlaClass.INTERACTIVE])
        return ahead + len(self.queues[SlaClass.BATCH]) if cls == SlaClass.BATCH else ahead

    def retry_after_ms(self, cls: SlaClass) -> int:
        """A rough time for a queue slot to open: queued requests over the limit, times the mean service time."""
        mean = sum(self._service_ms) / len(self._service_ms) if self._service_ms else 1000.0
        waves = (len(self.queues[cls]) + 1) / max(1, self.limit[cls])
        return max(50, int(math.ceil(waves * mean)))

    # ---- feedback --------------------------------------------------------------------------
    def observe_itl(self, cls: SlaClass, gap_ms: float) -> None:
        if cls == SlaClass.INTERACTIVE:
            self._itl.append((time.monotonic(), gap_ms))

    def itl_p95_ms(self) -> float | None:
        cutoff = time.monotonic() - self.config.window_s
        while self._itl and self._itl[0][0] < cutoff:
            self._itl.popleft()
        if len(self._itl) < self.config.min_samples:
            return None
        return percentile((ms for _, ms in self._itl), 95)

    def on_stats(self, load: WorkerLoad) -> None:
        """Called on every Stats poll: adapt the INTERACTIVE limit and BATCH's ceiling, then admit what now fits."""
        self.load = load
        self._restart_batch()
        p95 = self.itl_p95_ms()
        if p95 is not None and p95 > 0:
            cfg = self.config
            target = self.targets[SlaClass.INTERACTIVE].itl_p95_ms
            current = self.limit[SlaClass.INTERACTIVE]
            wanted = round(target / p95 * current)
            self.limit[SlaClass.INTERACTIVE] = min(self.interactive_ceiling(), max(cfg.interactive_min_limit, wanted))
        self.pump()
