"""Per-worker, per-class admission in the gateway ("elastic batch size").

- REALTIME is never queued here: it goes straight to the worker, whose scheduler lets it in at
  the next step.
- INTERACTIVE has an in-flight limit that follows its inter-token latency target. Every Stats
  poll, with enough recent samples, `limit = clamp(round(target_ms / p95_ms * limit), 2, ceiling)`:
  multiplicative in both directions, so it converges in a few polls when load changes, and it
  reacts to the latency users see (measured here, per token) rather than to a proxy. Chosen over
  AIMD because the additive increase would take tens of polls to climb from 2 to the ceiling.
  The ceiling is twice the worker's seats (its `max_num_seqs`; 32 until its Info says): a full
  batch running and one waiting in the worker, whose scheduler refills a finished sequence's seat
  in the same step, where a request queued here waits for the stream's end to reach the gateway
  first. A fixed 32 held a worker of 64 seats to half of them while its inter-token p95 was 5-8 ms
  against a 100 ms target: open-loop INTERACTIVE alone at 0.8 of the capacity measured through the
  gateway missed its TTFT target in 28-55% of requests (the gateway's queue full, some turned away),
  with a ceiling of 128 in none (`/tmp` driver of `bench slo`'s load functions, 15 s steady runs
  alternated with the other gateways on one worker: six runs with 32, two with 128; without admission
  at all, none in four).
- BATCH is admitted only while the worker has spare KV blocks and no urgent work waiting (there
  or in this gateway's INTERACTIVE queue), up to a large limit (128 by default), restarted slowly after urgent
  work queued here: its in-flight ceiling drops to `batch_restart_limit` (8) the moment an INTERACTIVE request has
  to queue, and doubles at every Stats poll during which none did. Without it, a burst's INTERACTIVE queue
  emptying for a moment let the whole BATCH queue (up to 128 requests) start at once, and the worker's steps
  grew by that many prefills and decodes while INTERACTIVE kept arriving. Replaying `bench slo`'s bursty load
  (120 s, no SLO predictor; `/tmp` driver, four runs alternated): INTERACTIVE missed its target in 11.4% and 12.1%
  of requests without the restart rule (some turned away, its queue full) and in 0.9% and 0.0% with it, at about
  the same output tokens; with no BATCH at all, in none.

Waiters queue per class with their own deadlines; a full queue is `RESOURCE_EXHAUSTED` with a
`retry-after-ms` estimate. No grpc here: the servicer maps the exceptions.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

from cotserve.common.errors import ResourceExhausted
from cotserve.common.sampling import SlaClass
from cotserve.common.sla import SlaTarget, sla_targets
from cotserve.common.stats import percentile


class QueueDeadlineExceeded(Exception):
    """The request's deadline passed while it waited in the gateway; it never reached a worker."""


INTERACTIVE_CEILING_PER_SEAT = 2  # INTERACTIVE in flight per seat of the worker at most (by default): a batch waiting
UNKNOWN_SEATS_CEILING = 32  # INTERACTIVE's default ceiling while the worker's seats are unknown


@dataclass(slots=True)
class AdmissionConfig:
    enabled: bool = True  # False: every request goes straight to its worker (a benchmark baseline)
    targets: dict[SlaClass, SlaTarget] = field(default_factory=sla_targets)
    interactive_initial_limit: int = 8
    interactive_min_limit: int = 2
    interactive_max_limit: int = 0  # INTERACTIVE's ceiling; 0: `INTERACTIVE_CEILING_PER_SEAT` x the worker's seats
    batch_limit: int = 128
    batch_restart_limit: int = 8  # BATCH's in-flight ceiling once INTERACTIVE queued here (doubles every quiet poll)
    batch_min_free_kv_fraction: float = 0.1
    max_queue: dict[SlaClass, int] = field(default_factory=lambda: {SlaClass.INTERACTIVE: 256, SlaClass.BATCH: 1024})
    min_samples: int = 20
    window_s: float = 2.0


@dataclass(slots=True)
class WorkerLoad:
    """What the latest Stats poll said."""

    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    num_waiting_urgent: int = 0
    seats: int = 0  # the most sequences the worker runs at once (its Info's max_num_seqs; 0: not known yet)


class Admission:
    """The admission state of one worker. All methods run on the gateway's event loop."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.limit = {SlaClass.INTERACTIVE: self.config.interactive_initial_limit, SlaClass.BATCH: self.config.batch_limit}
        self.in_flight = {c: 0 for c in SlaClass}
        self.queues: dict[SlaClass, deque[asyncio.Future]] = {SlaClass.INTERACTIVE: deque(), SlaClass.BATCH: deque()}
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

    async def acquire(self, cls: SlaClass, timeout_s: float | None) -> float:
        """Wait for a slot; return the milliseconds spent queued here.

        Raises ResourceExhausted (queue full, with retry-after-ms) or QueueDeadlineExceeded."""
        start = time.monotonic()
        if self.starts_now(cls):
            self.in_flight[cls] += 1
            return 0.0
        queue = self.queues[cls]
        if cls == SlaClass.INTERACTIVE:
            self.restrain_batch()
        if len(queue) >= self.config.max_queue[cls]:
            raise ResourceExhausted(
                f"sla_class {cls.name}: the gateway queue for this worker is full ({len(queue)} waiting)",
                trailers={"retry-after-ms": str(self.retry_after_ms(cls))},
            )
        waiter = asyncio.get_running_loop().create_future()
        queue.append(waiter)
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
                waiter = queue.popleft()
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
            target = cfg.targets[SlaClass.INTERACTIVE].itl_p95_ms
            current = self.limit[SlaClass.INTERACTIVE]
            wanted = round(target / p95 * current)
            self.limit[SlaClass.INTERACTIVE] = min(self.interactive_ceiling(), max(cfg.interactive_min_limit, wanted))
        self.pump()
