"""Windows from a small queueing simulation: one worker serving 10 requests/s, INTERACTIVE load
with ramps and bursts. Its queue builds over seconds, so violations can be foreseen."""

from __future__ import annotations

import random

from cotserve.common.v1 import common_pb2
from cotserve.slo.v1 import slo_pb2

T0_MS = 1_800_000_000_000


def rate_at(t: int, period: int = 90) -> float:
    phase = t % period
    if phase < 40:
        return 6.0                      # steady, under capacity
    if phase < 70:
        return 6.0 + (phase - 40) * 0.4  # ramp to 18/s: the queue builds
    return 3.0                          # drain


def simulate(seconds: int, seed: int = 0, worker: str = "w1", model: str = "m", t0_ms: int = T0_MS):
    rng = random.Random(seed)
    windows, requests = [], []
    queue = 0.0
    for t in range(seconds):
        arrivals = sum(1 for _ in range(40) if rng.random() < rate_at(t) / 40)
        served = min(queue + arrivals, 10)
        queue = max(0.0, queue + arrivals - 10)
        ttft = 60 + queue / 10 * 1000 + rng.uniform(0, 20)
        start = t0_ms + t * 1000
        windows.append(slo_pb2.MetricsWindow(
            start_unix_ms=start, model=model, worker=worker, sla_class=common_pb2.SLA_CLASS_INTERACTIVE,
            arrivals=arrivals, completions=int(served), first_tokens=int(served), ttft_p50_ms=ttft, ttft_p95_ms=ttft * 1.3,
            ttft_p99_ms=ttft * 1.5, itl_p50_ms=8, itl_p95_ms=12, itl_p99_ms=15, queue_depth=int(queue), in_flight=int(served),
            kv_used_fraction=min(1.0, 0.1 + queue / 60), output_tokens_per_s=served * 64, utilization=min(1.0, served / 10),
            utilization_is_cpu=True, mean_prompt_tokens=64, worker_waiting=int(queue / 2)))
        for i in range(int(served)):
            requests.append(slo_pb2.RequestObservation(
                start_unix_ms=start + 5 + i, model=model, worker=worker, sla_class=common_pb2.SLA_CLASS_INTERACTIVE,
                prompt_tokens=64, max_new_tokens=64, completion_tokens=64, ttft_ms=ttft * rng.uniform(0.9, 1.1),
                tpot_ms=8 * (1 + queue / 100) * rng.uniform(0.9, 1.1), in_flight_at_start=int(served), queued_at_start=int(queue)))
    return windows, requests


def simulate_prefill(seconds: int, seed: int = 0, worker: str = "w1", model: str = "m", t0_ms: int = T0_MS):
    """A worker whose TTFT is its prefill line: requests of 16-512 prompt tokens arrive in bursts each second, and each
    waits for the prompts sent before it (still without a first token) and its own at 1 ms per token. The window's
    aggregates are the same whatever the order, so only the request's place in line tells a short wait from a long
    one."""
    rng = random.Random(seed)
    windows, requests = [], []
    for t in range(seconds):
        start = t0_ms + t * 1000
        n = rng.randint(1, 12)
        prompts = [rng.choice((16, 32, 64, 256, 512)) for _ in range(n)]
        ahead, ttfts = 0, []
        for i, p in enumerate(prompts):
            ttfts.append((20 + ahead + p) * rng.uniform(0.95, 1.05))
            requests.append(slo_pb2.RequestObservation(
                start_unix_ms=start + 1000 + 5 + i, model=model, worker=worker, sla_class=common_pb2.SLA_CLASS_INTERACTIVE,
                prompt_tokens=p, max_new_tokens=32, completion_tokens=32, ttft_ms=ttfts[-1], tpot_ms=8, in_flight_at_start=n,
                queued_at_start=0, waiting_for_first_token_at_start=i, prefill_tokens_ahead_at_start=ahead))
            ahead += p
        ttfts.sort()
        windows.append(slo_pb2.MetricsWindow(
            start_unix_ms=start, model=model, worker=worker, sla_class=common_pb2.SLA_CLASS_INTERACTIVE, arrivals=n,
            completions=n, first_tokens=n, ttft_p50_ms=ttfts[len(ttfts) // 2], ttft_p95_ms=ttfts[-1], ttft_p99_ms=ttfts[-1],
            itl_p50_ms=8, itl_p95_ms=12, itl_p99_ms=15, in_flight=n, kv_used_fraction=0.3, output_tokens_per_s=n * 32,
            utilization=0.5, utilization_is_cpu=True, mean_prompt_tokens=sum(prompts) / n))
    return windows, requests
