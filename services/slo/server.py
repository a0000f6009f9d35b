"""The SLO predictor service: learns from the windows gateways report, forecasts SLO violations,
predicts per-worker latency, and advises scaling.

Every `retrain_interval_s` (10 s) it retrains, off the event loop, when at least
`min_new_windows` windows arrived since the last fit; models and history live under `state_dir`
and survive a restart. Every `advice_interval_s` (10 s) it re-infers each model's forecast and
publishes scale advice: on `WatchAdvice` streams, on Redis (`cotserve:slo:advice`, JSON, plus the
key `cotserve:slo:advice:<model>`), and as Prometheus gauges (`cotserve_slo_violation_probability`,
`cotserve_slo_recommended_replicas`) for KEDA or an HPA.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np
from prometheus_client import CollectorRegistry, Gauge

from cotserve.common.errors import InvalidArgument
from cotserve.common.latency import LATENCY_FEATURES, TTFT_TARGET, latency_row
from cotserve.common.metrics import MetricsServer, serve_metrics
from cotserve.common.server import Server, ServiceSpec, run_until_signalled
from cotserve.common.tracing import make_tracer_provider
from cotserve.common.v1 import common_pb2
from cotserve.slo import features as F
from cotserve.slo.config import SloConfig
from cotserve.slo.history import History, validate_request, validate_window
from cotserve.slo.model import Forecaster, LatencyModel, Untrained, forecast_data, latency_data
from cotserve.slo.v1 import slo_pb2, slo_pb2_grpc

log = logging.getLogger("cotserve.slo")

ADVICE_CHANNEL = "cotserve:slo:advice"
STALE_S = 10  # a model with no window for this long has no forecast


@dataclass(slots=True)
class Advice:
    model: str
    action: int
    recommended: int
    probability: float
    current: int

    def to_pb(self) -> slo_pb2.WatchAdviceResponse:
        return slo_pb2.WatchAdviceResponse(model=self.model, action=self.action, recommended_replicas=self.recommended,
                                           violation_probability=self.probability, current_replicas=self.current)


class SloState:
    """History, the learners, each model's recent windows, and the latest advice."""

    def __init__(self, cfg: SloConfig) -> None:
        self.cfg = cfg
        self.history = History(cfg.state_dir / "history.bin" if cfg.state_dir else None, cfg.max_windows, cfg.max_windows)
        models = cfg.state_dir / "models" if cfg.state_dir else None
        self.forecaster = Forecaster.load(models, cfg.horizon_s) if models else Forecaster(horizon_s=cfg.horizon_s)
        self.latency_version, self.latency_json = 0, b""
        self.set_latency(LatencyModel.load(models) if models else LatencyModel())
        self.recent: dict[str, deque] = defaultdict(deque)  # model -> windows of the last LOOKBACK_S + STALE_S
        for w in self.history.windows:
            self._remember(w)
        self.trained_version = self.history.version if self.forecaster.is_trained else -1
        self.windows_since_fit = len(self.history.windows)
        self.advice: dict[str, Advice] = {}
        self.low_since: dict[str, float] = {}
        self.watchers: set[asyncio.Queue] = set()

    def _remember(self, w: common_pb2.MetricsWindow) -> None:
        q = self.recent[w.model]
        q.append(w)
        horizon = w.start_unix_ms - (F.LOOKBACK_S + STALE_S) * 1000
        while q and q[0].start_unix_ms < horizon:
            q.popleft()

    def report(self, request: slo_pb2.ReportWindowsRequest) -> slo_pb2.ReportWindowsResponse:
        for i, w in enumerate(request.windows):
            validate_window(w, f"windows[{i}]")
        for i, r in enumerate(request.requests):
            validate_request(r, f"requests[{i}]")
        self.history.add(list(request.windows), list(request.requests))
        for w in sorted(request.windows, key=lambda w: w.start_unix_ms):
            self._remember(w)
        self.windows_since_fit += len(request.windows)
        return slo_pb2.ReportWindowsResponse(num_accepted=len(request.windows), num_requests_accepted=len(request.requests))

    # -- inference -----------------------------------------------------------------------

    def latest_features(self, model: str, cls: int) -> tuple[np.ndarray | None, str]:
        q = self.recent.get(model)
        if not q:
            return None, f"no windows from model {model!r} yet"
        last = max(w.start_unix_ms for w in q)
        if time.time() * 1000 - last > STALE_S * 1000:
            return None, f"no windows from model {model!r} in the last {STALE_S} s"
        s = F.build_series(q)
        return F.feature_matrix(s, self.cfg.targets)[F.CLASS_INDEX[cls], -1], ""

    def forecast(self, model: str, cls: int) -> slo_pb2.ForecastResponse:
        resp = slo_pb2.ForecastResponse(threshold=self.cfg.threshold, horizon_ms=self.cfg.horizon_s * 1000)
        if not self.forecaster.is_trained:
            resp.untrained_reason = self.forecaster.untrained_reason
            return resp
        x, why = self.latest_features(model, cls)
        if x is None:
            resp.untrained_reason = why
            return resp
        resp.is_trained = True
        resp.violation_probability = float(self.forecaster.predict(x[None, :])[0])
        for name, value in self.forecaster.explain(x):
            resp.top_features.add(feature=name, contribution=value)
        return resp

    def set_latency(self, lm: LatencyModel) -> None:
        """Serve `lm` from now on; a trained one gets a new version (Unix ms, so a restarted predictor's model never
        passes for the one a gateway holds) and its routing trees' JSON (TTFT's 90th percentile) for GetLatencyModel."""
        self.latency = lm
        if lm.is_trained:
            self.latency_version = max(self.latency_version + 1, int(time.time() * 1000))
            self.latency_json = bytes(lm.ttft_p90.save_raw("json"))

    def latency_model(self, known_version: int) -> slo_pb2.GetLatencyModelResponse:
        if not self.latency.is_trained:
            return slo_pb2.GetLatencyModelResponse(untrained_reason=self.latency.untrained_reason)
        resp = slo_pb2.GetLatencyModelResponse(is_trained=True, version=self.latency_version, features=LATENCY_FEATURES,
                                              target=TTFT_TARGET)
        if known_version != self.latency_version:
            resp.ttft_model_json = self.latency_json
        return resp

    def predict_latency(self, request: slo_pb2.PredictLatencyRequest) -> slo_pb2.PredictLatencyResponse:
        resp = slo_pb2.PredictLatencyResponse()
        if not self.latency.is_trained or not request.candidates:
            return resp
        X = np.array([latency_row(request.prompt_tokens, request.max_new_tokens, request.sla_class, c.window)
                      for c in request.candidates])
        ttft, tpot, tail = self.latency.predict(X)
        resp.is_trained = True
        for c, a, b, p90 in zip(request.candidates, ttft, tpot, tail):
            resp.predictions.add(worker=c.worker, ttft_ms=float(a), tpot_ms=float(b), ttft_p90_ms=float(p90))
        return resp

    # -- learning ------------------------------------------------------------------------

    def fit(self) -> tuple[Forecaster, LatencyModel]:
        """Fit both learners on the last `train_window_s` of history (runs in a thread)."""
        windows, requests = list(self.history.windows), list(self.history.requests)
        if windows:
            since = max(w.start_unix_ms for w in windows) - self.cfg.train_window_s * 1000
            windows = [w for w in windows if w.start_unix_ms >= since]
            requests = [r for r in requests if r.start_unix_ms >= since]
        fc = Forecaster(horizon_s=self.cfg.horizon_s)
        try:
            fc.fit(forecast_data(windows, self.cfg.horizon_s, self.cfg.targets))
        except Untrained as exc:
            fc.untrained_reason = str(exc)
        lm = LatencyModel()
        try:
            lm.fit(*latency_data(windows, requests)[:3])
        except Untrained as exc:
            lm.untrained_reason = str(exc)
        return fc, lm

    async def maybe_retrain(self) -> bool:
        if self.windows_since_fit < self.cfg.min_new_windows:
            return False
        self.windows_since_fit = 0
        fc, lm = await asyncio.to_thread(self.fit)
        if fc.is_trained or not self.forecaster.is_trained:
            self.forecaster = fc
        if lm.is_trained or not self.latency.is_trained:
            self.set_latency(lm)
        if self.cfg.state_dir is not None:
            models = self.cfg.state_dir / "models"
            if fc.is_trained:
                await asyncio.to_thread(fc.save, models)
            if lm.is_trained:
                await asyncio.to_thread(lm.save, models)
        log.info("retrained: forecast %s, latency %s", f"{fc.samples} samples ({fc.positives} before a violation)" if fc.is_trained
                 else f"untrained ({fc.untrained_reason})", f"{lm.samples} requests" if lm.is_trained else f"untrained ({lm.untrained_reason})")
        return True

    # -- advice --------------------------------------------------------------------------

    def decide(self, model: str, now: float, forecasts: dict[int, slo_pb2.ForecastResponse] | None = None) -> Advice:
        """The advice for `model`, from the urgent classes' forecasts (computed here unless given)."""
        q = self.recent.get(model, ())
        last = max((w.start_unix_ms for w in q), default=0)
        current = len({w.worker for w in q if w.start_unix_ms >= last - 10_000})
        urgent_classes = (common_pb2.SLA_CLASS_REALTIME, common_pb2.SLA_CLASS_INTERACTIVE)
        urgent = [forecasts[c] if forecasts else self.forecast(model, c) for c in urgent_classes]
        trained = [f.violation_probability for f in urgent if f.is_trained]
        if not trained:
            return Advice(model, slo_pb2.SCALE_ACTION_HOLD, current, 0.0, current)
        p = max(trained)
        if p > self.cfg.threshold:
            self.low_since.pop(model, None)
            return Advice(model, slo_pb2.SCALE_ACTION_SCALE_UP, current + 1, p, current)
        if p < self.cfg.scale_down_below:
            since = self.low_since.setdefault(model, now)
            if now - since >= self.cfg.scale_down_after_s and current > 1:
                self.low_since[model] = now  # one step down per sustained stretch
                return Advice(model, slo_pb2.SCALE_ACTION_SCALE_DOWN, current - 1, p, current)
        else:
            self.low_since.pop(model, None)
        return Advice(model, slo_pb2.SCALE_ACTION_HOLD, current, p, current)


class SloServicer(slo_pb2_grpc.SloServiceServicer):
    def __init__(self, state: SloState) -> None:
        self.state = state

    async def ReportWindows(self, request, context) -> slo_pb2.ReportWindowsResponse:
        return self.state.report(request)

    async def Forecast(self, request, context) -> slo_pb2.ForecastResponse:
        if not request.model:
            raise InvalidArgument("model: must not be empty")
        if request.sla_class not in F.CLASS_INDEX:
            raise InvalidArgument(f"sla_class: must be REALTIME, INTERACTIVE or BATCH, got {request.sla_class}")
        if request.horizon_ms and request.horizon_ms != self.state.cfg.horizon_s * 1000:
            raise InvalidArgument(f"horizon_ms: this service forecasts {self.state.cfg.horizon_s * 1000} ms ahead "
                                  f"(0 for that), got {request.horizon_ms}")
        return self.state.forecast(request.model, request.sla_class)

    async def PredictLatency(self, request, context) -> slo_pb2.PredictLatencyResponse:
        if request.sla_class not in F.CLASS_INDEX:
            raise InvalidArgument(f"sla_class: must be REALTIME, INTERACTIVE or BATCH, got {request.sla_class}")
        for i, c in enumerate(request.candidates):
            if not c.worker:
                raise InvalidArgument(f"candidates[{i}].worker: must not be empty")
            for name in ("kv_used_fraction", "utilization", "ttft_p50_ms", "itl_p50_ms", "output_tokens_per_s",
                         "worker_step_ms", "worker_tokens_per_s"):
                v = getattr(c.window, name)
                if not math.isfinite(v) or v < 0:
                    raise InvalidArgument(f"candidates[{i}].window.{name}: must be a finite number >= 0, got {v}")
        return self.state.predict_latency(request)

    async def GetLatencyModel(self, request, context) -> slo_pb2.GetLatencyModelResponse:
        return self.state.latency_model(request.known_version)

    async def WatchAdvice(self, request, context) -> AsyncIterator[slo_pb2.WatchAdviceResponse]:
        queue: asyncio.Queue[Advice] = asyncio.Queue(maxsize=1000)
        self.state.watchers.add(queue)
        try:
            for advice in list(self.state.advice.values()):
                if not request.model or advice.model == request.model:
                    yield advice.to_pb()
            while True:
                advice = await queue.get()
                if not request.model or advice.model == request.model:
                    yield advice.to_pb()
        finally:
            self.state.watchers.discard(queue)

    async def ExportWindows(self, request, context) -> slo_pb2.ExportWindowsResponse:
        windows, requests, more = self.state.history.since(request.since_unix_ms, request.max_windows or 20_000)
        return slo_pb2.ExportWindowsResponse(windows=windows, requests=requests, next_since_unix_ms=more)


@dataclass(slots=True)
class RunningSlo:
    server: Server
    state: SloState
    tasks: list[asyncio.Task]
    metrics_server: MetricsServer | None
    redis: object = None

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.server.stop(grace_s)
        await self.close()

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.redis is not None:
            await self.redis.aclose()


async def _every(interval_s: float, fn, what: str) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await fn()
        except Exception:  # noqa: BLE001 - a failed round is logged; the loop goes on
            log.exception("%s failed", what)


async def start_slo(cfg: SloConfig, tracer_provider=None) -> RunningSlo:
    cfg.validate()
    state = await asyncio.to_thread(SloState, cfg)
    registry = CollectorRegistry()
    g_prob = Gauge("cotserve_slo_violation_probability", "Forecast probability that the class misses its latency target "
                   "within the horizon.", ["model", "sla_class"], registry=registry)
    g_rep = Gauge("cotserve_slo_recommended_replicas", "Workers the SLO predictor recommends for the model.", ["model"], registry=registry)
    metrics_server = serve_metrics(registry, cfg.host, cfg.metrics_port)
    redis = None
    if cfg.redis_url:
        import redis.asyncio as aioredis

        redis = aioredis.Redis.from_url(cfg.redis_url)

    async def advise() -> None:
        now = time.time()
        for model in list(state.recent):
            forecasts = {cls: state.forecast(model, cls) for cls in F.PB_CLASSES}
            for cls, name in zip(F.PB_CLASSES, F.CLASS_NAMES):
                if forecasts[cls].is_trained:
                    g_prob.labels(model, name).set(forecasts[cls].violation_probability)
            advice = state.decide(model, now, forecasts)
            state.advice[model] = advice
            g_rep.labels(model).set(advice.recommended)
            for q in list(state.watchers):
                if not q.full():
                    q.put_nowait(advice)
            if redis is not None:
                msg = json.dumps({"model": model, "action": slo_pb2.ScaleAction.Name(advice.action).removeprefix("SCALE_ACTION_"),
                                  "recommended_replicas": advice.recommended, "current_replicas": advice.current,
                                  "violation_probability": advice.probability, "at_unix_ms": int(now * 1000)})
                try:
                    await redis.set(f"{ADVICE_CHANNEL}:{model}", msg)
                    await redis.publish(ADVICE_CHANNEL, msg)
                except Exception as exc:  # noqa: BLE001 - Redis down: advice still reaches streams and gauges
                    log.warning("cannot publish advice to Redis: %s", exc)

    spec = ServiceSpec("cotserve.slo.v1.SloService", lambda srv: slo_pb2_grpc.add_SloServiceServicer_to_server(SloServicer(state), srv))
    server = Server([spec], cfg.host, cfg.port, tracer_provider, tls=cfg)
    await server.start()
    await server.set_serving()
    tasks = [asyncio.create_task(_every(cfg.retrain_interval_s, state.maybe_retrain, "retraining")),
             asyncio.create_task(_every(cfg.advice_interval_s, advise, "advice"))]
    log.info("SERVING slo on %s: %d windows in history, forecast %s, latency %s%s", server.address, len(state.history.windows),
             "trained" if state.forecaster.is_trained else f"untrained ({state.forecaster.untrained_reason})",
             "trained" if state.latency.is_trained else f"untrained ({state.latency.untrained_reason})",
             f", metrics on :{metrics_server.port}" if metrics_server else "")
    return RunningSlo(server, state, tasks, metrics_server, redis)


async def serve(cfg: SloConfig) -> None:
    running = await start_slo(cfg, make_tracer_provider("cotserve-slo"))
    await run_until_signalled(running.server, cfg.grace_s, on_stop=running.close)
