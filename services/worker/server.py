"""The worker service: config, the thin gRPC servicer, and `serve()`."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import grpc
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from cotserve.common.errors import InvalidArgument, Unavailable
from cotserve.common.metrics import MetricsServer, serve_metrics
from cotserve.common.multiplex import MultiplexCall, drain_calls
from cotserve.common.sampling import SlaClass
from cotserve.common.server import Server, ServiceSpec, run_until_signalled
from cotserve.common.streams import coalesce
from cotserve.common.tracing import make_tracer_provider
from cotserve.worker.config import WorkerConfig
from cotserve.worker.engine import Engine
from cotserve.worker.outputs import NO_TOKEN, RequestOutput
from cotserve.worker.engine_process import EngineDied, EngineProcess
from cotserve.worker.sizing import engine_config, resolve_device, set_torch_threads
from cotserve.worker.metrics import worker_registry
from cotserve.worker.moe_control import PolicyFollower
from cotserve.worker.multiplex import multiplex_call
from cotserve.worker.models.loader import DTYPES, LoadedModel, load_front, load_model
from cotserve.worker.reasoning import ReasoningFormat
from cotserve.worker.scheduler import MAX_BATCH_PAUSE_S
from cotserve.worker.sequence import TraceEvent
from cotserve.common.tools import resolve_parser
from cotserve.worker.convert import check_text_length, generate_from_pb, max_token_chars, output_to_pb
from cotserve.worker.detokenizer import TokenTexts
from cotserve.worker.utilization import UtilizationProbe
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("cotserve.worker")
INLINE_TOKENIZE_CHARS = 2048
"""Texts up to this long are tokenized on the event loop (well under a millisecond); longer ones on the
tokenizer pool, so that one long prompt never delays another request's tokens, Stats or health. The
Rust tokenizer releases the GIL while it encodes."""


class StreamInbox:
    """One request's engine outputs, on the event loop, and when its `Generate` is woken for them: only once it has
    something to write. That is `due` tokens pending (what the stream interval still holds back; 1 before the
    first token), or the request's last output (or error) — not at every engine step while the interval holds
    tokens back: a held stream woken at every step would convert one token and write nothing, a wake-up and a
    conversion per stream and step in the worker front, whose core the gateway and the clients share."""

    __slots__ = ("items", "tokens", "due", "final", "_waiter")

    def __init__(self) -> None:
        self.items: list[RequestOutput] = []
        self.tokens = 0
        self.due = 1
        self.final = False  # the request's last output (or an error) is among the items
        self._waiter: asyncio.Future | None = None

    def _ready(self) -> bool:
        return self.final or self.tokens >= self.due

    def put(self, out: RequestOutput) -> None:
        self.items.append(out)
        self.tokens += out.token_id != NO_TOKEN
        self.final = self.final or out.is_last or out.error is not None
        if self._waiter is not None and not self._waiter.done() and self._ready():
            self._waiter.set_result(None)

    async def take(self, due: int) -> list[RequestOutput]:
        """Every output pending, once `due` tokens are (or the last output is)."""
        self.due = due
        if not self._ready():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self.items, self.tokens, self.final = self.items, [], 0, False
        return items


class LoopMailbox:
    """Hands engine outputs to the requests' inboxes with one loop wake-up per batch, not per token.

    The engine thread calls `put` for each output of a step; the first schedules a flush on the
    loop and the rest ride along, so 32 streams cost one cross-thread wake-up per step.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[StreamInbox, RequestOutput]] = []
        self._scheduled = False

    def put(self, queue: StreamInbox, out: RequestOutput) -> None:
        with self._lock:
            self._items.append((queue, out))
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, out in items:
            queue.put(out)


_NEXT_PHASE: dict[TraceEvent, str | None] = {TraceEvent.SCHEDULED: "prefill", TraceEvent.FIRST_TOKEN: "decode",
                                             TraceEvent.PREEMPTED: "queue", TraceEvent.FINISHED: None}
"""The phase span an engine event starts (None: the last one ends)."""


class _PhaseSpans:
    """Child spans of a worker request, built from the engine's event timestamps: `queue` (arrival
    to scheduled; again after each preemption), `prefill` (scheduled to first token) and `decode`
    (first token to finished; a recompute after preemption is part of it). A phase still open when
    the request ends is closed then."""

    def __init__(self, tracer: trace.Tracer, parent: trace.Span, arrival_ns: int) -> None:
        self.tracer, self.parent, self.ctx = tracer, parent, trace.set_span_in_context(parent)
        self.preemptions, self.decoding = 0, False
        self.current: trace.Span | None = self._start("queue", arrival_ns)

    def _start(self, name: str, ts: int) -> trace.Span:
        return self.tracer.start_span(name, context=self.ctx, start_time=ts)

    def record(self, out: RequestOutput) -> None:
        """An engine output's events, on the request span and as phase boundaries."""
        for event, ts in out.events:
            self.parent.add_event(str(event), timestamp=ts)
            self.on_event(event, ts)
        if out.timing is not None:
            self.parent.set_attribute("cotserve.kv_used_fraction_at_admission", out.timing.kv_used_fraction_at_admission)

    def on_event(self, event: TraceEvent, ts: int) -> None:
        nxt = _NEXT_PHASE.get(event, "")
        if nxt == "":
            return
        if event == TraceEvent.PREEMPTED:
            self.preemptions += 1
        elif event == TraceEvent.FIRST_TOKEN:
            self.decoding = True
        elif event == TraceEvent.SCHEDULED and self.decoding:
            nxt = "decode"  # back after a preemption: the recompute is folded into decode
        if self.current is not None:
            self.current.end(end_time=ts)
        self.current = self._start(nxt, ts) if nxt else None

    def close(self, ts: int) -> None:
        if self.current is not None:
            self.current.end(end_time=ts)
            self.current = None


class _Held:
    """A stream's messages produced and not yet written: held until `interval` tokens are (the worker's
    --stream-interval); the first token and the stream's end go out at once.

    `phase` (1..interval) is how many tokens the first held message waits for; every later one waits `interval`.
    The servicer deals phases round-robin, so that streams which started together (a wave of BATCH) do not all
    write in the same step every `interval` steps: their messages spread evenly over the steps, and an urgent
    stream's token never queues behind a burst of them in this process, the gateway and the clients."""

    def __init__(self, interval: int, phase: int | None = None) -> None:
        self.interval = interval
        self.due = interval if phase is None else max(1, min(phase, interval))
        self.messages: list[worker_pb2.GenerateResponse] = []
        self.tokens = 0
        self.written = False

    def add(self, message: worker_pb2.GenerateResponse) -> None:
        self.messages.append(message)
        self.tokens += len(message.token_ids)

    def tokens_due(self) -> int:
        """Tokens still to come before `take` writes (1 before the first token is written)."""
        return max(1, self.due - self.tokens) if self.written else 1

    def take(self, finished: bool) -> list[worker_pb2.GenerateResponse]:
        """What to write now, merged (common/streams.coalesce): nothing while the interval holds it back."""
        if not (finished or not self.written or self.tokens >= self.due):
            return []
        out = coalesce(self.messages)
        if self.written and self.tokens:
            self.due = self.interval
        self.written = self.written or self.tokens > 0
        self.messages, self.tokens = [], 0
        return out


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Thin: converts at the edge and hands the request to the engine."""

    def __init__(self, tracer_provider: TracerProvider | None = None, stream_interval: int = 1,
                 batch_stream_interval: int = 1, stream_stagger: bool = True) -> None:
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer("cotserve.worker")
        self.tool_call_parser = ""  # how the model writes tool calls ("": tools are refused), set by `attach`
        self.stream_interval = stream_interval  # WorkerConfig.stream_interval
        self.batch_stream_interval = max(stream_interval, batch_stream_interval)  # WorkerConfig.batch_stream_interval
        self._engine: Engine | None = None
        self._loaded: LoadedModel | None = None
        self._mailbox: LoopMailbox | None = None
        self._probe: UtilizationProbe | None = None
        self._block_bytes = 0  # KV bytes per block, known once the model is loaded
        self._token_chars = 1  # characters of the longest token, known once the model is loaded
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cotserve-tokenize")
        self._phases = itertools.count() if stream_stagger else None  # _Held's phases, dealt round-robin
        self._traced = tracer_provider is not None
        self.mux_calls: set[MultiplexCall] = set()  # the Multiplex calls open now (each adds and removes itself)
        self.draining = False

    def attach(self, engine: Engine | EngineProcess, loaded: LoadedModel, tool_call_parser: str = "auto") -> None:
        """Called once the model is loaded; until then every RPC is UNAVAILABLE. `tool_call_parser` is
        `--tool-call-parser`."""
        self._engine, self._loaded = engine, loaded
        template = loaded.chat_template
        self.tool_call_parser = resolve_parser(tool_call_parser, template.source if template is not None else None)
        self._token_chars = max_token_chars(loaded.tokenizer)
        self._token_texts = TokenTexts(loaded.tokenizer)
        pid = getattr(engine, "pid", None)
        self._probe = UtilizationProbe(str(loaded.device), pids=(pid,) if pid else ())
        self._block_bytes = engine.kv_spec.bytes_per_block

    @property
    def engine(self) -> Engine | EngineProcess:
        if self._engine is None:
            raise Unavailable("the worker is still loading its model")
        dead = getattr(self._engine, "dead", None)
        if dead is not None:
            raise Unavailable(f"engine: {dead}")
        return self._engine

    @property
    def loaded(self) -> LoadedModel:
        if self._loaded is None:
            raise Unavailable("the worker is still loading its model")
        return self._loaded

    async def _submit(self, request: worker_pb2.GenerateRequest, request_id: str):
        """Tokenize (off the event loop for a long prompt) and hand the request to the engine; the converted call
        and the inbox its outputs arrive in."""
        args = (request, self.loaded.tokenizer, self.loaded.config.vocab_size, self.engine.config.max_model_len,
                self.engine.reasoning, self._token_chars, self.loaded.chat_template, self.tool_call_parser)
        if len(request.prompt_text) + sum(len(m.content) for m in request.messages) <= INLINE_TOKENIZE_CHARS:
            call = generate_from_pb(*args)
        else:
            call = await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, generate_from_pb, *args)
        if self._mailbox is None:
            self._mailbox = LoopMailbox(asyncio.get_running_loop())
        mailbox = self._mailbox
        outputs = StreamInbox()

        def sink(out: RequestOutput) -> None:
            mailbox.put(outputs, out)

        try:
            self.engine.submit(request_id, call.prompt_ids, call.params, sink, call.sla_class, call.cache_salt, call.budget,
                               tenant=call.tenant)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        except EngineDied as exc:
            raise Unavailable(f"engine: {exc}") from None
        return call, outputs

    def _annotate_first(self, call, request_id: str) -> trace.Span:
        """The gRPC server span (child of the caller's, the gateway's), named and given what was asked."""
        span = trace.get_current_span()
        span.update_name(f"generate {self.loaded.name}")
        span.set_attributes({
            "gen_ai.operation.name": "text_completion", "gen_ai.request.model": self.loaded.name,
            "gen_ai.request.max_tokens": call.params.max_new_tokens, "gen_ai.request.temperature": call.params.temperature,
            "gen_ai.usage.input_tokens": len(call.prompt_ids), "cotserve.request_id": request_id, "cotserve.n": call.params.n,
            "cotserve.sla_class": call.sla_class.name, "cotserve.model_revision": self.loaded.revision,
        })
        return span

    async def Multiplex(self, requests: AsyncIterator[worker_pb2.MultiplexRequest], context: grpc.aio.ServicerContext) -> None:
        await multiplex_call(self, context, self.tracer if self._traced else None).serve(requests)

    def drain(self) -> None:
        """The server is stopping: Multiplex calls refuse new streams (UNAVAILABLE, so the gateway sends them to
        another worker) and end once the streams they carry have."""
        drain_calls(self)

    async def Generate(self, request: worker_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext | None) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """One stream's messages; the request span is the current span (gRPC's, or a Multiplex stream's), and
        `context` is not used (a Multiplex stream has none)."""
        request_id = request.request_id or uuid.uuid4().hex
        arrival_ns = time.time_ns()  # before submit: the engine process may schedule it before this coroutine goes on
        call, outputs = await self._submit(request, request_id)
        span = self._annotate_first(call, request_id)
        finished = False
        reasons: dict[int, str] = {}  # finish reason per sample
        phases = _PhaseSpans(self.tracer, span, arrival_ns)
        interval = self.batch_stream_interval if call.sla_class == SlaClass.BATCH else self.stream_interval
        held = _Held(interval, None if self._phases is None else 1 + next(self._phases) % interval)
        try:
            while not finished:
                # everything the engine produced since the last write: one message per sample and part when this
                # stream's reader fell behind or the interval held tokens back (common/streams), one per token otherwise
                pending = await outputs.take(held.tokens_due())
                failure: str | None = None
                for out in pending:
                    phases.record(out)
                    if out.error is not None:
                        failure, finished = out.error, True
                        break
                    if out.finish_reason is not None:
                        reasons[out.index] = out.finish_reason
                    held.add(output_to_pb(out, self._token_texts))
                    if out.is_last:
                        finished = True
                        self._annotate_last(span, out, reasons, phases.preemptions)
                        break
                for message in held.take(finished):
                    yield message
                if failure is not None:  # (the tokens produced before it went out first)
                    raise Unavailable(f"request {request_id} failed: {failure}")
        finally:
            phases.close(time.time_ns())
            if not finished and self._engine is not None:  # cancelled by the client, deadline, or server shutdown
                self._engine.abort(request_id)  # (a dead engine's front forgets the request; nothing to raise)

    @staticmethod
    def _annotate_last(span: trace.Span, out: RequestOutput, reasons: dict[int, str], preemptions: int) -> None:
        """The request span's summary, from the request's last output."""
        span.set_attributes({"gen_ai.usage.output_tokens": out.completion_tokens,
                             "gen_ai.response.finish_reasons": [reasons[i] for i in sorted(reasons)],
                             "cotserve.cached_prompt_tokens": out.cached_prompt_tokens,
                             "cotserve.reasoning_tokens": out.reasoning_tokens,
                             "cotserve.probe_tokens": out.probe_tokens,
                             "cotserve.early_exits": out.early_exits,
                             "cotserve.preemptions": preemptions})
        if out.vote is not None:
            span.set_attributes({"cotserve.vote.samples_used": out.vote.samples_used,
                                 "cotserve.vote.samples_cancelled": out.vote.samples_cancelled,
                                 "cotserve.vote.samples_saved": out.vote.samples_saved,
                                 "cotserve.vote.stop_reason": out.vote.stop_reason})

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.InfoResponse:
        lm, ec = self.loaded, self.engine.config
        return worker_pb2.InfoResponse(
            model_name=lm.name, model_aliases=lm.aliases, model_revision=lm.revision, architecture=lm.config.architecture,
            dtype=str(lm.dtype).removeprefix("torch."), vocab_size=lm.config.vocab_size,
            max_context_tokens=ec.max_model_len, max_num_seqs=ec.max_num_seqs, device=str(lm.device),
            num_experts=lm.config.num_experts, num_experts_per_tok=lm.config.num_experts_per_tok,
            max_token_chars=self._token_chars,
            reasoning_start=self.engine.reasoning.text_markers[0] if self.engine.reasoning else "",
            reasoning_end=self.engine.reasoning.text_markers[1] if self.engine.reasoning else "",
            tool_call_parser=self.tool_call_parser,
            kv_cache=worker_pb2.KvCacheInfo(
                dtype=self.engine.kv_spec.dtype_name, block_size_tokens=ec.block_size,
                total_blocks=ec.num_blocks, bytes_per_token=self.engine.kv_spec.bytes_per_token,
            ),
        )

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> worker_pb2.StatsResponse:
        s = self.engine.stats()
        util, is_cpu, memory = self._probe.read() if self._probe is not None else (0.0, True, 0)
        return worker_pb2.StatsResponse(
            utilization=util, utilization_is_cpu=is_cpu, memory_used_bytes=memory,
            num_running_seqs=s.num_running_seqs, num_waiting_seqs=s.num_waiting_seqs,
            kv_blocks_used=s.kv_blocks_used, kv_blocks_free=s.kv_blocks_free,
            step_latency_p50_ms=s.step_latency_p50_ms, step_latency_p95_ms=s.step_latency_p95_ms,
            generated_tokens_per_s=s.generated_tokens_per_s, num_preemptions_total=s.num_preemptions_total,
            num_requests_finished_total=s.num_requests_finished_total, num_waiting_urgent_seqs=s.num_waiting_urgent_seqs,
            moe_policy_version=s.moe_policy_version, kv_bytes_used=s.kv_blocks_used * self._block_bytes,
            kv_bytes_total=(s.kv_blocks_used + s.kv_blocks_free) * self._block_bytes,
            prefix_cache_queried_tokens_total=s.prefix_cache_queried_tokens, prefix_cache_hit_tokens_total=s.prefix_cache_hit_tokens,
            prefix_cache_blocks=s.prefix_cache_blocks, prefix_cache_evictions_total=s.prefix_cache_evictions,
            prompt_tokens_computed_total=s.num_prompt_tokens_computed_total, kv_blocks_used_peak=s.kv_blocks_used_peak,
            reasoning_tokens_total=s.num_reasoning_tokens_total, probe_tokens_total=s.num_probe_tokens_total,
            early_exits_total=s.num_early_exits_total, thinking_tokens_saved_total=s.num_thinking_tokens_saved_total,
            vote_samples_used_total=s.num_vote_samples_used_total, vote_samples_saved_total=s.num_vote_samples_saved_total,
            kernels_ready=s.kernels_ready, batch_paused_steps_total=s.num_batch_paused_steps_total,
        )

    async def PauseBatch(self, request: worker_pb2.PauseBatchRequest, context: grpc.aio.ServicerContext) -> worker_pb2.PauseBatchResponse:
        if request.duration_ms > MAX_BATCH_PAUSE_S * 1000:
            raise InvalidArgument(f"duration_ms: {request.duration_ms}, allowed 0..{MAX_BATCH_PAUSE_S * 1000:.0f}")
        try:
            self.engine.pause_batch(request.duration_ms / 1000)
        except EngineDied as exc:
            raise Unavailable(str(exc)) from None
        return worker_pb2.PauseBatchResponse()

    async def Tokenize(self, request: worker_pb2.TokenizeRequest, context: grpc.aio.ServicerContext) -> worker_pb2.TokenizeResponse:
        tokenizer = self.loaded.tokenizer
        check_text_length(request.text, "text", self.engine.config.max_model_len, self._token_chars)
        if len(request.text) <= INLINE_TOKENIZE_CHARS:
            enc = tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        else:
            enc = await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, functools.partial(tokenizer.encode, request.text, add_special_tokens=request.add_special_tokens))
        return worker_pb2.TokenizeResponse(token_ids=enc.ids, tokens=enc.tokens)


@dataclass(slots=True)
class RunningWorker:
    server: Server
    engine: Engine | EngineProcess
    loaded: LoadedModel
    servicer: "WorkerServicer"
    metrics_server: MetricsServer | None = None
    follower: PolicyFollower | None = None

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.server.stop(grace_s)
        await self.close()

    async def close(self) -> None:
        """Everything but the gRPC server: the policy follower, the engine, metrics."""
        if self.follower is not None:
            await self.follower.stop()
        self.engine.stop()
        self.servicer._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if self.metrics_server is not None:
            self.metrics_server.stop()


async def _make_engine(cfg: WorkerConfig, engine_died: Callable[[str], None]) -> tuple[Engine | EngineProcess, LoadedModel]:
    """The engine: in its own process (the front loads only the config and tokenizer), or on a thread here."""
    reasoning_markers = (cfg.reasoning_start, cfg.reasoning_end, cfg.reasoning_step, cfg.answer_regex, cfg.reasoning_parser)
    if cfg.engine_process:
        loaded = await asyncio.to_thread(lambda: load_front(cfg.model, **cfg.model_names))
        reasoning = ReasoningFormat.for_tokenizer(loaded.tokenizer, *reasoning_markers)
        engine = EngineProcess(cfg, reasoning, on_death=engine_died)
        await asyncio.to_thread(engine.start)
        loaded.revision, loaded.dtype, loaded.device = engine.revision, engine.dtype, torch.device(engine.device)
        engine.loaded = loaded
        return engine, loaded
    device = resolve_device(cfg.device)
    dtype = None if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    loaded = await asyncio.to_thread(lambda: load_model(cfg.model, device=device, dtype=dtype, **cfg.model_names))
    reasoning = ReasoningFormat.for_tokenizer(loaded.tokenizer, *reasoning_markers)
    return Engine(loaded, engine_config(cfg, loaded), reasoning), loaded


async def start_worker(cfg: WorkerConfig, tracer_provider: TracerProvider | None = None,
                       on_engine_death: Callable[[str], None] | None = None) -> RunningWorker:
    """Bind first (health NOT_SERVING), load the model, start the engine, then SERVING. If the engine process
    dies, health turns NOT_SERVING (in-flight calls fail with the reason) and `on_engine_death` is called."""
    cfg.validate()
    set_torch_threads(cfg, resolve_device(cfg.device))
    servicer = WorkerServicer(tracer_provider, cfg.stream_interval, cfg.batch_stream_interval, cfg.stream_stagger)
    spec = ServiceSpec("cotserve.worker.v1.WorkerService",
                       lambda srv: worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, srv))
    server = Server([spec], cfg.host, cfg.port, tracer_provider, tls=cfg)
    server.on_stop.append(servicer.drain)
    await server.start()
    log.info("worker listening on %s, loading %s", server.address, cfg.model)
    loop = asyncio.get_running_loop()

    def engine_died(reason: str) -> None:  # on the engine reader's thread
        def now() -> None:
            log.error("NOT_SERVING: %s", reason)
            asyncio.ensure_future(server.set_not_serving())
            if on_engine_death is not None:
                on_engine_death(reason)
        loop.call_soon_threadsafe(now)

    try:
        engine, loaded = await _make_engine(cfg, engine_died)
    except BaseException:
        await server.stop(0)
        raise
    econfig = engine.config
    try:
        metrics_server = serve_metrics(worker_registry(engine.stats, loaded.name, econfig.num_blocks), cfg.host,
                                       cfg.metrics_port)
    except OSError:
        engine.stop()
        await server.stop(0)
        raise
    if isinstance(engine, Engine):
        engine.start()
    follower = None
    if loaded.config.num_experts and cfg.redis_url:
        follower = PolicyFollower(cfg.redis_url, engine, loaded.name, cfg.worker_id or server.address, tracer_provider)
        await follower.start()  # the current policy is in force before the first request
    servicer.attach(engine, loaded, cfg.tool_call_parser)
    await server.set_serving()
    log.info("SERVING %s (rev %s) on %s: %s, %d KV blocks x %d tokens, context %d, %s scheduling, prefix cache %s, %s",
             loaded.name, loaded.revision, server.address, loaded.dtype, econfig.num_blocks, econfig.block_size,
             econfig.max_model_len, econfig.scheduling, "on" if econfig.enable_prefix_caching else "off", engine.kernels)
    return RunningWorker(server, engine, loaded, servicer, metrics_server, follower)


async def serve(cfg: WorkerConfig) -> None:
    """Run a worker until SIGTERM/SIGINT, then drain in-flight streams for up to `cfg.grace_s`. A worker whose
    engine process died stops itself a second later (NOT_SERVING meanwhile), so that its supervisor restarts it."""
    def exit_soon(reason: str) -> None:
        asyncio.get_running_loop().call_later(1.0, os.kill, os.getpid(), signal.SIGTERM)

    worker = await start_worker(cfg, make_tracer_provider("cotserve-worker"), on_engine_death=exit_soon)
    await run_until_signalled(worker.server, cfg.grace_s, on_stop=worker.close)
