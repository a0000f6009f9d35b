"""The worker's Prometheus metrics, read from the engine's stats snapshot at scrape time."""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cotserve.common.metrics import CallbackCollector
from cotserve.worker.engine import EngineStats


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
            gauge("cotserve_worker_step_latency_p50_seconds", "Median engine step latency over recent steps.", s.step_latency_p50_ms / 1000),
            gauge("cotserve_worker_step_latency_p95_seconds", "95th percentile engine step latency over recent steps.", s.step_latency_p95_ms / 1000),
            counter("cotserve_worker_generated_tokens", "Tokens generated since start.", s.num_generated_tokens_total),
            counter("cotserve_worker_preemptions", "Preemptions since start.", s.num_preemptions_total),
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
