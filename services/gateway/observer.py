"""What one relayed worker stream tells the rest of the gateway: latency histograms, the worker's admission (its
inter-token latency), the SLO predictor's windows and the request's span. One object per attempt at a worker, fed
each chunk as it arrives; the relay itself only moves chunks."""

from __future__ import annotations

import time

from opentelemetry.trace import Span

from cotserve.common.sampling import SlaClass, finish_reason_name
from cotserve.gateway.metrics import GatewayMetrics
from cotserve.gateway.pool import WorkerHandle
from cotserve.gateway.slo_link import SloLink, counts_now
from cotserve.gateway.slo_report import DEFAULT_TOKENS_PER_BYTE
from cotserve.gateway.v1 import gateway_pb2
from cotserve.worker.v1 import worker_pb2


def to_client_chunk(chunk: worker_pb2.GenerateResponse) -> gateway_pb2.GenerateStreamResponse:
    """A worker's stream chunk as the gateway's (the usage and timing of the last chunk are the observer's)."""
    out = gateway_pb2.GenerateStreamResponse(
        text=chunk.text, token_ids=chunk.token_ids, logprobs=chunk.logprobs,
        finish_reason=chunk.finish_reason, index=chunk.index, part=chunk.part, token_logprobs=chunk.token_logprobs,
    )
    if chunk.HasField("reasoning_text"):
        out.reasoning_text, out.answer_text = chunk.reasoning_text, chunk.answer_text
    if chunk.HasField("self_consistency"):
        out.self_consistency.CopyFrom(chunk.self_consistency)
    return out


class AttemptObserver:
    """One attempt of one request at one worker, from the moment it is sent (`start` is the request's arrival at the
    gateway, monotonic seconds; `held_s` how long of it the SLO predictor's BATCH hold kept the request before it
    was routed; `samples` how many batch seats it takes on the worker: its samples)."""

    def __init__(self, metrics: GatewayMetrics, slo: SloLink | None, span: Span, model: str, sla: SlaClass,
                 worker: WorkerHandle, start: float, prompt_bytes: int, max_new_tokens: int,
                 held_s: float = 0.0, samples: int = 1) -> None:
        self.m, self.slo, self.span = metrics, slo, span
        self.model, self.sla, self.worker, self.start, self.held_s = model, sla, worker, start, held_s
        self.prompt_bytes, self.max_new_tokens, self.samples = prompt_bytes, max_new_tokens, samples
        self.ttft_h, self.itl_h = metrics.ttft.labels(model, sla.name), metrics.itl.labels(model, sla.name)
        # What the latency model learns from: the worker's state as the gateway saw it when it chose this worker
        # (what it predicts from when it routes), not when the request left its admission queue (by then the
        # requests it waited behind had moved on, and the wait it spent there was in the TTFT learned from them)
        self.chosen_unix_ms = int(time.time() * 1000)
        self.at_start = counts_now(worker, sla) if slo is not None else None
        self.sent_at = self.last_at = 0.0
        self.prefill_tokens = 0  # this request's prompt tokens (estimated) while it waits for its first token
        self.first_at: float | None = None
        self.received = 0  # tokens read of its first sample: with max_new_tokens, how long it may hold its seat
        self.reasons: dict[int, str] = {}  # each sample's finish reason

    def sent(self, gateway_queue_ms: float) -> None:
        """The request leaves for the worker after `gateway_queue_ms` in this gateway's class queue."""
        self.sent_at = self.last_at = time.monotonic()
        w = self.worker
        per_byte = self.slo.recorder.tokens_per_byte_of(self.model) if self.slo is not None else DEFAULT_TOKENS_PER_BYTE
        self.prefill_tokens = max(1, round(self.prompt_bytes * per_byte))
        if not w.in_flight:  # silence counts from here, not from the last request before an idle spell
            w.last_heard = self.sent_at
        w.attempts[self] = None
        w.waiting_since[self] = self.sent_at
        w.prefill_tokens_ahead += self.prefill_tokens
        if self.slo is not None:
            self.slo.recorder.arrival(self.model, self.worker.address, self.sla)
        self.span.set_attribute("cotserve.gateway_queue_ms", gateway_queue_ms)
        self.m.queue.labels(self.model, self.sla.name).observe(gateway_queue_ms / 1000)

    def done(self) -> None:
        """The attempt is over, however it ended: the worker's slot and admission are given back."""
        self.worker.attempts.pop(self, None)
        self._prefilled()
        if self.slo is not None:
            self.slo.recorder.done(self.model, self.worker.address, self.sla)
        self.worker.admission.release(self.sla, service_ms=(time.monotonic() - self.sent_at) * 1000)

    def chunk(self, chunk: worker_pb2.GenerateResponse, out: gateway_pb2.GenerateStreamResponse, now: float) -> None:
        """A chunk read at `now` and its client form `out` (the last chunk's usage and timing are filled in here)."""
        self.worker.last_heard = now
        if chunk.index == 0:  # inter-token latency of one sample (the others arrive in the same steps)
            self.received += len(chunk.token_ids)
            if self.first_at is not None:
                self._tokens(max(1, len(chunk.token_ids)), now)
            self.last_at = now
        if self.first_at is None:
            self._first(chunk, now)
        if chunk.finish_reason:
            self.reasons[chunk.index] = finish_reason_name(chunk.finish_reason)
        if chunk.HasField("self_consistency"):
            sc = chunk.self_consistency
            self.span.set_attributes({"cotserve.vote.samples_used": sc.samples_used,
                                      "cotserve.vote.samples_cancelled": sc.samples_cancelled,
                                      "cotserve.vote.stop_reason": sc.stop_reason})
        if chunk.HasField("usage"):  # the stream's last chunk
            self._last(chunk, out, now)

    def _tokens(self, k: int, now: float) -> None:
        per_token = (now - self.last_at) / k  # a merged chunk's tokens share the wait
        self.worker.admission.observe_itl(self.sla, per_token * 1000)
        for _ in range(k):
            self.itl_h.observe(per_token)
        if self.slo is not None:
            self.slo.recorder.token(self.model, self.worker.address, self.sla, per_token * 1000)

    def _prefilled(self) -> None:
        """The request no longer waits for its first token (it has it, or the attempt ended without)."""
        if self.prefill_tokens:
            self.worker.waiting_since.pop(self, None)
            self.worker.prefill_tokens_ahead -= self.prefill_tokens
            self.prefill_tokens = 0

    def _first(self, chunk: worker_pb2.GenerateResponse, now: float) -> None:
        self.first_at = now
        self._prefilled()
        ttft_ms = (now - self.start) * 1000
        self.ttft_h.observe(now - self.start)
        if self.slo is not None:
            self.slo.recorder.first_token(self.model, self.worker.address, self.sla, ttft_ms)
        self.span.set_attributes({
            "cotserve.ttft_ms": ttft_ms,
            "cotserve.queue_ms": (self.sent_at - self.start) * 1000 + chunk.timing.queue_ms,
            "cotserve.kv_used_fraction_at_admission": chunk.timing.kv_used_fraction_at_admission,
        })

    def _last(self, chunk: worker_pb2.GenerateResponse, out: gateway_pb2.GenerateStreamResponse, now: float) -> None:
        first_at, start, usage = self.first_at or now, self.start, chunk.usage
        self.m.e2e.labels(self.model, self.sla.name).observe(now - start)
        out.usage.CopyFrom(usage)
        out.timing.queue_ms = (self.sent_at - start) * 1000 + chunk.timing.queue_ms
        out.timing.ttft_ms = (first_at - start) * 1000
        out.timing.total_ms = (now - start) * 1000
        out.timing.kv_used_fraction_at_admission = chunk.timing.kv_used_fraction_at_admission
        n_out = usage.completion_tokens
        tpot_ms = (now - first_at) * 1000 / (n_out - 1) if n_out > 1 else None
        if self.slo is not None:  # the latency model learns what a worker choice changes: the hold came before it
            self.slo.recorder.finished(self.model, self.worker.address, self.sla, self.chosen_unix_ms, self.prompt_bytes,
                              usage.prompt_tokens, self.max_new_tokens, n_out, (first_at - start - self.held_s) * 1000,
                              tpot_ms or 0.0, self.at_start)
        self.span.set_attributes({
            "cotserve.e2e_ms": out.timing.total_ms,
            **({"cotserve.tpot_ms": tpot_ms} if tpot_ms is not None else {}),
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "cotserve.cached_prompt_tokens": usage.cached_prompt_tokens,
            "cotserve.reasoning_tokens": usage.reasoning_tokens,
            "cotserve.probe_tokens": usage.probe_tokens,
            "gen_ai.response.finish_reasons": [self.reasons[i] for i in sorted(self.reasons)],
        })
