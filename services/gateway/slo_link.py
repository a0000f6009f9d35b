"""The gateway's link to the SLO predictor: it records one metrics window per second per (model,
worker, SLA class) and every finished request, reports them, keeps each model's latest forecast,
and, when asked (`--slo-routing`; least loaded otherwise), routes by predicted TTFT: it fetches the predictor's
trained trees of TTFT's 90th percentile when they change (for shedding too) and evaluates them itself for each
candidate worker (cotserve.common.latency: no call per request).
It acts on BATCH as an urgent class's forecast rises: holding BATCH arrivals in the gateway (`hold_batch`)
and pausing the model's running BATCH on its workers (`steer_pauses`, worker PauseBatch); and, while the forecast
is over its threshold, it turns away an INTERACTIVE request that would queue behind a backlog its predicted TTFT says
it would miss its target in (`shed`). The gateway turns on pausing and shedding by default (`--slo-pause-batch`,
`--slo-shed-over 0.8`) and holding arrivals only when asked; this config's defaults are all off (a link that only
reports).

The predictor is advice, never a dependency: a report that fails is retried with the next one (a
bounded backlog), a forecast that is missing, stale or untrained sheds nothing, and a predictor
whose trees this gateway cannot use (another build's features) is asked per request instead,
within a budget of a few ms, past which the load heuristic decides; after a failure it is not
asked again for a few seconds. No request fails because it is down, slow or untrained (shedding needs its trees:
without them nothing is turned away).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import grpc

from cotserve.common.errors import ResourceExhausted
from cotserve.common.latency import LATENCY_FEATURES, TTFT_TARGET, TreeEnsemble, latency_row, predicted_ttft_ms
from cotserve.common.tls import aio_channel
from cotserve.common.tracing import RECONNECT_OPTIONS

from cotserve.common.sampling import SLA_PB, SlaClass
from cotserve.common.sla import sla_targets
from cotserve.common.stats import percentile
from cotserve.common.v1 import common_pb2
from cotserve.common.windows import worker_total
from cotserve.slo.v1 import slo_pb2, slo_pb2_grpc
from cotserve.worker.v1 import worker_pb2

log = logging.getLogger("cotserve.gateway")

PB_CLASS = SLA_PB
DEFAULT_TOKENS_PER_BYTE = 0.25  # prompt tokens per prompt byte before a model's requests have told (English text)


def queued(worker) -> int:
    """Requests of every class waiting in this gateway's admission queues for `worker`."""
    return sum(len(q) for q in worker.admission.queues.values())


def seat_wait_tokens(worker, sla: SlaClass) -> float:
    """Decode tokens left before a batch seat frees on `worker` for a new request of `sla`: the seat line is this
    gateway's requests there of classes at least as urgent (the worker gives a less urgent one's seat to a more urgent
    arrival); when it fills the worker's seats with k to spare counting the new request, the new one waits for the
    k-th of them to finish, and this is that one's tokens left to its max_new_tokens, fewest first among those with a
    first token (a running request's length is known in advance up to an early stop). A request holds a seat for
    each of its samples (counted as finishing together); the new one is counted as one. 0 with a seat free or the
    seats unknown.

    At medium load a request either finds a seat (tens of ms) or waits on the decodes of those holding them (a
    second), and no count of requests tells which. Two 300 s recordings of bench slo's load (seeds 0, 2) with this
    gateway, the latency model fit on the first 70%: held-out TTFT MAPE with the column blanked and not 30.4 -> 25.6%
    and 33.5 -> 26.3% (medium load 45.1 -> 33.1%, 53.5 -> 36.1%)."""
    seats = worker.seats
    if not seats or not worker.attempts:
        return 0.0
    line = [a for a in worker.attempts if a.sla <= sla]
    k = sum(a.samples for a in line) + 1 - seats
    if k <= 0:
        return 0.0
    left = sorted(max(a.max_new_tokens - a.received, 0) for a in line if a.first_at is not None for _ in range(a.samples))
    return float(left[min(k, len(left)) - 1]) if left else 0.0


def counts_now(worker, sla: SlaClass) -> slo_pb2.MetricsWindow:
    """What this gateway counts on `worker` now for a new request of `sla`, in the fields a latency prediction's
    candidate carries them: its requests in flight and queued there, the queue ahead of `sla`, and the requests sent
    without a first token yet with their prompt tokens. The one place both the routing rows and the request
    observations the latency model learns from take them, so the two cannot drift apart. With them, how long the
    oldest of those has waited and how long the worker has been silent (nothing read from it while this gateway has
    requests there): a worker stalled by a long step, another client's load or a starved process shows in these
    before any window or Stats poll reports it. And the decode tokens before a seat frees for it (`seat_wait_tokens`)."""
    now = time.monotonic()
    oldest = next(iter(worker.waiting_since.values()), None)
    return slo_pb2.MetricsWindow(in_flight=worker.in_flight, queue_depth=queued(worker),
                                 queued_ahead=worker.admission.queued_ahead(sla),
                                 waiting_for_first_token=worker.waiting_for_first_token,
                                 prefill_tokens_ahead=worker.prefill_tokens_ahead,
                                 oldest_wait_ms=(now - oldest) * 1000 if oldest is not None else 0.0,
                                 silent_ms=(now - worker.last_heard) * 1000 if worker.in_flight else 0.0,
                                 seat_wait_tokens=seat_wait_tokens(worker, sla))


@dataclass(slots=True)
class _Acc:
    arrivals: int = 0
    completions: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0


def finds_a_seat(w) -> bool:
    """Whether a request sent to worker handle `w` now would start at once: its last poll had nothing waiting, and this
    gateway's requests on it do not fill its seats (`max_num_seqs`). Routing orders by predicted TTFT only among the
    workers where it would (then among the rest): without it, predictions sent a quarter-seated worker more requests
    (`bench slo-routing --slowed max-seqs`: p90 TTFT 131% worse than least loaded; with it, 15% better), we read
    because trees trained under least-loaded routing, which keeps requests off a worker with a queue, never saw one."""
    if w.stats is not None and w.stats.num_waiting_seqs > 0:
        return False
    seats = w.seats
    return not seats or w.in_flight < seats


def deferred_share(p: float, threshold: float, throttle_from: float) -> float:
    """The share of BATCH arrivals to defer at urgent-class forecast `p`: none up to `throttle_from` x threshold,
    every one from the threshold on, in proportion between. Deferring part of BATCH as the risk rises, rather than
    all of it once it is high, keeps the engine from swinging between a full BATCH load and none."""
    start = throttle_from * threshold
    if p >= threshold:
        return 1.0
    if p <= start:
        return 0.0
    return (p - start) / (threshold - start)


@dataclass
class SloLinkConfig:
    address: str
    admission: bool = False         # hold BATCH as an urgent class's forecast nears and passes the threshold (opt-in)
    routing: bool = True            # route by predicted TTFT
    predict_budget_ms: float = 5.0
    report_interval_s: float = 1.0
    forecast_interval_s: float = 1.0
    backoff_s: float = 5.0
    model_refresh_s: float = 5.0    # how often the trained TTFT model is fetched (only its version, while unchanged)
    max_backlog: int = 600
    retry_after_ms: int = 10_000  # retry-after-ms (+-50%) of BATCH turned away because `max_held` already wait
    throttle_from: float = 1.0    # forecast / threshold where holding starts (1: all BATCH above the threshold, none below)
    max_hold_ms: int = 30_000     # a held BATCH request goes after this long whatever the forecast (BATCH's TTFT target)
    max_held: int = 1024          # BATCH requests held at once; more are turned away (RESOURCE_EXHAUSTED, retry-after-ms)
    urgent_idle_s: float = 2.0    # no REALTIME or INTERACTIVE request of the model in flight or started for this long:
    # nothing to protect, so nothing is held, whatever the forecast (its features look back a minute, so it stays high
    # for a while after a burst of urgent traffic has gone)
    pause_batch: bool = False     # pause the model's running BATCH on its workers while the forecast is over the threshold
    max_pause_ms: int = 5_000     # longest pause in one go; then at least half as long unpaused
    shed_over: float = 0.0        # turn away INTERACTIVE that would queue, predicted (TTFT p90) over this x its target
    targets: dict = field(default_factory=sla_targets)  # each class's SLA targets (the gateway's --sla-target)
    credentials: Any = None  # grpc.ChannelCredentials for an SLO predictor that speaks TLS (None: plaintext)


class SloLink:
    def __init__(self, cfg: SloLinkConfig, pool) -> None:
        self.cfg, self.pool = cfg, pool
        self.channel = aio_channel(cfg.address, cfg.credentials, options=RECONNECT_OPTIONS)
        self.stub = slo_pb2_grpc.SloServiceStub(self.channel)
        self.acc: dict[tuple[str, str, SlaClass], _Acc] = defaultdict(_Acc)
        self.in_flight: dict[tuple[str, str, SlaClass], int] = defaultdict(int)
        self.requests: list[slo_pb2.RequestObservation] = []
        self.backlog: deque[slo_pb2.ReportWindowsRequest] = deque()
        self.last_worker_window: dict[str, slo_pb2.MetricsWindow] = {}
        self.preemptions_seen: dict[str, int] = {}
        self.forecasts: dict[str, tuple[float, float, str]] = {}  # model -> (max urgent probability, threshold, when)
        self.tokens_per_byte: dict[str, float] = {}
        self.down_until = 0.0
        self.latency_trained = False
        self.ttft_model: TreeEnsemble | None = None  # the predictor's TTFT p90 trees, evaluated here (GetLatencyModel)
        self.ttft_model_version = 0
        self.reports_failed = 0
        self._tasks: list[asyncio.Task] = []
        self._last_warning = 0.0
        self._rng = random.Random()
        self.held = 0  # BATCH requests held now (hold_batch)
        self.urgent_seen: dict[str, float] = {}  # model -> when a REALTIME or INTERACTIVE request of it last started or ended
        self._refreshed = asyncio.Event()  # set, then replaced, at every forecast refresh: held requests draw again
        self.pausing_since: dict[str, float] = {}  # model -> when its BATCH pause began (steer_pauses)
        self.pause_rest_until: dict[str, float] = {}  # model -> no pause before this (after one of max_pause_ms)
        self.pauses_asked = 0  # PauseBatch calls that started or renewed a pause and succeeded
        self.pause_failures = 0
        self.shed_total = 0  # INTERACTIVE requests turned away on their predicted TTFT (`shed`)

    # -- recording (called by the servicer) ----------------------------------------------

    def arrival(self, model: str, worker: str, sla: SlaClass) -> None:
        self.acc[(model, worker, sla)].arrivals += 1
        self.in_flight[(model, worker, sla)] += 1
        if sla != SlaClass.BATCH:
            self.urgent_seen[model] = time.monotonic()

    def first_token(self, model: str, worker: str, sla: SlaClass, ttft_ms: float) -> None:
        a = self.acc[(model, worker, sla)]
        a.ttft.append(ttft_ms)
        a.tokens += 1

    def token(self, model: str, worker: str, sla: SlaClass, itl_ms: float) -> None:
        a = self.acc[(model, worker, sla)]
        a.itl.append(itl_ms)
        a.tokens += 1

    def done(self, model: str, worker: str, sla: SlaClass) -> None:
        self.in_flight[(model, worker, sla)] -= 1
        if sla != SlaClass.BATCH:
            self.urgent_seen[model] = time.monotonic()

    def urgent_idle(self, model: str) -> bool:
        """No REALTIME or INTERACTIVE request of `model` in flight here, nor one started or ended in the last
        `urgent_idle_s`."""
        if any(n for (m, _, sla), n in self.in_flight.items() if m == model and sla != SlaClass.BATCH):
            return False
        return time.monotonic() - self.urgent_seen.get(model, -math.inf) >= self.cfg.urgent_idle_s

    def tokens_per_byte_of(self, model: str) -> float:
        """Prompt tokens per prompt byte of `model`, as its finished requests have shown (a moving average)."""
        return self.tokens_per_byte.get(model, DEFAULT_TOKENS_PER_BYTE)

    def finished(self, model: str, worker: str, sla: SlaClass, start_unix_ms: int, prompt_text_bytes: int, prompt_tokens: int,
                 max_new_tokens: int, completion_tokens: int, ttft_ms: float, tpot_ms: float,
                 at_start: slo_pb2.MetricsWindow) -> None:
        """A request finished; `at_start` is `counts_now` when its worker was chosen."""
        a = self.acc[(model, worker, sla)]
        a.completions += 1
        a.prompt_tokens += prompt_tokens
        if prompt_text_bytes:
            old = self.tokens_per_byte.get(model, prompt_tokens / prompt_text_bytes)
            self.tokens_per_byte[model] = 0.9 * old + 0.1 * prompt_tokens / prompt_text_bytes
        self.requests.append(slo_pb2.RequestObservation(
            start_unix_ms=start_unix_ms, model=model, worker=worker, sla_class=PB_CLASS[sla], prompt_tokens=prompt_tokens,
            max_new_tokens=max_new_tokens, completion_tokens=completion_tokens, ttft_ms=ttft_ms, tpot_ms=tpot_ms,
            in_flight_at_start=at_start.in_flight, queued_at_start=at_start.queue_depth,
            waiting_for_first_token_at_start=at_start.waiting_for_first_token,
            prefill_tokens_ahead_at_start=at_start.prefill_tokens_ahead, queued_ahead_at_start=at_start.queued_ahead,
            oldest_wait_ms_at_start=at_start.oldest_wait_ms, silent_ms_at_start=at_start.silent_ms,
            seat_wait_tokens_at_start=at_start.seat_wait_tokens))

    def roll(self, start_unix_ms: int) -> list[slo_pb2.MetricsWindow]:
        """Close the second that began at `start_unix_ms`: one window per (model, healthy worker, class)."""
        acc, self.acc = self.acc, defaultdict(_Acc)
        windows = []
        for w in self.pool.workers:
            if not w.healthy or w.model is None:
                continue
            s = w.stats
            total_blocks = (s.kv_blocks_used + s.kv_blocks_free) if s else 0
            pre_total = s.num_preemptions_total if s else 0
            preemptions = max(0, pre_total - self.preemptions_seen.get(w.address, pre_total))
            self.preemptions_seen[w.address] = pre_total
            per_class = []
            for cls in SlaClass:
                a = acc.get((w.model, w.address, cls), _Acc())
                waiting_here = len(w.admission.queues.get(cls, ()))
                per_class.append(slo_pb2.MetricsWindow(
                    start_unix_ms=start_unix_ms, model=w.model, worker=w.address, sla_class=PB_CLASS[cls],
                    arrivals=a.arrivals, completions=a.completions, first_tokens=len(a.ttft),
                    ttft_p50_ms=percentile(a.ttft, 50, empty=0.0), ttft_p95_ms=percentile(a.ttft, 95, empty=0.0), ttft_p99_ms=percentile(a.ttft, 99, empty=0.0),
                    itl_p50_ms=percentile(a.itl, 50, empty=0.0), itl_p95_ms=percentile(a.itl, 95, empty=0.0),
                    itl_p99_ms=percentile(a.itl, 99, empty=0.0),
                    queue_depth=waiting_here, in_flight=max(0, self.in_flight[(w.model, w.address, cls)]),
                    kv_used_fraction=(s.kv_blocks_used / total_blocks) if total_blocks else 0.0,
                    preemptions=preemptions, output_tokens_per_s=float(a.tokens),
                    utilization=min(1.0, s.utilization) if s else 0.0, utilization_is_cpu=s.utilization_is_cpu if s else True,
                    memory_used_bytes=s.memory_used_bytes if s else 0,
                    mean_prompt_tokens=a.prompt_tokens / a.completions if a.completions else 0.0,
                    worker_waiting=s.num_waiting_seqs if s else 0,
                    worker_running=s.num_running_seqs if s else 0, worker_step_ms=s.step_latency_p50_ms if s else 0.0,
                    worker_tokens_per_s=s.generated_tokens_per_s if s else 0.0,
                    worker_max_num_seqs=w.seats,
                ))
            windows.extend(per_class)
            self.last_worker_window[w.address] = worker_total(per_class, w.address, start_unix_ms)
        return windows

    # -- background loops ----------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._report_forever(), name="cotserve-slo-report"),
                       asyncio.create_task(self._forecast_forever(), name="cotserve-slo-forecast")]
        if self.cfg.routing or self.cfg.shed_over:
            self._tasks.append(asyncio.create_task(self._fetch_model_forever(), name="cotserve-slo-latency-model"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.channel.close()

    def _warn(self, message: str) -> None:
        if time.monotonic() - self._last_warning > 60:
            self._last_warning = time.monotonic()
            log.warning("%s (the gateway carries on without the SLO predictor)", message)

    async def _report_forever(self) -> None:
        second = int(time.time())
        while True:
            await asyncio.sleep(max(0.0, second + 1 - time.time()))
            windows = self.roll(second * 1000)
            requests, self.requests = self.requests, []
            second += 1
            if windows or requests:
                self.backlog.append(slo_pb2.ReportWindowsRequest(windows=windows, requests=requests))
            while len(self.backlog) > self.cfg.max_backlog:
                self.backlog.popleft()
            try:
                while self.backlog:
                    await self.stub.ReportWindows(self.backlog[0], timeout=1.0)
                    self.backlog.popleft()
            except grpc.aio.AioRpcError as err:
                self.reports_failed += 1
                if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    self.backlog.popleft()  # never resend what the predictor rejects
                self._warn(f"SLO predictor {self.cfg.address}: ReportWindows failed: {err.code().name} {err.details()}")
            second = max(second, int(time.time()))

    async def _forecast_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.forecast_interval_s)
            for model in {w.model for w in self.pool.workers if w.model is not None}:
                try:
                    probs, threshold = [], 1.0
                    for cls in (common_pb2.SLA_CLASS_REALTIME, common_pb2.SLA_CLASS_INTERACTIVE):
                        f = await self.stub.Forecast(slo_pb2.ForecastRequest(model=model, sla_class=cls), timeout=0.5)
                        if f.is_trained:
                            probs.append(f.violation_probability)
                            threshold = f.threshold
                    if probs:
                        self.forecasts[model] = (max(probs), threshold, time.monotonic())
                    else:
                        self.forecasts.pop(model, None)
                except grpc.aio.AioRpcError as err:
                    self.forecasts.pop(model, None)
                    self._warn(f"SLO predictor {self.cfg.address}: Forecast failed: {err.code().name}")
            self.refreshed()
            self.restrain_batch()
            if self.cfg.pause_batch:
                await self.steer_pauses()

    async def _fetch_model_forever(self) -> None:
        while True:
            await self.fetch_model()
            await asyncio.sleep(self.cfg.model_refresh_s)

    async def fetch_model(self) -> None:
        """Take the predictor's TTFT model when it has a new one. Kept on a failed call (the predictor restarting is no
        reason to route worse); dropped when the predictor is untrained or its model's features are not this
        gateway's (another build: `pick` then asks it per request, within the budget)."""
        try:
            resp = await self.stub.GetLatencyModel(slo_pb2.GetLatencyModelRequest(known_version=self.ttft_model_version),
                                                   timeout=10)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                self._warn(f"SLO predictor {self.cfg.address}: GetLatencyModel failed: {err.code().name}")
            return
        if not resp.is_trained or tuple(resp.features) != LATENCY_FEATURES or resp.target != TTFT_TARGET:
            if resp.is_trained:
                self._warn(f"SLO predictor {self.cfg.address}: its latency model has other features or predicts "
                           f"{resp.target or 'milliseconds'} (this gateway's: {TTFT_TARGET})")
            self.ttft_model, self.ttft_model_version = None, 0
            return
        if resp.version == self.ttft_model_version:
            return
        try:
            self.ttft_model, self.ttft_model_version = TreeEnsemble(resp.ttft_model_json), resp.version
        except ValueError as exc:
            self.ttft_model, self.ttft_model_version = None, 0
            self._warn(f"SLO predictor {self.cfg.address}: unusable latency model: {exc}")

    def refreshed(self) -> None:
        """New forecasts are in: every held BATCH request draws again."""
        self._refreshed.set()
        self._refreshed = asyncio.Event()

    # -- decisions -----------------------------------------------------------------------

    def fresh_forecast(self, model: str, now: float) -> tuple[float, float] | None:
        """The model's (forecast, threshold), unless there is none or it is stale (five refreshes missed)."""
        f = self.forecasts.get(model)
        if f is None or now - f[2] > 5 * self.cfg.forecast_interval_s:
            return None
        return f[0], f[1]

    def miss_forecast(self, model: str, now: float) -> bool:
        """Whether the model's fresh forecast is at or over its threshold (an urgent class is forecast to miss)."""
        f = self.fresh_forecast(model, now)
        return f is not None and f[0] >= f[1]

    def defer_share(self, model: str) -> tuple[float, float, float]:
        """(share of BATCH to defer now, forecast, threshold) from the model's fresh forecast; share 0 without one."""
        f = self.fresh_forecast(model, time.monotonic()) if self.cfg.admission else None
        if f is None:
            return 0.0, 0.0, 1.0
        p, threshold = f
        return deferred_share(p, threshold, self.cfg.throttle_from), p, threshold

    def restrain_batch(self) -> None:
        """After each forecast refresh: while a model's BATCH arrivals are being held (a deferred share above 0, urgent
        work not idle), its workers' admission keeps BATCH at its restart ceiling as well (`Admission.restrain_batch`),
        so that what waits in its queue, or leaves the hold, starts at the restart's pace rather than all at once."""
        if not self.cfg.admission:
            return
        for model, workers in self.pool.models().items():
            if self.defer_share(model)[0] > 0 and not self.urgent_idle(model):
                for w in workers:
                    w.admission.restrain_batch()

    def pause_wanted(self, model: str, now: float) -> bool:
        """Whether `model`'s BATCH should be paused now: a fresh forecast at or over the threshold, urgent requests
        not idle, and not resting after a pause of `max_pause_ms` (which then ends for half as long)."""
        want = self.miss_forecast(model, now) and not self.urgent_idle(model) and now >= self.pause_rest_until.get(model, 0.0)
        since = self.pausing_since.get(model)
        if want and since is not None and now - since >= self.cfg.max_pause_ms / 1000:
            self.pause_rest_until[model] = now + self.cfg.max_pause_ms / 2000
            return False
        return want

    async def steer_pauses(self) -> None:
        """After each forecast refresh: pause (or keep paused) the running BATCH work of each model whose urgent
        classes are forecast to miss, on every healthy worker of it, for a lease of three refresh intervals (a
        gateway that stops asking, or dies, leaves no worker paused for long); end a pause as soon as it is no longer
        wanted. Acting on running BATCH, not only on BATCH arrivals (`hold_batch`): requests already decoding keep the
        engine's steps long through a burst however few new ones are let in."""
        now = time.monotonic()
        lease_ms = round(min(3 * self.cfg.forecast_interval_s, 60.0) * 1000)
        for model, workers in self.pool.models().items():
            if self.pause_wanted(model, now):
                self.pausing_since.setdefault(model, now)
                await self._pause(model, workers, lease_ms)
            elif self.pausing_since.pop(model, None) is not None:
                await self._pause(model, workers, 0)

    async def _pause(self, model: str, workers: list, duration_ms: int) -> None:
        async def one(w) -> None:
            try:
                await w.stub.PauseBatch(worker_pb2.PauseBatchRequest(duration_ms=duration_ms), timeout=0.5)
                self.pauses_asked += duration_ms > 0
            except grpc.aio.AioRpcError as err:
                self.pause_failures += 1
                self._warn(f"worker {w.address} ({model}): PauseBatch failed: {err.code().name} {err.details()}")

        await asyncio.gather(*(one(w) for w in workers if w.healthy))

    async def hold_batch(self, model: str, time_remaining_s: float | None) -> tuple[float, str | None]:
        """Hold a BATCH request here while the forecast says defer, rather than turn it away: drawn against the deferred
        share now and again at every forecast refresh, so under a proportional rule the held requests go in a trickle as
        the risk falls (a share s holds each one another second with probability s), and under all-or-nothing they go
        together, their start paced by the workers' restrained BATCH ceiling (`restrain_batch`); no client retries cost
        anything.
        It goes anyway after `max_hold_ms`, or a second before its deadline, or once the model's urgent classes are idle
        (`urgent_idle`: holding would protect nothing, and a forecast stays high for a while after a burst). Returns
        (ms held, why; None when it was not held). Raises ResourceExhausted (retry-after-ms, +-50%) when `max_held`
        requests already wait."""
        start = time.monotonic()
        limit = self.cfg.max_hold_ms / 1000
        if time_remaining_s is not None:
            limit = min(limit, time_remaining_s - 1.0)
        why = None
        while True:
            share, p, threshold = self.defer_share(model)
            waited = time.monotonic() - start
            if share <= 0 or self._rng.random() >= share or waited >= limit or self.urgent_idle(model):
                return waited * 1000, why
            if why is None:
                if self.held >= self.cfg.max_held:
                    raise ResourceExhausted(
                        f"sla_class BATCH: deferred: {self.held} BATCH requests are already held while the SLO predictor "
                        f"forecasts a {p:.2f} chance that REALTIME or INTERACTIVE misses its target; retry later",
                        trailers={"retry-after-ms": str(max(1, round(self.cfg.retry_after_ms * self._rng.uniform(0.5, 1.5))))})
                why = (f"the SLO predictor forecasts a {p:.2f} chance (threshold {threshold:.2f}) that REALTIME or "
                       f"INTERACTIVE misses its target: {100 * share:.0f}% of BATCH held")
            self.held += 1
            try:
                # the next refresh, or (refreshes stopped: the forecast goes stale and holds nothing) a look anyway
                await asyncio.wait_for(self._refreshed.wait(), min(limit - waited, 2 * self.cfg.forecast_interval_s))
            except asyncio.TimeoutError:
                pass
            finally:
                self.held -= 1

    def _state_now(self, w, sla: SlaClass) -> slo_pb2.MetricsWindow:
        """Worker `w`'s last window with what this gateway counts now for a request of `sla`, as the latency model
        learned them."""
        window = slo_pb2.MetricsWindow()
        if w.address in self.last_worker_window:
            window.CopyFrom(self.last_worker_window[w.address])
        now = counts_now(w, sla)  # assigned field by field: MergeFrom would keep the window's count where now's is 0
        window.in_flight, window.queue_depth, window.queued_ahead = now.in_flight, now.queue_depth, now.queued_ahead
        window.waiting_for_first_token, window.prefill_tokens_ahead = now.waiting_for_first_token, now.prefill_tokens_ahead
        window.oldest_wait_ms, window.silent_ms = now.oldest_wait_ms, now.silent_ms
        window.seat_wait_tokens = now.seat_wait_tokens
        return window

    def prompt_tokens_of(self, model: str, prompt_bytes: int) -> int:
        """A prompt's tokens as this gateway guesses them before any worker tokenizes it (the model's bytes per token)."""
        return max(1, round(prompt_bytes * self.tokens_per_byte_of(model)))

    def shed(self, model: str, worker, sla: SlaClass, prompt_bytes: int, max_new_tokens: int) -> None:
        """Turn away (ResourceExhausted) an INTERACTIVE request that would queue in this gateway for `worker` and whose
        TTFT p90 there, by the fetched trees, is over `shed_over` x the class's TTFT target. Under an overload of its
        own class a request that joins the backlog misses, and so does every one behind it until the backlog drains;
        turned away, it leaves the backlog short enough for those after it (and its client free to go elsewhere).
        Only a request that would queue: one that starts now waits on the worker's steps alone, and the predictions
        over the line at light load were its outliers (a gateway's first second, a long prompt); REALTIME never
        queues here (the worker seats it first), BATCH is held instead (`hold_batch`). And only while the model's
        forecast is at or over its threshold: a p90 is over the line for some requests at any load, and without the
        forecast's say a load the stack served in full lost requests to shedding (`bench slo --quick --burst 1.3`:
        off and the replay without BATCH missed none, shedding turned away 1.5%). Nothing is turned away without
        trees or a fresh forecast, with `shed_over` 0, or with the gateway's admission off (nothing queues here
        then). The retry-after is the predicted p90 itself: about when a backlog that long has drained."""
        if (not self.cfg.shed_over or sla != SlaClass.INTERACTIVE or self.ttft_model is None
                or worker.admission.starts_now(sla)):
            return
        if not self.miss_forecast(model, time.monotonic()):
            return
        target_ms = self.cfg.targets[sla].ttft_ms
        row = latency_row(self.prompt_tokens_of(model, prompt_bytes), max_new_tokens, PB_CLASS[sla], self._state_now(worker, sla))
        p90_ms = predicted_ttft_ms(self.ttft_model, row)
        if p90_ms > self.cfg.shed_over * target_ms:
            self.shed_total += 1
            raise ResourceExhausted(
                f"sla_class {sla.name}: shed: the SLO predictor puts this request's TTFT p90 on worker {worker.address} "
                f"at {p90_ms:.0f} ms, over {self.cfg.shed_over:g} x the class's {target_ms:.0f} ms target; retry later "
                "or elsewhere", trailers={"retry-after-ms": str(max(1, round(p90_ms)))})

    async def pick(self, model: str, candidates: list, sla: SlaClass, prompt_bytes: int, max_new_tokens: int):
        """The candidate with the lowest predicted TTFT, or None (fall back to the heuristic). Predicted here by the
        fetched trees (`fetch_model`); without them, by asking the predictor within the budget."""
        if not self.cfg.routing or len(candidates) < 2:
            return None  # off, or nothing to choose
        prompt_tokens = self.prompt_tokens_of(model, prompt_bytes)
        if self.ttft_model is not None:
            rows = [latency_row(prompt_tokens, max_new_tokens, PB_CLASS[sla], self._state_now(w, sla)) for w in candidates]
            ttft = [predicted_ttft_ms(self.ttft_model, row) for row in rows]
        else:
            ttft = await self._ask(candidates, sla, prompt_tokens, max_new_tokens)
            if ttft is None:
                return None
        return min(zip(candidates, ttft), key=lambda cp: (not cp[0].admission.can_start(sla), not finds_a_seat(cp[0]), cp[1]))[0]

    async def _ask(self, candidates: list, sla: SlaClass, prompt_tokens: int, max_new_tokens: int) -> list[float] | None:
        """Each candidate's predicted TTFT p90 from `PredictLatency`, within the budget; None (and a back-off after a
        failure or an untrained answer) when there is none."""
        if time.monotonic() < self.down_until:
            return None  # backing off after a failure / an untrained answer
        states = [slo_pb2.WorkerState(worker=w.address, window=self._state_now(w, sla)) for w in candidates]
        req = slo_pb2.PredictLatencyRequest(prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
                                            sla_class=PB_CLASS[sla], candidates=states)
        try:
            resp = await self.stub.PredictLatency(req, timeout=self.cfg.predict_budget_ms / 1000)
        except grpc.aio.AioRpcError as err:
            self.down_until = time.monotonic() + self.cfg.backoff_s
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                self._warn(f"SLO predictor {self.cfg.address}: PredictLatency failed: {err.code().name}")
            return None
        self.latency_trained = resp.is_trained
        if not resp.is_trained:
            self.down_until = time.monotonic() + 2 * self.cfg.backoff_s  # it will not learn within a request's time
            return None
        if len(resp.predictions) != len(candidates):
            return None
        return [p.ttft_p90_ms or p.ttft_ms for p in resp.predictions]
