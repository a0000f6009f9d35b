"""The gateway's link to the SLO predictor: a client the gateway's routing and admission rules ask.

It reports what the gateway sees (`slo_report.WindowRecorder`: a metrics window per second per model, worker and
class, and every finished request), keeps each model's latest forecast (refreshed every `forecast_interval_s`, after
which `on_refresh` listeners run: the BATCH hold and pauses of `slo_rules.py`), fetches the predictor's trained
trees of TTFT's 90th percentile when they change and evaluates them here for a candidate worker (`predict_ttft_p90`,
cotserve.common.latency: no call per request), and, with `routing`, picks among a model's workers by that prediction
(`pick`; least loaded otherwise).

The predictor is advice, never a dependency: a report that fails is retried with the next one (a bounded backlog), a
forecast that is missing, stale or untrained acts on nothing, and a predictor whose trees this gateway cannot use
(another build's features) is asked per request instead, within a budget of a few ms, past which the load heuristic
decides; after a failure it is not asked again for a few seconds. No request fails because it is down, slow or
untrained.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import grpc

from cotserve.common.latency import LATENCY_FEATURES, TTFT_TARGET, TreeEnsemble, latency_row, predicted_ttft_ms
from cotserve.common.sampling import SlaClass
from cotserve.common.tls import aio_channel
from cotserve.common.tracing import RECONNECT_OPTIONS
from cotserve.common.v1 import common_pb2
from cotserve.gateway.slo_report import PB_CLASS, WindowRecorder
from cotserve.gateway.slo_settings import SloSettings
from cotserve.slo.v1 import slo_pb2, slo_pb2_grpc

log = logging.getLogger("cotserve.gateway")


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
    second), and no count of requests tells which: this column does (`cotserve bench slo` reports the latency model's
    held-out error)."""
    seats = worker.seats
    if not seats or not worker.attempts:
        return 0.0
    line = [a for a in worker.attempts if a.sla <= sla]
    k = sum(a.samples for a in line) + 1 - seats
    if k <= 0:
        return 0.0
    left = sorted(max(a.max_new_tokens - a.received, 0) for a in line if a.first_at is not None for _ in range(a.samples))
    return float(left[min(k, len(left)) - 1]) if left else 0.0


def counts_now(worker, sla: SlaClass) -> common_pb2.MetricsWindow:
    """What this gateway counts on `worker` now for a new request of `sla`, in the fields a latency prediction's
    candidate carries them: its requests in flight and queued there, the queue ahead of `sla`, and the requests sent
    without a first token yet with their prompt tokens. The one place both the routing rows and the request
    observations the latency model learns from take them, so the two cannot drift apart. With them, how long the
    oldest of those has waited and how long the worker has been silent (nothing read from it while this gateway has
    requests there): a worker stalled by a long step, another client's load or a starved process shows in these
    before any window or Stats poll reports it. And the decode tokens before a seat frees for it (`seat_wait_tokens`)."""
    now = time.monotonic()
    oldest = next(iter(worker.waiting_since.values()), None)
    return common_pb2.MetricsWindow(in_flight=worker.in_flight, queue_depth=queued(worker),
                                 queued_ahead=worker.admission.queued_ahead(sla),
                                 waiting_for_first_token=worker.waiting_for_first_token,
                                 prefill_tokens_ahead=worker.prefill_tokens_ahead,
                                 oldest_wait_ms=(now - oldest) * 1000 if oldest is not None else 0.0,
                                 silent_ms=(now - worker.last_heard) * 1000 if worker.in_flight else 0.0,
                                 seat_wait_tokens=seat_wait_tokens(worker, sla))


def finds_a_seat(w) -> bool:
    """Whether a request sent to worker handle `w` now would start at once: its last poll had nothing waiting, and this
    gateway's requests on it do not fill its seats (`max_num_seqs`). Routing orders by predicted TTFT only among the
    workers where it would (then among the rest): trees trained under least-loaded routing, which keeps requests off a
    worker with a queue, never saw one, and would send a worker short of seats more requests than it can start
    (`cotserve bench slo-routing --slowed max-seqs` measures it)."""
    if w.stats is not None and w.stats.num_waiting_seqs > 0:
        return False
    seats = w.seats
    return not seats or w.in_flight < seats


class SloLink:
    """One gateway's client of the SLO predictor at `settings.address` (see the module docstring)."""

    def __init__(self, settings: SloSettings, pool, credentials: Any = None) -> None:
        self.settings, self.pool = settings, pool
        self.channel = aio_channel(settings.address, credentials, options=RECONNECT_OPTIONS)
        self.stub = slo_pb2_grpc.SloServiceStub(self.channel)
        self.recorder = WindowRecorder(settings, pool, self.stub, self.warn)
        self.forecasts: dict[str, tuple[float, float, float]] = {}  # model -> (max urgent probability, threshold, when)
        self.on_refresh: list[Callable[[], Awaitable[None]]] = []  # run in order after every forecast refresh
        self.down_until = 0.0
        self.latency_trained = False
        self.ttft_model: TreeEnsemble | None = None  # the predictor's TTFT p90 trees, evaluated here (GetLatencyModel)
        self.ttft_model_version = 0
        self._tasks: list[asyncio.Task] = []
        self._last_warning = 0.0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.recorder.report_forever(), name="cotserve-slo-report"),
                       asyncio.create_task(self._forecast_forever(), name="cotserve-slo-forecast")]
        if self.settings.routing or self.settings.shed_over:
            self._tasks.append(asyncio.create_task(self._fetch_model_forever(), name="cotserve-slo-latency-model"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.channel.close()

    def warn(self, message: str) -> None:
        """Log a failure of the predictor at most once a minute."""
        if time.monotonic() - self._last_warning > 60:
            self._last_warning = time.monotonic()
            log.warning("%s (the gateway carries on without the SLO predictor)", message)

    async def _forecast_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.forecast_interval_s)
            await self.refresh_forecasts()
            for listener in tuple(self.on_refresh):
                await listener()

    async def refresh_forecasts(self) -> None:
        """Each model's forecast: the higher of REALTIME's and INTERACTIVE's miss probabilities, with its threshold;
        none for a model whose predictor is untrained or does not answer."""
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
                self.warn(f"SLO predictor {self.settings.address}: Forecast failed: {err.code().name}")

    async def _fetch_model_forever(self) -> None:
        while True:
            await self.fetch_model()
            await asyncio.sleep(self.settings.model_refresh_s)

    async def fetch_model(self) -> None:
        """Take the predictor's TTFT model when it has a new one. Kept on a failed call (the predictor restarting is no
        reason to route worse); dropped when the predictor is untrained or its model's features are not this
        gateway's (another build: `pick` then asks it per request, within the budget)."""
        try:
            resp = await self.stub.GetLatencyModel(slo_pb2.GetLatencyModelRequest(known_version=self.ttft_model_version),
                                                   timeout=10)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                self.warn(f"SLO predictor {self.settings.address}: GetLatencyModel failed: {err.code().name}")
            return
        if not resp.is_trained or tuple(resp.features) != LATENCY_FEATURES or resp.target != TTFT_TARGET:
            if resp.is_trained:
                self.warn(f"SLO predictor {self.settings.address}: its latency model has other features or predicts "
                           f"{resp.target or 'milliseconds'} (this gateway's: {TTFT_TARGET})")
            self.ttft_model, self.ttft_model_version = None, 0
            return
        if resp.version == self.ttft_model_version:
            return
        try:
            self.ttft_model, self.ttft_model_version = TreeEnsemble(resp.ttft_model_json), resp.version
        except ValueError as exc:
            self.ttft_model, self.ttft_model_version = None, 0
            self.warn(f"SLO predictor {self.settings.address}: unusable latency model: {exc}")

    # -- what the rules ask ----------------------------------------------------------------------------
    def fresh_forecast(self, model: str, now: float) -> tuple[float, float] | None:
        """The model's (forecast, threshold), unless there is none or it is stale (five refreshes missed)."""
        f = self.forecasts.get(model)
        if f is None or now - f[2] > 5 * self.settings.forecast_interval_s:
            return None
        return f[0], f[1]

    def miss_forecast(self, model: str, now: float) -> bool:
        """Whether the model's fresh forecast is at or over its threshold (an urgent class is forecast to miss)."""
        f = self.fresh_forecast(model, now)
        return f is not None and f[0] >= f[1]

    def state_now(self, w, sla: SlaClass) -> common_pb2.MetricsWindow:
        """Worker `w`'s last window with what this gateway counts now for a request of `sla`, as the latency model
        learned them."""
        window = common_pb2.MetricsWindow()
        if w.address in self.recorder.last_worker_window:
            window.CopyFrom(self.recorder.last_worker_window[w.address])
        now = counts_now(w, sla)  # assigned field by field: MergeFrom would keep the window's count where now's is 0
        window.in_flight, window.queue_depth, window.queued_ahead = now.in_flight, now.queue_depth, now.queued_ahead
        window.waiting_for_first_token, window.prefill_tokens_ahead = now.waiting_for_first_token, now.prefill_tokens_ahead
        window.oldest_wait_ms, window.silent_ms = now.oldest_wait_ms, now.silent_ms
        window.seat_wait_tokens = now.seat_wait_tokens
        return window

    def prompt_tokens_of(self, model: str, prompt_bytes: int) -> int:
        """A prompt's tokens as this gateway guesses them before any worker tokenizes it (the model's bytes per token)."""
        return max(1, round(prompt_bytes * self.recorder.tokens_per_byte_of(model)))

    def predict_ttft_p90(self, model: str, worker, sla: SlaClass, prompt_bytes: int, max_new_tokens: int) -> float | None:
        """The request's TTFT p90 on `worker` by the fetched trees, in ms; None without them."""
        if self.ttft_model is None:
            return None
        row = latency_row(self.prompt_tokens_of(model, prompt_bytes), max_new_tokens, PB_CLASS[sla],
                          self.state_now(worker, sla))
        return predicted_ttft_ms(self.ttft_model, row)

    async def pick(self, model: str, candidates: list, sla: SlaClass, prompt_bytes: int, max_new_tokens: int):
        """The candidate with the lowest predicted TTFT, or None (fall back to the heuristic). Predicted here by the
        fetched trees (`fetch_model`); without them, by asking the predictor within the budget."""
        if not self.settings.routing or len(candidates) < 2:
            return None  # off, or nothing to choose
        prompt_tokens = self.prompt_tokens_of(model, prompt_bytes)
        if self.ttft_model is not None:
            rows = [latency_row(prompt_tokens, max_new_tokens, PB_CLASS[sla], self.state_now(w, sla)) for w in candidates]
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
        states = [slo_pb2.WorkerState(worker=w.address, window=self.state_now(w, sla)) for w in candidates]
        req = slo_pb2.PredictLatencyRequest(prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
                                            sla_class=PB_CLASS[sla], candidates=states)
        try:
            resp = await self.stub.PredictLatency(req, timeout=self.settings.predict_budget_ms / 1000)
        except grpc.aio.AioRpcError as err:
            self.down_until = time.monotonic() + self.settings.backoff_s
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                self.warn(f"SLO predictor {self.settings.address}: PredictLatency failed: {err.code().name}")
            return None
        self.latency_trained = resp.is_trained
        if not resp.is_trained:
            self.down_until = time.monotonic() + 2 * self.settings.backoff_s  # it will not learn within a request's time
            return None
        if len(resp.predictions) != len(candidates):
            return None
        return [p.ttft_p90_ms or p.ttft_ms for p in resp.predictions]
