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
        windows.append(common_pb2.MetricsWindow(
            start_unix_ms=start, model=model, worker=worker, sla_class=common_pb2.SLA_CLASS_INTERACTIVE,
            arrivals=arrivals, completions=int(served), first_tokens=int(served), ttft_p50_ms=ttft, ttft_p95_ms=ttft * 1.3,
            ttft_p99_ms=ttft * 1.5, itl_p50_ms=8, itl_p95_ms=12, itl_p99_ms=15, queue_depth=int(queue), in_flight=int(served),
            kv_used_fraction=min(1.0, 0.1 + queue / 60), output_tokens_per_s=served * 64, utilization=min(1.0, served / 10),
            utilization_is_cpu=True, mean_prompt_tokens=64, worker_waiting=int(queue / 2)))
        for i in range(int(served)):
            requests.append(slo_pb2.RequestObservation(
                start_unix_ms=start + 5 + i, model=model, worker=worker, sla_class=common_pb2.SLA_CLASS_INTERACTIVE,
                prompt_tokens=64, max_new_tokens=64, completion_tokens=64, ttft_ms=ttft * rng.uniform(0.9, 1.1),
                tpot_ms=8 * (1 + queue / 100) * rng.uniform(0.9, 1.1), in_flight_at_start=int(served), queued_at_start=int(queue),
                queued_ahead_at_start=int(queue)))
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
        windows.append(common_pb2.MetricsWindow(
            start_unix_ms=start, model=model, worker=worker, sla_class=common_pb2.SLA_CLASS_INTERACTIVE, arrivals=n,
            completions=n, first_tokens=n, ttft_p50_ms=ttfts[len(ttfts) // 2], ttft_p95_ms=ttfts[-1], ttft_p99_ms=ttfts[-1],
            itl_p50_ms=8, itl_p95_ms=12, itl_p99_ms=15, in_flight=n, kv_used_fraction=0.3, output_tokens_per_s=n * 32,
            utilization=0.5, utilization_is_cpu=True, mean_prompt_tokens=sum(prompts) / n))
    return windows, requests


def simulate_background(seconds: int, seed: int = 0, model: str = "m", t0_ms: int = T0_MS):
    """Two workers whose TTFT is set by load this gateway never sent: each runs a batch of 0-40 sequences from other
    clients (another gateway, a batch job), a level that changes every 10-30 s and makes its steps take 2 ms + 0.15 ms a
    sequence; a request waits for the steps of this gateway's requests ahead of it and its own. This gateway sends each
    worker 0-2 requests a second, so its own TTFT and ITL samples of a worker are often missing (zeros in the window);
    the worker's Stats in the window (its running batch, step time and tokens/s) are there every second."""
    rng = random.Random(seed)
    windows, requests = [], []
    running, change_at = {"w1": 0, "w2": 0}, {"w1": 0, "w2": 0}
    for t in range(seconds):
        start = t0_ms + t * 1000
        for worker in ("w1", "w2"):
            if t >= change_at[worker]:
                running[worker], change_at[worker] = rng.randint(0, 40), t + rng.randint(10, 30)
            step_ms = 2 + 0.15 * running[worker]
            n = rng.randint(0, 2)
            ttfts = [step_ms * (2 + i) * rng.uniform(0.95, 1.05) for i in range(n)]
            for i, ttft in enumerate(ttfts):  # these see the previous second's window (latency_data)
                requests.append(slo_pb2.RequestObservation(
                    start_unix_ms=start + 5 + i, model=model, worker=worker, sla_class=common_pb2.SLA_CLASS_INTERACTIVE,
                    prompt_tokens=32, max_new_tokens=32, completion_tokens=32, ttft_ms=ttft, tpot_ms=step_ms,
                    in_flight_at_start=i, queued_at_start=0, waiting_for_first_token_at_start=i,
                    prefill_tokens_ahead_at_start=32 * i))
            ttfts.sort()
            windows.append(common_pb2.MetricsWindow(
                start_unix_ms=start, model=model, worker=worker, sla_class=common_pb2.SLA_CLASS_INTERACTIVE, arrivals=n,
                completions=n, first_tokens=n, ttft_p50_ms=ttfts[n // 2] if n else 0.0, ttft_p95_ms=max(ttfts, default=0.0),
                ttft_p99_ms=max(ttfts, default=0.0), itl_p50_ms=step_ms if n else 0.0, itl_p95_ms=step_ms if n else 0.0,
                itl_p99_ms=step_ms if n else 0.0, in_flight=n, kv_used_fraction=rng.uniform(0.1, 0.6),
                output_tokens_per_s=n * 32, utilization=0.5, utilization_is_cpu=True, mean_prompt_tokens=32,
                worker_running=running[worker], worker_step_ms=step_ms, worker_tokens_per_s=running[worker] * 1000 / step_ms))
    return windows, requests
