"""What the gateway reports to the SLO predictor, for it to learn and forecast from: one metrics window per second per
(model, worker, SLA class), and every finished request with the state its worker was chosen in. Recorded here as
requests go (`AttemptObserver` calls it), closed and reported every second (`report_forever`)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

import grpc

from cotserve.common.sampling import SLA_PB, SlaClass
from cotserve.common.stats import percentile
from cotserve.common.v1 import common_pb2
from cotserve.common.windows import worker_total
from cotserve.gateway.slo_settings import SloSettings
from cotserve.slo.v1 import slo_pb2, slo_pb2_grpc

PB_CLASS = SLA_PB
DEFAULT_TOKENS_PER_BYTE = 0.25  # prompt tokens per prompt byte before a model's requests have told (English text)


@dataclass(slots=True)
class _Acc:
    arrivals: int = 0
    completions: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0


class WindowRecorder:
    """The windows and request observations of one gateway, and their reports to the predictor (`stub`). Runs on the
    gateway's event loop."""

    def __init__(self, settings: SloSettings, pool, stub: slo_pb2_grpc.SloServiceStub,
                 warn: Callable[[str], None]) -> None:
        self.settings, self.pool, self.stub, self.warn = settings, pool, stub, warn
        self.acc: dict[tuple[str, str, SlaClass], _Acc] = defaultdict(_Acc)
        self.in_flight: dict[tuple[str, str, SlaClass], int] = defaultdict(int)
        self.requests: list[slo_pb2.RequestObservation] = []
        self.backlog: deque[slo_pb2.ReportWindowsRequest] = deque()
        self.last_worker_window: dict[str, common_pb2.MetricsWindow] = {}
        self.preemptions_seen: dict[str, int] = {}
        self.tokens_per_byte: dict[str, float] = {}
        self.urgent_seen: dict[str, float] = {}  # model -> when a REALTIME or INTERACTIVE request of it last started or ended
        self.reports_failed = 0

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
        return time.monotonic() - self.urgent_seen.get(model, -math.inf) >= self.settings.urgent_idle_s

    def tokens_per_byte_of(self, model: str) -> float:
        """Prompt tokens per prompt byte of `model`, as its finished requests have shown (a moving average)."""
        return self.tokens_per_byte.get(model, DEFAULT_TOKENS_PER_BYTE)

    def finished(self, model: str, worker: str, sla: SlaClass, start_unix_ms: int, prompt_text_bytes: int, prompt_tokens: int,
                 max_new_tokens: int, completion_tokens: int, ttft_ms: float, tpot_ms: float,
                 at_start: common_pb2.MetricsWindow) -> None:
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

    def roll(self, start_unix_ms: int) -> list[common_pb2.MetricsWindow]:
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
                per_class.append(common_pb2.MetricsWindow(
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

    async def report_forever(self) -> None:
        """Close a window every second and report it with the requests finished in it; a report that fails is
        retried with the next one (a bounded backlog)."""
        second = int(time.time())
        while True:
            await asyncio.sleep(max(0.0, second + 1 - time.time()))
            windows = self.roll(second * 1000)
            requests, self.requests = self.requests, []
            second += 1
            if windows or requests:
                self.backlog.append(slo_pb2.ReportWindowsRequest(windows=windows, requests=requests))
            while len(self.backlog) > self.settings.max_backlog:
                self.backlog.popleft()
            try:
                while self.backlog:
                    await self.stub.ReportWindows(self.backlog[0], timeout=1.0)
                    self.backlog.popleft()
            except grpc.aio.AioRpcError as err:
                self.reports_failed += 1
                if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    self.backlog.popleft()  # never resend what the predictor rejects
                self.warn(f"SLO predictor {self.settings.address}: ReportWindows failed: {err.code().name} {err.details()}")
            second = max(second, int(time.time()))
