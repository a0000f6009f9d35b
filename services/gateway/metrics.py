"""The gateway's Prometheus metrics: per model and SLA class latencies, request counts by status
and tenant, in-flight and queued requests, and each worker's load as the gateway last polled it (under the
gateway's own names, `cotserve_gateway_worker_*`: the workers export theirs themselves, and the same name from two
jobs would be summed twice)."""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from cotserve.common.metrics import LATENCY_BUCKETS, CallbackCollector
from cotserve.common.sampling import SlaClass
from cotserve.gateway.pool import WorkerPool

_LABELS = ("model", "sla_class")


class GatewayMetrics:
    def __init__(self, pool: WorkerPool, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("cotserve_gateway_ttft_seconds", "Time to first token, seen by the gateway.",
                              _LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("cotserve_gateway_inter_token_latency_seconds", "Time between two streamed tokens.",
                             _LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("cotserve_gateway_request_duration_seconds", "End-to-end request latency.",
                             _LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("cotserve_gateway_queue_seconds", "Time waiting in the gateway's admission queue.",
                               _LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.batch_held = Histogram("cotserve_gateway_batch_held_seconds",
                                    "Time BATCH requests were held on the SLO predictor's forecast (held ones only).",
                                    ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.shed = Counter("cotserve_gateway_shed", "INTERACTIVE requests turned away on their predicted TTFT "
                            "(--slo-shed-over).", ["model"], registry=r)
        self.requests = Counter("cotserve_gateway_requests", "Requests by final status code and tenant.",
                                (*_LABELS, "code", "tenant"), registry=r)
        self.routed = Counter("cotserve_gateway_routed", "Worker picks among several by what decided them: predicted_ttft "
                              "(the SLO predictor's latency model) or load (the heuristic: no predictor, untrained, or no "
                              "answer within --slo-predict-budget-ms).", ("model", "by"), registry=r)
        r.register(CallbackCollector(lambda: self._live(pool)))

    @staticmethod
    def _live(pool: WorkerPool) -> Iterable[Metric]:
        in_flight = GaugeMetricFamily("cotserve_gateway_in_flight_requests", "Requests on a worker now.", labels=_LABELS)
        queued = GaugeMetricFamily("cotserve_gateway_queued_requests", "Requests waiting for admission now.", labels=_LABELS)
        used = GaugeMetricFamily("cotserve_gateway_worker_kv_blocks_used", "KV blocks in use (last poll).", labels=["worker", "model"])
        total = GaugeMetricFamily("cotserve_gateway_worker_kv_blocks_total", "KV blocks in the pool (last poll).", labels=["worker", "model"])
        running = GaugeMetricFamily("cotserve_gateway_worker_running_seqs", "Sequences running (last poll).", labels=["worker", "model"])
        waiting = GaugeMetricFamily("cotserve_gateway_worker_waiting_seqs", "Sequences waiting (last poll).", labels=["worker", "model"])
        healthy = GaugeMetricFamily("cotserve_gateway_worker_healthy", "1 when the worker is in rotation.", labels=["worker", "model"])
        limit = GaugeMetricFamily("cotserve_gateway_admission_limit", "In-flight limit of a class on a worker now: INTERACTIVE's "
                                  "follows its inter-token target, BATCH's restarts from --batch-restart-limit after "
                                  "INTERACTIVE queued.", labels=["worker", "model", "sla_class"])
        sums: dict[tuple[str, str], list[int]] = {}
        for w in pool.workers:
            model = w.model or "unknown"
            for cls in SlaClass:
                acc = sums.setdefault((model, cls.name), [0, 0])
                acc[0] += w.admission.in_flight[cls]
                acc[1] += len(w.admission.queues.get(cls, ()))
            healthy.add_metric([w.address, model], 1.0 if w.healthy else 0.0)
            for cls, n in w.admission.limit.items():
                limit.add_metric([w.address, model, cls.name], n)
            if w.stats is not None:
                s = w.stats
                used.add_metric([w.address, model], s.kv_blocks_used)
                total.add_metric([w.address, model], s.kv_blocks_used + s.kv_blocks_free)
                running.add_metric([w.address, model], s.num_running_seqs)
                waiting.add_metric([w.address, model], s.num_waiting_seqs)
        for (model, cls), (n_in, n_q) in sorted(sums.items()):
            in_flight.add_metric([model, cls], n_in)
            queued.add_metric([model, cls], n_q)
        return [in_flight, queued, used, total, running, waiting, healthy, limit]
