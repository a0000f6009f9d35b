"""The admission rules that act on the SLO predictor's forecasts (`slo_link.SloLink` answers them), and the pauses it
steers: what the gateway does for REALTIME and INTERACTIVE when the predictor says they are about to miss.

- `BatchHold` (with `--slo-admission`): BATCH arrivals wait here while the forecast says defer, drawn again at every
  refresh, and the workers' admission keeps BATCH at its restart ceiling meanwhile.
- `InteractiveShed` (`--slo-shed-over`): an INTERACTIVE request that would queue behind a backlog its predicted TTFT
  says it would miss its target in is turned away at once.
- `BatchPauses` (`--slo-pause-batch`): running BATCH work on the model's workers sits out the engine steps that have
  urgent work, a few seconds at a time.

Without a fresh, trained forecast at or over its threshold, none of them does anything.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc

from cotserve.common.errors import ResourceExhausted
from cotserve.common.sampling import SlaClass
from cotserve.common.sla import SlaTarget
from cotserve.gateway.metrics import GatewayMetrics
from cotserve.gateway.rules import ADMIT, Refuse, RequestContext, Stage, Verdict, Wait
from cotserve.gateway.slo_link import SloLink
from cotserve.worker.v1 import worker_pb2


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


class BatchHold:
    """Hold a BATCH request here while the forecast says defer, rather than turn it away: drawn against the deferred
    share now and again at every forecast refresh, so under a proportional rule the held requests go in a trickle as
    the risk falls (a share s holds each one another refresh with probability s), and under all-or-nothing they go
    together, their start paced by the workers' restrained BATCH ceiling (`on_refresh`); no client retries cost
    anything. A request goes anyway after `max_hold_ms`, or a second before its deadline, or once the model's urgent
    classes are idle (holding would protect nothing, and a forecast stays high for a while after a burst). When
    `max_held` requests already wait, one more is turned away (RESOURCE_EXHAUSTED, retry-after-ms +-50%)."""

    stage = Stage.REQUEST

    def __init__(self, link: SloLink, metrics: GatewayMetrics, rng: random.Random | None = None) -> None:
        self.link, self.settings, self.metrics = link, link.settings, metrics
        self.rng = rng or random.Random()
        self.held = 0  # BATCH requests held now
        self._refreshed = asyncio.Event()  # set, then replaced, at every forecast refresh: held requests draw again
        link.on_refresh.append(self.on_refresh)

    def defer_share(self, model: str) -> tuple[float, float, float]:
        """(share of BATCH to defer now, forecast, threshold) from the model's fresh forecast; share 0 without one."""
        f = self.link.fresh_forecast(model, time.monotonic()) if self.settings.admission else None
        if f is None:
            return 0.0, 0.0, 1.0
        p, threshold = f
        return deferred_share(p, threshold, self.settings.throttle_from), p, threshold

    async def on_refresh(self) -> None:
        """New forecasts: held requests draw again; while a model's BATCH arrivals are being held, its workers'
        admission keeps BATCH at its restart ceiling as well (`Admission.restrain_batch`), so that what waits in its
        queue, or leaves the hold, starts at the restart's pace rather than all at once."""
        self._refreshed.set()
        self._refreshed = asyncio.Event()
        if not self.settings.admission:
            return
        for model, workers in self.link.pool.models().items():
            if self.defer_share(model)[0] > 0 and not self.link.recorder.urgent_idle(model):
                for w in workers:
                    w.admission.restrain_batch()

    async def check(self, ctx: RequestContext) -> Verdict:
        if ctx.sla != SlaClass.BATCH:
            return ADMIT
        hold = ctx.state.get("hold")
        if hold is None:
            limit, remaining = self.settings.max_hold_ms / 1000, ctx.time_remaining()
            hold = ctx.state["hold"] = {"start": time.monotonic(), "why": None,
                                        "limit": limit if remaining is None else min(limit, remaining - 1.0)}
        limit = hold["limit"]
        share, p, threshold = self.defer_share(ctx.model)
        waited = time.monotonic() - hold["start"]
        if share <= 0 or self.rng.random() >= share or waited >= limit or self.link.recorder.urgent_idle(ctx.model):
            ctx.held_ms = waited * 1000
            if hold["why"] is not None:
                ctx.span.add_event("held", {"cotserve.reason": hold["why"], "cotserve.held_ms": ctx.held_ms})
                self.metrics.batch_held.labels(ctx.model).observe(waited)
            return ADMIT
        if hold["why"] is None:
            if self.held >= self.settings.max_held:
                retry_ms = max(1, round(self.settings.retry_after_ms * self.rng.uniform(0.5, 1.5)))
                return Refuse(ResourceExhausted(
                    f"sla_class BATCH: deferred: {self.held} BATCH requests are already held while the SLO predictor "
                    f"forecasts a {p:.2f} chance that REALTIME or INTERACTIVE misses its target; retry later",
                    trailers={"retry-after-ms": str(retry_ms)}))
            hold["why"] = (f"the SLO predictor forecasts a {p:.2f} chance (threshold {threshold:.2f}) that REALTIME or "
                           f"INTERACTIVE misses its target: {100 * share:.0f}% of BATCH held")
        return Wait(self._until_refresh(min(limit - waited, 2 * self.settings.forecast_interval_s)))

    async def _until_refresh(self, timeout_s: float) -> None:
        """The next refresh, or (refreshes stopped: the forecast goes stale and holds nothing) a look anyway."""
        self.held += 1
        try:
            await asyncio.wait_for(self._refreshed.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass
        finally:
            self.held -= 1


class InteractiveShed:
    """Turn away (RESOURCE_EXHAUSTED) an INTERACTIVE request that would queue in this gateway for the picked worker and
    whose TTFT p90 there, by the fetched trees, is over `shed_over` x the class's TTFT target. Under an overload of its
    own class a request that joins the backlog misses, and so does every one behind it until the backlog drains;
    turned away, it leaves the backlog short enough for those after it (and its client free to go elsewhere).

    Only a request that would queue: one that starts now waits on the worker's steps alone, and the predictions over
    the line at light load are its outliers (a gateway's first second, a long prompt); REALTIME never queues here (the
    worker seats it first), BATCH is held instead (`BatchHold`). Only while the model's forecast is at or over its
    threshold: a p90 is over the line for some requests at any load. Only a first attempt: a retry has waited already.
    Nothing is turned away without trees or a fresh forecast, with `shed_over` 0, or with the gateway's admission off
    (nothing queues here then). The retry-after is the predicted p90 itself: about when a backlog that long has
    drained."""

    stage = Stage.WORKER

    def __init__(self, link: SloLink, targets: dict[SlaClass, SlaTarget], metrics: GatewayMetrics) -> None:
        self.link, self.settings, self.targets, self.metrics = link, link.settings, targets, metrics
        self.shed_total = 0

    async def check(self, ctx: RequestContext) -> Verdict:
        worker, sla = ctx.worker, ctx.sla
        if (not self.settings.shed_over or sla != SlaClass.INTERACTIVE or ctx.attempt > 0
                or worker.admission.starts_now(sla) or not self.link.miss_forecast(ctx.model, time.monotonic())):
            return ADMIT
        p90_ms = self.link.predict_ttft_p90(ctx.model, worker, sla, ctx.prompt_bytes, ctx.max_new_tokens)
        target_ms = self.targets[sla].ttft_ms
        if p90_ms is None or p90_ms <= self.settings.shed_over * target_ms:
            return ADMIT
        self.shed_total += 1
        error = ResourceExhausted(
            f"sla_class {sla.name}: shed: the SLO predictor puts this request's TTFT p90 on worker {worker.address} "
            f"at {p90_ms:.0f} ms, over {self.settings.shed_over:g} x the class's {target_ms:.0f} ms target; retry later "
            "or elsewhere", trailers={"retry-after-ms": str(max(1, round(p90_ms)))})
        self.metrics.shed.labels(ctx.model).inc()
        ctx.span.add_event("shed", {"cotserve.reason": str(error), "cotserve.worker": worker.address})
        return Refuse(error)


class BatchPauses:
    """After each forecast refresh: pause (or keep paused) the running BATCH work of each model whose urgent classes
    are forecast to miss, on every healthy worker of it, for a lease of three refresh intervals (a gateway that stops
    asking, or dies, leaves no worker paused for long); end a pause as soon as it is no longer wanted. Acting on
    running BATCH, not only on BATCH arrivals (`BatchHold`): requests already decoding keep the engine's steps long
    through a burst however few new ones are let in."""

    def __init__(self, link: SloLink) -> None:
        self.link, self.settings = link, link.settings
        self.pausing_since: dict[str, float] = {}  # model -> when its BATCH pause began
        self.pause_rest_until: dict[str, float] = {}  # model -> no pause before this (after one of max_pause_ms)
        self.pauses_asked = 0  # PauseBatch calls that started or renewed a pause and succeeded
        self.pause_failures = 0
        link.on_refresh.append(self.steer_pauses)

    def pause_wanted(self, model: str, now: float) -> bool:
        """Whether `model`'s BATCH should be paused now: a fresh forecast at or over the threshold, urgent requests
        not idle, and not resting after a pause of `max_pause_ms` (which then ends for half as long)."""
        want = self.link.miss_forecast(model, now) and not self.link.recorder.urgent_idle(model) and now >= self.pause_rest_until.get(model, 0.0)
        since = self.pausing_since.get(model)
        if want and since is not None and now - since >= self.settings.max_pause_ms / 1000:
            self.pause_rest_until[model] = now + self.settings.max_pause_ms / 2000
            return False
        return want

    async def steer_pauses(self) -> None:
        """Pause, renew or end each model's BATCH pause (see the class)."""
        now = time.monotonic()
        lease_ms = round(min(3 * self.settings.forecast_interval_s, 60.0) * 1000)
        for model, workers in self.link.pool.models().items():
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
                self.link.warn(f"worker {w.address} ({model}): PauseBatch failed: {err.code().name} {err.details()}")

        await asyncio.gather(*(one(w) for w in workers if w.healthy))
