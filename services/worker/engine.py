"""The engine: schedule -> run -> sample -> postprocess, on its own thread.

`submit` and `abort` are thread-safe and return at once; they queue work that the engine thread
applies between two steps. Each request's outputs go to the `sink` it was submitted with, called
on the engine thread (the servicer's sink hops onto its asyncio loop).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from cotserve.worker.block_manager import BlockManager
from cotserve.worker.detokenizer import IncrementalDetokenizer
from cotserve.worker.model_runner import ModelRunner, resolve_kv_dtype
from cotserve.worker.models.loader import LoadedModel
from cotserve.worker.models.moe import RoutingPolicy
from cotserve.worker.sampler import Sampler
from cotserve.worker.scheduler import ScheduledBatch, Scheduler
from cotserve.worker.sequence import SamplingParams, Sequence, SequenceStatus, SlaClass

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class EngineConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    batch_min_share: float = 0.1
    scheduling: str = "priority"  # or "fifo": arrival order, classes ignored (a baseline)
    max_batch_tokens_when_urgent: int = 256
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), fp8_e4m3, fp16, bf16 or fp32
    kv_topk_pages: int = 0  # decode reads this many pages per KV head, chosen by a query-aware bound (0: all)
    kv_skip_layers: tuple[int, ...] = ()  # with fp8_e4m3: these layers keep the model's dtype
    kv_topk_dense_layers: tuple[int, ...] = ()  # with kv_topk_pages: these layers read every page


@dataclass(slots=True, frozen=True)
class Timing:
    queue_ms: float
    ttft_ms: float
    total_ms: float
    kv_used_fraction_at_admission: float = 0.0


@dataclass(slots=True, frozen=True)
class RequestOutput:
    """One generated token of one request. `finish_reason` is set on the last ("stop"/"length")."""

    request_id: str
    token_id: int
    text: str
    logprob: float | None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timing: Timing | None = None
    error: str | None = None  # set when the request failed inside the engine
    events: tuple[tuple[str, int], ...] = ()  # engine events since the previous output: (name, wall ns)


Sink = Callable[[RequestOutput], None]


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    step_latency_p50_ms: float = 0.0
    step_latency_p95_ms: float = 0.0
    generated_tokens_per_s: float = 0.0
    num_preemptions_total: int = 0
    num_requests_finished_total: int = 0
    num_waiting_urgent_seqs: int = 0
    num_generated_tokens_total: int = 0
    moe_policy_version: int = 0


@dataclass(slots=True, eq=False)
class _Request:
    seq: Sequence
    sink: Sink
    detok: IncrementalDetokenizer
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    num_events_sent: int = 0

    def new_events(self) -> tuple[tuple[str, int], ...]:
        events = tuple(self.seq.events[self.num_events_sent :])
        self.num_events_sent = len(self.seq.events)
        return events


def _percentile(ordered: list[float], q: float) -> float:
    """`q`-quantile of already sorted values (0.0 when there are none)."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.batch_min_share, by_class=config.scheduling == "priority",
                                   max_batch_tokens_when_urgent=config.max_batch_tokens_when_urgent)
        self.runner = ModelRunner(loaded, config.num_blocks, config.block_size, resolve_kv_dtype(config.kv_cache_dtype, loaded.dtype),
                                  config.kv_topk_pages, frozenset(config.kv_skip_layers), frozenset(config.kv_topk_dense_layers))
        self.sampler = Sampler(loaded.device)
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._requests: dict[str, _Request] = {}
        self._step_ms: deque[float] = deque(maxlen=256)
        self._tokens: deque[tuple[float, int]] = deque()
        self._finished_total = 0
        self._generated_total = 0
        self.policy_version = 0
        self.policy_listeners: list[Callable[[int], None]] = []  # called on the engine thread after each apply
        self._stats = EngineStats(kv_blocks_free=config.num_blocks)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ---- thread-safe API -------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink,
               sla_class: SlaClass = SlaClass.INTERACTIVE) -> None:
        """Queue a validated request. Raises ValueError when it can never fit the KV pool."""
        seq = Sequence(request_id, list(prompt_ids), params, sla_class)
        if not self.scheduler.can_ever_fit(seq):
            raise ValueError(
                f"prompt_tokens + max_new_tokens = {seq.max_len} exceeds the KV cache "
                f"({self.scheduler.capacity_tokens} tokens)"
            )
        self._inbox.put(("add", (seq, sink)))

    def set_routing_policy(self, policy: RoutingPolicy) -> None:
        """Queue a routing policy; the engine thread applies it to all layers together between two
        steps, and only when it is newer than the one in force."""
        self._inbox.put(("policy", policy))

    def request_expert_load(self, callback: Callable[[dict[int, list[int]]], None]) -> None:
        """Ask for the tokens routed per expert since the last ask; `callback` runs on the engine thread."""
        self._inbox.put(("load", callback))

    def abort(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are freed before the next step."""
        self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="cotserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._drain_inbox(block=not self.scheduler.has_work())
            if self.scheduler.has_work():
                self.step()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                self._add(*payload)  # type: ignore[misc]
            elif kind == "abort":
                self._abort(payload)  # type: ignore[arg-type]
            elif kind == "policy":
                self._apply_policy(payload)  # type: ignore[arg-type]
            elif kind == "load":
                payload(self.loaded.model.take_expert_load())  # type: ignore[operator]
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply_policy(self, policy: RoutingPolicy) -> None:
        if policy.version <= self.policy_version:
            log.info("routing policy v%d ignored: v%d is in force", policy.version, self.policy_version)
            return
        self.loaded.model.set_routing_policy(policy)
        self.policy_version = policy.version
        self._publish_stats()
        for listener in tuple(self.policy_listeners):  # a snapshot: listeners may be added meanwhile
            listener(policy.version)

    def _add(self, seq: Sequence, sink: Sink) -> None:
        if seq.request_id in self._requests:
            sink(RequestOutput(seq.request_id, 0, "", None, error=f"request_id {seq.request_id!r} is already running"))
            return
        p = seq.params
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.loaded.eos_token_ids)
        detok = IncrementalDetokenizer(self.loaded.tokenizer, seq.prompt_ids, p.stop)
        self._requests[seq.request_id] = _Request(seq, sink, detok, stop_ids)
        self.scheduler.add(seq)

    def _abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.abort(req.seq)
            self.sampler.forget(req.seq.seq_id)
            self._finished_total += 1
            self._publish_stats()

    def step(self) -> None:
        """One iteration for the whole batch. A failure fails that batch's requests, not the engine."""
        start = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch:
            time.sleep(0.001)  # nothing fits right now (cannot persist: running work frees blocks)
            self._publish_stats()
            return
        for item in batch.items:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = start
        try:
            logits = self.runner.execute(batch)
            sampling = [i.seq for i in batch.items if i.samples]
            result = self.sampler.sample(logits, [s.seq_id for s in sampling], [s.params for s in sampling])
        except Exception as exc:  # noqa: BLE001 - the engine must keep serving other requests
            log.exception("engine step failed; failing %d requests", len(batch.items))
            for item in batch.items:
                self._fail(item.seq, f"engine step failed: {exc}")
            self._publish_stats()
            return
        self._postprocess(batch, result.token_ids, result.logprobs)
        now = time.monotonic()
        self._step_ms.append((now - start) * 1000)
        self._publish_stats()

    def _postprocess(self, batch: ScheduledBatch, token_ids: list[int], logprobs: list[float | None]) -> None:
        now = time.monotonic()
        k = 0
        generated = 0
        for item in batch.items:
            seq = item.seq
            samples = item.samples
            seq.num_computed_tokens += item.num_tokens
            if not samples:
                continue
            token, lp = token_ids[k], logprobs[k]
            k += 1
            generated += 1
            seq.output_ids.append(token)
            if lp is not None:
                seq.output_logprobs.append(lp)
            if seq.first_token_time is None:
                seq.first_token_time = now
                seq.record("first_token")
            self._emit(seq, token, lp, now)
        self._tokens.append((now, generated))
        self._generated_total += generated

    def _emit(self, seq: Sequence, token: int, logprob: float | None, now: float) -> None:
        req = self._requests[seq.request_id]
        finish: str | None = None
        if token in req.stop_ids:
            finish, text = "stop", ""
        else:
            text = req.detok.add_token(token)
            if req.detok.stopped_by_string:
                finish = "stop"
            elif len(seq.output_ids) >= seq.params.max_new_tokens or len(seq) >= self.config.max_model_len:
                finish = "length"
        if finish is None:
            first = self._timing(seq) if len(seq.output_ids) == 1 else None
            req.sink(RequestOutput(seq.request_id, token, text, logprob, timing=first, events=req.new_events()))
            return
        text += req.detok.flush()
        self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED if finish == "stop" else SequenceStatus.FINISHED_LENGTH)
        self.sampler.forget(seq.seq_id)
        del self._requests[seq.request_id]
        self._finished_total += 1
        seq.finish_time = now
        seq.record("finished")
        req.sink(RequestOutput(
            seq.request_id, token, text, logprob, finish_reason=finish,
            prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids), timing=self._timing(seq),
            events=req.new_events(),
        ))

    @staticmethod
    def _timing(seq: Sequence) -> Timing:
        def ms(t: float | None) -> float:
            return 0.0 if t is None else (t - seq.arrival_time) * 1000

        return Timing(queue_ms=ms(seq.first_scheduled_time), ttft_ms=ms(seq.first_token_time), total_ms=ms(seq.finish_time),
                      kv_used_fraction_at_admission=seq.kv_used_fraction_at_admission)

    def _fail(self, seq: Sequence, message: str) -> None:
        req = self._requests.pop(seq.request_id, None)
        if not seq.is_finished:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
        self.sampler.forget(seq.seq_id)
        self._finished_total += 1
        if req is not None:
            req.sink(RequestOutput(seq.request_id, 0, "", None, error=message))

    def _publish_stats(self) -> None:
        now = time.monotonic()
        while self._tokens and now - self._tokens[0][0] > 10.0:
            self._tokens.popleft()
        span = max(1e-3, now - self._tokens[0][0]) if len(self._tokens) > 1 else 1.0
        steps = sorted(self._step_ms)  # sorted once for both percentiles
        self._stats = EngineStats(
            num_running_seqs=len(self.scheduler.running),
            num_waiting_seqs=len(self.scheduler.waiting),
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_free=self.block_manager.num_free_blocks,
            step_latency_p50_ms=_percentile(steps, 0.5),
            step_latency_p95_ms=_percentile(steps, 0.95),
            generated_tokens_per_s=sum(n for _, n in self._tokens) / span if self._tokens else 0.0,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_requests_finished_total=self._finished_total,
            num_generated_tokens_total=self._generated_total,
            moe_policy_version=self.policy_version,
            num_waiting_urgent_seqs=sum(1 for s in self.scheduler.waiting if s.sla_class != SlaClass.BATCH),
        )
