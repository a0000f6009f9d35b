"""The engine's counters and the `EngineStats` snapshot it publishes after every step: what the worker's /metrics,
its Stats RPC and the gateway's admission read. `EngineMetrics` is written on the engine thread only; a snapshot is
immutable, so any thread may read the latest one."""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass

from cotserve.common.stats import percentile

STEP_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds of the engine-step latency histogram's buckets, in seconds."""

TOKEN_RATE_WINDOW_S = 10.0
"""The window `generated_tokens_per_s` is measured over."""


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running_requests: int = 0  # requests with a sequence in the running batch
    num_waiting_requests: int = 0  # requests with no sequence running (waiting or preempted)
    step_latency_counts: tuple[int, ...] = ()  # steps per STEP_LATENCY_BUCKETS_S bucket (the last: above them), since start
    step_latency_sum_s: float = 0.0  # seconds all steps took, since start
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    step_latency_p50_ms: float = 0.0
    step_latency_p95_ms: float = 0.0
    generated_tokens_per_s: float = 0.0
    num_preemptions_total: int = 0
    num_batch_yields_total: int = 0  # steps BATCH sat out for an urgent prompt
    num_batch_paused_steps_total: int = 0  # steps BATCH sat out while paused (`pause_batch`)
    num_requests_finished_total: int = 0
    num_waiting_urgent_seqs: int = 0
    num_generated_tokens_total: int = 0
    moe_policy_version: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_blocks: int = 0
    prefix_cache_evictions: int = 0
    num_prompt_tokens_computed_total: int = 0
    kv_blocks_used_peak: int = 0
    num_reasoning_tokens_total: int = 0
    num_probe_tokens_total: int = 0
    num_early_exits_total: int = 0
    num_thinking_tokens_saved_total: int = 0  # estimated: see EngineMetrics.note_thinking
    num_vote_samples_used_total: int = 0
    num_vote_samples_saved_total: int = 0  # max_samples minus samples used, over finished votes
    kernels_ready: bool = True  # the runner's CPU kernels are compiled (see ModelRunner.warmed)


class EngineMetrics:
    """The engine's running counts, turned into an `EngineStats` by `snapshot` (engine thread only)."""

    def __init__(self) -> None:
        self.step_ms: deque[float] = deque(maxlen=256)  # the latest steps' latencies, for the percentiles
        self.step_counts = [0] * (len(STEP_LATENCY_BUCKETS_S) + 1)
        self.step_sum_s = 0.0
        self._tokens: deque[tuple[float, int]] = deque()  # (when, tokens generated in that step), over the window
        self._tokens_in_window = 0  # the sum of `_tokens`' counts, kept as they come and go
        self.prompt_tokens_computed = 0
        self.kv_blocks_peak = 0
        self.requests_finished = 0
        self.generated_tokens = 0
        self.reasoning_tokens = 0
        self.probe_tokens = 0
        self.early_exits = 0
        self.thinking_tokens_saved = 0
        self.vote_samples_used = 0
        self.vote_samples_saved = 0
        self._natural_thinking = (0, 0)  # (samples, thinking tokens) of samples that ended thinking on their own

    def step_done(self, seconds: float) -> None:
        self.step_ms.append(seconds * 1000)
        self.step_counts[bisect.bisect_left(STEP_LATENCY_BUCKETS_S, seconds)] += 1
        self.step_sum_s += seconds

    def tokens_generated(self, now: float, n: int) -> None:
        self._tokens.append((now, n))
        self._tokens_in_window += n
        self.generated_tokens += n

    def note_thinking(self, num_thinking_tokens: int, exited_early: bool, forced_end: bool) -> None:
        """A sample ended its thinking. Tokens saved by an early exit are estimated against the mean thinking length
        of the samples that ended their thinking on their own, on this worker so far."""
        n, total = self._natural_thinking
        if exited_early:
            if n:
                self.thinking_tokens_saved += max(0, round(total / n) - num_thinking_tokens)
        elif not forced_end:
            self._natural_thinking = (n + 1, total + num_thinking_tokens)

    def tokens_per_s(self, now: float) -> float:
        """Tokens generated per second over the last TOKEN_RATE_WINDOW_S."""
        while self._tokens and now - self._tokens[0][0] > TOKEN_RATE_WINDOW_S:
            self._tokens_in_window -= self._tokens.popleft()[1]
        if not self._tokens:
            return 0.0
        span = max(1e-3, now - self._tokens[0][0]) if len(self._tokens) > 1 else 1.0
        return self._tokens_in_window / span

    def snapshot(self, scheduler, policy_version: int, kernels_ready: bool) -> EngineStats:
        """The stats as of now, with `scheduler`'s queues and its block manager's pool."""
        steps = sorted(self.step_ms)  # once for both percentiles
        bm = scheduler.block_manager
        running = {s.request_id for s in scheduler.running if not s.is_probe}  # the batch, not the queue: no O(waiting)
        waiting = scheduler.waiting.requests
        return EngineStats(
            num_running_requests=len(running),
            num_waiting_requests=len(waiting) - sum(r in waiting for r in running),
            step_latency_counts=tuple(self.step_counts), step_latency_sum_s=self.step_sum_s,
            num_running_seqs=len(scheduler.running), num_waiting_seqs=len(scheduler.waiting),
            kv_blocks_used=bm.num_used_blocks, kv_blocks_free=bm.num_free_blocks,
            step_latency_p50_ms=percentile(steps, 50, empty=0.0), step_latency_p95_ms=percentile(steps, 95, empty=0.0),
            generated_tokens_per_s=self.tokens_per_s(time.monotonic()),
            num_preemptions_total=scheduler.num_preemptions_total,
            num_batch_yields_total=scheduler.num_batch_yields_total,
            num_batch_paused_steps_total=scheduler.num_batch_paused_steps_total,
            num_requests_finished_total=self.requests_finished, num_generated_tokens_total=self.generated_tokens,
            moe_policy_version=policy_version, num_waiting_urgent_seqs=scheduler.waiting.num_urgent,
            prefix_cache_queried_tokens=bm.num_queried_tokens, prefix_cache_hit_tokens=bm.num_hit_tokens,
            prefix_cache_blocks=bm.num_cached_blocks, prefix_cache_evictions=bm.num_evictions,
            num_prompt_tokens_computed_total=self.prompt_tokens_computed, kv_blocks_used_peak=self.kv_blocks_peak,
            num_reasoning_tokens_total=self.reasoning_tokens, num_probe_tokens_total=self.probe_tokens,
            num_early_exits_total=self.early_exits, num_thinking_tokens_saved_total=self.thinking_tokens_saved,
            num_vote_samples_used_total=self.vote_samples_used, num_vote_samples_saved_total=self.vote_samples_saved,
            kernels_ready=kernels_ready,
        )
