"""The gateway's one relay: what happens to a request between the edge that received it and the worker that
serves it. The gRPC servicer (`gateway/server.py`) and the OpenAI HTTP API (`gateway/http.py`) both hand their
requests here as a `GenerateStreamRequest` and read `GenerateStreamResponse` chunks back. Every check on the way is a
rule of the admission chain (`rules.py`); the relay validates, picks workers, streams, and retries once."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from cotserve.common.chat import template_kwargs
from cotserve.common.errors import CotserveError, FailedPrecondition, InvalidArgument, RelayedError, Unavailable
from cotserve.common.sampling import check_self_consistency, max_new_tokens_of, reasoning_from_pb, sampling_from_pb, sla_from_pb
from cotserve.common.streams import coalesce
from cotserve.common.tools import tools_from_pb
from cotserve.common.v1 import common_pb2
from cotserve.gateway.metrics import GatewayMetrics
from cotserve.gateway.observer import AttemptObserver, to_client_chunk
from cotserve.gateway.pool import WorkerHandle, WorkerPool
from cotserve.gateway.processors import Processors
from cotserve.gateway.rules import Call, Chain, RequestContext, Stage, prompt_text
from cotserve.gateway.slo_link import SloLink
from cotserve.gateway.tenants import Tenant, TenantRegistry
from cotserve.gateway.tool_calls import ToolCalls
from cotserve.gateway.v1 import gateway_pb2
from cotserve.worker.v1 import worker_pb2

log = logging.getLogger("cotserve.gateway")
MAX_CACHE_SALT_CHARS = 256
MAX_ROLE_CHARS = 64  # a chat turn's role: system, user, assistant, tool, or another name the model's template knows


def samples_of(request: worker_pb2.GenerateRequest) -> int:
    """The most samples `request` may run at once: self-consistency's max_samples, else n (at least 1)."""
    if request.reasoning.HasField("self_consistency"):
        return max(1, request.reasoning.self_consistency.max_samples)
    return max(1, request.sampling.n)


class Relay:
    """One request's way through the gateway, whichever edge received it (gRPC or HTTP): the caller's rules, validation,
    the request's rules (`chain`), then per attempt a worker picked, the worker's rules and the stream, with one retry;
    each chunk relayed, the post-processor on each sample's text. `call` is the edge's view of the request: its
    metadata (`invocation_metadata()`) and its deadline (`time_remaining()`), as a grpc.aio servicer context has them."""

    def __init__(self, pool: WorkerPool, metrics: GatewayMetrics, chain: Chain, tenants: TenantRegistry | None = None,
                 processors: Processors | None = None, tracer_provider: TracerProvider | None = None,
                 slo: SloLink | None = None, prefix_cache_scope: str = "tenant", max_prompt_chars: int = 0,
                 max_prompt_tokens: int = 0, worker_wait_s: float = 0.0) -> None:
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer("cotserve.gateway")
        self.pool, self.metrics, self.chain, self.slo = pool, metrics, chain, slo
        self.tenants = tenants or TenantRegistry.open()
        self.processors = processors or Processors(None)
        self.prefix_cache_scope = prefix_cache_scope
        self.max_prompt_chars = max_prompt_chars
        self.max_prompt_tokens = max_prompt_tokens
        self.worker_wait_s = worker_wait_s

    def authenticate(self, call: Call) -> Tenant:
        """The caller's tenant, for the calls that are not requests (ListModels, Tokenize)."""
        return self.tenants.authenticate(call.invocation_metadata() or ())

    def _cache_salt(self, tenant: Tenant, request_salt: str) -> str:
        """The worker's prefix-cache partition: the tenant (scope `tenant`) narrowed by the
        request's own salt. A request's salt never widens sharing across tenants."""
        if len(request_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidArgument(f"cache_salt: {len(request_salt)} characters, at most {MAX_CACHE_SALT_CHARS} allowed")
        if self.prefix_cache_scope == "global":
            return request_salt
        return f"tenant:{tenant.name}\x00{request_salt}"

    async def counted(self, request, call: Call) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        """The request relayed, counted in `cotserve_gateway_requests_total` by final status: labelled with the
        served model's name once it is resolved (never with what a caller typed: "unknown" until then), and as
        CANCELLED when its reader stops reading before its end."""
        labels = {"model": "unknown", "sla_class": "UNKNOWN", "tenant": "default"}
        ctx = RequestContext(call, request)
        code = "OK"
        try:
            await self.chain.admit(Stage.CALLER, ctx)
            labels["tenant"] = ctx.tenant.name
            async for chunk in self._relay(ctx, labels):
                yield chunk
        except CotserveError as exc:
            code = exc.code
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code = "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            self.metrics.requests.labels(labels["model"], labels["sla_class"], code, labels["tenant"]).inc()

    def _validate(self, ctx: RequestContext, labels: dict[str, str]) -> None:
        """Validate at the edge and fill in the context's request fields; the worker re-checks what needs its
        tokenizer (prompt length). `labels` (metrics) learn the model and class as soon as each is known."""
        request = ctx.request
        sla = sla_from_pb(request.sla_class)
        labels["sla_class"] = sla.name
        model = self.pool.resolve_model(request.model)
        labels["model"] = model
        if bool(request.prompt) == bool(request.messages):
            raise InvalidArgument("prompt / messages: give exactly one (the prompt text, or chat messages for the "
                                  "model's chat template)")
        if request.messages and request.pre_processor:
            raise InvalidArgument("pre_processor: runs on a prompt's text; chat messages cannot take one")
        for i, m in enumerate(request.messages):
            if not 1 <= len(m.role) <= MAX_ROLE_CHARS:
                raise InvalidArgument(f"messages[{i}].role: {len(m.role)} characters, allowed 1..{MAX_ROLE_CHARS}")
        field, text = ("prompt", request.prompt) if request.prompt else ("messages", prompt_text(request))
        info = next(w.info for w in self.pool.models()[model])
        max_chars = self.max_prompt_chars or info.max_context_tokens * max(1, info.max_token_chars or 64)
        if len(text) > max_chars:
            why = "the limit" if self.max_prompt_chars else f"what model {model!r}'s context can hold"
            raise InvalidArgument(f"{field}: {len(text)} characters, at most {max_chars} allowed ({why})")
        params = sampling_from_pb(request.sampling, vocab_size=info.vocab_size, max_model_len=info.max_context_tokens,
                                  max_new_tokens_limit=info.max_context_tokens)
        wreq = worker_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex, prompt_text=request.prompt, messages=request.messages, sampling=request.sampling,
            sla_class=request.sla_class,
            max_prompt_tokens=self.max_prompt_tokens,
        )
        if request.HasField("chat_template_kwargs"):
            if not request.messages:
                raise InvalidArgument("chat_template_kwargs: only with messages (a prompt is not rendered by a template)")
            template_kwargs(request.chat_template_kwargs)
            wreq.chat_template_kwargs.CopyFrom(request.chat_template_kwargs)
        ctx.samples_at_once = params.n
        if request.HasField("tools"):
            if not request.messages:
                raise InvalidArgument("tools: only with messages (the chat template shows them to the model)")
            ctx.tools = tools_from_pb(request.tools)
            if ctx.tools.shown and not info.tool_call_parser:
                raise FailedPrecondition(f"tools: model {model!r} writes no tool calls its worker can parse (start "
                                         "the worker with --tool-call-parser)")
            wreq.tools.CopyFrom(request.tools)
        if request.HasField("reasoning"):
            reasoning = reasoning_from_pb(request.reasoning)  # the worker checks what its model's format allows
            check_self_consistency(reasoning, params)
            wreq.reasoning.CopyFrom(request.reasoning)
            if reasoning.self_consistency is not None:  # a vote runs its samples in rounds
                ctx.samples_at_once = reasoning.self_consistency.min_samples
        wreq.cache_salt = self._cache_salt(ctx.tenant, request.cache_salt)
        wreq.tenant = ctx.tenant.name
        ctx.model, ctx.sla, ctx.wreq = model, sla, wreq
        ctx.prompt_bytes = len(prompt_text(wreq).encode())
        ctx.max_new_tokens, ctx.samples = max_new_tokens_of(wreq.sampling), samples_of(wreq)

    async def _relay(self, ctx: RequestContext, labels: dict[str, str]) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        """Validation, the request's rules (nothing a tenant may not have costs a sandbox run or a worker slot), the
        stream, the post-processor; what the rules took is given back however it ends."""
        self._validate(ctx, labels)
        ctx.span = self._annotate(ctx.model, ctx.wreq)
        request = ctx.request
        # With a post-processor the client sees only its output: token ids, logprobs and the worker's own
        # reasoning/answer split would give the rewritten text back, unless the tenant may have raw tokens.
        withhold = bool(request.post_processor) and not ctx.tenant.raw_tokens
        completion: dict[int, list[str]] = {}  # per sample
        calls = ToolCalls() if ctx.tools is not None and ctx.tools.shown else None
        try:
            await self.chain.admit(Stage.REQUEST, ctx)
            async for out in self._stream(ctx):
                if calls is not None:
                    calls.take(out)
                ctx.generated += max(1, len(out.token_ids))
                if out.HasField("usage"):
                    usage = out.usage
                    ctx.used_tokens = usage.prompt_tokens + usage.completion_tokens + usage.probe_tokens
                if request.post_processor:
                    # Each sample's text is held back until the post-processor has seen all of it.
                    completion.setdefault(out.index, []).append(out.text)
                    out.text = ""
                    if withhold:
                        for name in ("token_ids", "logprobs", "token_logprobs", "reasoning_text", "answer_text"):
                            out.ClearField(name)
                    if out.finish_reason:
                        out.text = await self.processors.apply("post_processor", request.post_processor,
                                                               "".join(completion.pop(out.index)), ctx.tenant,
                                                               ctx.time_remaining())
                yield out
        finally:
            await ctx.end()

    def _annotate(self, model: str, wreq: worker_pb2.GenerateRequest):
        """The request's span (the gRPC server span): named for the model, with what was asked."""
        span = trace.get_current_span()
        span.update_name(f"generate {model}")
        sp = wreq.sampling
        span.set_attributes({
            "cotserve.component": "gateway",  # marks the request's summary span for the telemetry service
            "gen_ai.operation.name": "text_completion", "gen_ai.request.model": model,
            "cotserve.sla_class": common_pb2.SlaClass.Name(wreq.sla_class or common_pb2.SLA_CLASS_INTERACTIVE),
            "cotserve.request_id": wreq.request_id,
            **({"gen_ai.request.max_tokens": sp.max_new_tokens} if sp.HasField("max_new_tokens") else {}),
            **({"gen_ai.request.temperature": sp.temperature} if sp.HasField("temperature") else {}),
        })
        return span

    async def _pick(self, ctx: RequestContext, tried: set[WorkerHandle]) -> WorkerHandle:
        """A worker of `model` not tried yet (waiting for one to come into rotation, within the deadline); among
        several, the SLO predictor's lowest predicted TTFT when it answers in time."""
        model, sla, span = ctx.model, ctx.sla, ctx.span
        remaining = ctx.time_remaining()
        wait_s = self.worker_wait_s if remaining is None else max(0.0, min(self.worker_wait_s, remaining - 0.05))
        worker = await self.pool.pick_waiting(model, tried, sla, wait_s)
        candidates = [w for w in self.pool.workers if w.healthy and w.model == model and w not in tried]
        if len(candidates) > 1:
            better = (await self.slo.pick(model, candidates, sla, ctx.prompt_bytes, ctx.max_new_tokens)
                      if self.slo is not None else None)
            if better is not None:
                worker = better
            by = "load" if better is None else "predicted_ttft"
            span.set_attribute("cotserve.routed_by", by)
            self.metrics.routed.labels(model, by).inc()
        span.set_attributes({"cotserve.worker": worker.address,
                             "cotserve.model_version": f"{model}@{worker.info.model_revision}"})
        return worker

    async def _stream(self, ctx: RequestContext) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        """Per attempt: a worker picked, the worker's rules (its admission inside), the worker stream; one retry,
        only before the first token; each chunk relayed."""
        tried: set[WorkerHandle] = set()
        while True:
            worker = await self._pick(ctx, tried)
            ctx.worker, ctx.attempt = worker, len(tried)
            # the worker's state as chosen (what routing predicts from), before its admission queue
            observer = AttemptObserver(self.metrics, self.slo, ctx.span, ctx.model, ctx.sla, worker, ctx.start,
                                       ctx.prompt_bytes, ctx.max_new_tokens, ctx.held_ms / 1000, ctx.samples)
            tried.add(worker)
            await self.chain.admit(Stage.WORKER, ctx)
            observer.sent(ctx.queue_ms)
            try:
                async with aclosing(self._attempt(worker, ctx.wreq, observer, ctx)) as relay:
                    async for out in relay:
                        yield out
                return
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise RelayedError(code.name, err.details() or code.name) from None
                self.pool.mark_down(worker)
                if observer.first_at is None and len(tried) == 1:
                    log.warning("worker %s failed before the first token; retrying once", worker.address)
                    ctx.span.add_event("retry", {"cotserve.failed_worker": worker.address})
                    continue
                where = "after the first token" if observer.first_at is not None else "on retry"
                raise Unavailable(f"worker {worker.address} failed {where}: {err.details()}") from None

    @staticmethod
    async def _attempt(worker: WorkerHandle, wreq: worker_pb2.GenerateRequest, observer: AttemptObserver,
                       ctx: RequestContext) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        """One worker stream (of the worker's Multiplex call, or a Generate call), relayed: what has arrived since the
        last write goes out merged; the admission slot is given back and the stream cancelled unless it ended
        (freeing the worker's pages) however it ends."""
        stream = None
        try:
            stream = await worker.open_stream(wreq, ctx.time_remaining())
            while (pending := await stream.pending()) is not None:
                now = time.monotonic()
                outs = []
                for chunk in pending:
                    out = to_client_chunk(chunk)
                    observer.chunk(chunk, out, now)
                    outs.append(out)
                for out in coalesce(outs):
                    yield out
        finally:
            observer.done()
            if stream is not None:
                stream.close()  # the client went away or we failed: free the worker's pages now
