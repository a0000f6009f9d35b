"""The worker's Prometheus metrics, read from the engine's stats snapshot at scrape time.

Load is exported under cotserve's names and, for tools built for vLLM (the Kubernetes Gateway API Inference
Extension's endpoint pickers, autoscalers configured for vLLM), also under vLLM's, label `model_name`:

    cotserve_worker_num_requests_waiting   vllm:num_requests_waiting   requests with no sequence running
    cotserve_worker_num_requests_running   vllm:num_requests_running   requests with a sequence in the batch
    cotserve_worker_kv_cache_usage_ratio   vllm:kv_cache_usage_perc    KV blocks in use / blocks in the pool, 0..1
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from cotserve.common.metrics import CallbackCollector
from cotserve.worker.engine_metrics import STEP_LATENCY_BUCKETS_S, EngineStats

VLLM_NAMES = {"cotserve_worker_num_requests_waiting": "vllm:num_requests_waiting",
              "cotserve_worker_num_requests_running": "vllm:num_requests_running",
              "cotserve_worker_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc"}
"""cotserve's load gauges -> vLLM's names for the same (vLLM's usage "perc" is a 0..1 fraction too)."""


def _load(s: EngineStats, model: str, total_blocks: int) -> list[Metric]:
    values = {"cotserve_worker_num_requests_waiting": ("Requests with no sequence running (waiting or preempted).",
                                                       s.num_waiting_requests),
              "cotserve_worker_num_requests_running": ("Requests with a sequence in the running batch.",
                                                       s.num_running_requests),
              "cotserve_worker_kv_cache_usage_ratio": ("KV-cache blocks in use over blocks in the pool, 0..1.",
                                                       s.kv_blocks_used / total_blocks if total_blocks else 0.0)}
    out: list[Metric] = []
    for name, (doc, value) in values.items():
        for metric_name, label in ((name, "model"), (VLLM_NAMES[name], "model_name")):
            g = GaugeMetricFamily(metric_name, doc, labels=[label])
            g.add_metric([model], value)
            out.append(g)
    return out


def _step_histogram(s: EngineStats, model: str) -> HistogramMetricFamily:
    h = HistogramMetricFamily("cotserve_worker_step_latency_seconds", "Engine step latency (schedule, forward, sample).",
                              labels=["model"])
    counts = s.step_latency_counts or (0,) * (len(STEP_LATENCY_BUCKETS_S) + 1)
    cumulative, buckets = 0, []
    for bound, n in zip([*map(str, STEP_LATENCY_BUCKETS_S), "+Inf"], counts):
        cumulative += n
        buckets.append((bound, cumulative))
    h.add_metric([model], buckets, s.step_latency_sum_s)
    return h


def worker_registry(stats: Callable[[], EngineStats], model: str, total_blocks: int) -> CollectorRegistry:
    registry = CollectorRegistry()

    def collect() -> Iterable[Metric]:
        s = stats()
        labels = ["model"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([model], value)
            return c

        return [
            gauge("cotserve_worker_kv_blocks_used", "KV blocks held by sequences.", s.kv_blocks_used),
            gauge("cotserve_worker_kv_blocks_total", "KV blocks in the pool.", total_blocks),
            gauge("cotserve_worker_running_seqs", "Sequences in the running batch.", s.num_running_seqs),
            gauge("cotserve_worker_waiting_seqs", "Sequences waiting (preempted ones included).", s.num_waiting_seqs),
            *_load(s, model, total_blocks), _step_histogram(s, model),
            counter("cotserve_worker_generated_tokens", "Tokens generated since start.", s.num_generated_tokens_total),
            counter("cotserve_worker_preemptions", "Preemptions since start.", s.num_preemptions_total),
            counter("cotserve_worker_batch_yields", "Steps BATCH work sat out so that a REALTIME/INTERACTIVE prompt "
                    "ran alone.", s.num_batch_yields_total),
            counter("cotserve_worker_batch_paused_steps", "Steps BATCH work sat out while paused (PauseBatch, asked by a "
                    "gateway whose SLO predictor forecasts an urgent-class miss).", s.num_batch_paused_steps_total),
            counter("cotserve_worker_requests_finished", "Requests finished (any way) since start.", s.num_requests_finished_total),
            counter("cotserve_worker_prefix_cache_queried_tokens", "Tokens looked up in the prefix cache at admission.", s.prefix_cache_queried_tokens),
            counter("cotserve_worker_prefix_cache_hit_tokens", "Tokens found in the prefix cache at admission.", s.prefix_cache_hit_tokens),
            gauge("cotserve_worker_prefix_cache_blocks", "KV blocks registered in the prefix cache (held or evictable).", s.prefix_cache_blocks),
            counter("cotserve_worker_prefix_cache_evictions", "Cached KV blocks evicted for new contents.", s.prefix_cache_evictions),
            counter("cotserve_worker_prompt_tokens_computed", "Prompt tokens computed by the model (cache hits excluded).", s.num_prompt_tokens_computed_total),
            counter("cotserve_worker_reasoning_tokens", "Reasoning tokens of finished requests.", s.num_reasoning_tokens_total),
            counter("cotserve_worker_probe_tokens", "Tokens computed by early-exit probes.", s.num_probe_tokens_total),
            counter("cotserve_worker_early_exits", "Samples whose thinking an early exit ended.", s.num_early_exits_total),
            counter("cotserve_worker_thinking_tokens_saved", "Thinking tokens early exits saved (estimated against the mean "
                    "thinking length of samples that ended on their own).", s.num_thinking_tokens_saved_total),
            counter("cotserve_worker_vote_samples_used", "Samples that voted in self-consistency votes.", s.num_vote_samples_used_total),
            counter("cotserve_worker_vote_samples_saved", "Samples self-consistency votes did not need (max_samples - used).",
                    s.num_vote_samples_saved_total),
        ]

    registry.register(CallbackCollector(collect))
    return registry
