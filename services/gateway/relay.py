"""The gateway's one relay: what happens to a request between the edge that received it and the worker that
serves it. The gRPC servicer (`gateway/server.py`) and the OpenAI HTTP API (`gateway/http.py`) both hand their
requests here as a `GenerateStreamRequest` and read `GenerateStreamResponse` chunks back."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Iterable, Protocol

import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from cotserve.common.errors import CotserveError, DeadlineExceeded, InvalidArgument, RelayedError, ResourceExhausted, Unavailable
from cotserve.common.sampling import (
    SlaClass, check_self_consistency, max_new_tokens_of, reasoning_from_pb, sampling_from_pb,
    sla_from_pb,
)
from cotserve.common.streams import coalesce
from cotserve.common.v1 import common_pb2
from cotserve.gateway.admission import QueueDeadlineExceeded
from cotserve.gateway.metrics import GatewayMetrics
from cotserve.gateway.observer import AttemptObserver, to_client_chunk
from cotserve.gateway.pool import WorkerHandle, WorkerPool
from cotserve.gateway.processors import Processors
from cotserve.gateway.quota import RENEW_EVERY_S, SPECIAL_TOKENS_ALLOWANCE, Grant, QuotaEnforcer, token_reservation
from cotserve.gateway.slo_link import SloLink
from cotserve.gateway.tenants import Tenant, TenantRegistry
from cotserve.gateway.v1 import gateway_pb2
from cotserve.worker.v1 import worker_pb2

log = logging.getLogger("cotserve.gateway")
MAX_CACHE_SALT_CHARS = 256


class Call(Protocol):
    """The edge's request, as the relay sees it (a grpc.aio servicer context is one)."""

    def invocation_metadata(self) -> Iterable[tuple[str, str | bytes]] | None: ...

    def time_remaining(self) -> float | None: ...


def samples_of(request: worker_pb2.GenerateRequest) -> int:
    """The most samples `request` may run at once: self-consistency's max_samples, else n (at least 1)."""
    if request.reasoning.HasField("self_consistency"):
        return max(1, request.reasoning.self_consistency.max_samples)
    return max(1, request.sampling.n)


def prompt_text(request) -> str:
    """What a request's prompt says: its text, or its chat messages' contents (what quotas and the SLO predictor
    count before the worker renders and tokenizes them)."""
    text = getattr(request, "prompt", None) or getattr(request, "prompt_text", "")
    return text or "".join(m.content for m in request.messages)


class Relay:
    """One request's way through the gateway, whichever edge received it (gRPC or HTTP): authenticate, validate,
    quota, pre-processor, pick a worker, admit, call with one retry, relay each chunk, post-processor. `call` is the
    edge's view of the request: its metadata (`invocation_metadata()`) and its deadline (`time_remaining()`), as a
    grpc.aio servicer context has them."""

    def __init__(self, pool: WorkerPool, metrics: GatewayMetrics, tenants: TenantRegistry | None = None,
                 quota: QuotaEnforcer | None = None, processors: Processors | None = None,
                 tracer_provider: TracerProvider | None = None, slo: SloLink | None = None,
                 prefix_cache_scope: str = "tenant", max_prompt_chars: int = 0, max_prompt_tokens: int = 0,
                 worker_wait_s: float = 0.0) -> None:
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer("cotserve.gateway")
        self.slo = slo
        self.pool = pool
        self.metrics = metrics
        self.tenants = tenants or TenantRegistry.open()
        self.quota = quota
        self.processors = processors or Processors(None)
        self.prefix_cache_scope = prefix_cache_scope
        self.max_prompt_chars = max_prompt_chars
        self.max_prompt_tokens = max_prompt_tokens
        self.worker_wait_s = worker_wait_s

    def authenticate(self, call: Call) -> Tenant:
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
        """`_relay`, counted in `cotserve_gateway_requests_total` by final status."""
        labels = {"model": request.model or "unknown", "sla_class": "UNKNOWN", "tenant": "default"}
        code = "OK"
        try:
            tenant = self.authenticate(call)
            labels["tenant"] = tenant.name
            async for chunk in self._relay(request, call, labels, tenant):
                yield chunk
        except CotserveError as exc:
            code = exc.code
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            self.metrics.requests.labels(labels["model"], labels["sla_class"], code, labels["tenant"]).inc()

    def _worker_request(self, request: gateway_pb2.GenerateStreamRequest | gateway_pb2.GenerateRequest,
                        labels: dict[str, str]) -> tuple[str, SlaClass, worker_pb2.GenerateRequest]:
        """Validate at the edge; the worker re-checks what needs its tokenizer (prompt length).
        `labels` (metrics) learn the model and class as soon as each is known."""
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
            if not m.role:
                raise InvalidArgument(f"messages[{i}].role: must not be empty")
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
        if request.HasField("reasoning"):
            reasoning = reasoning_from_pb(request.reasoning)  # the worker checks what its model's format allows
            check_self_consistency(reasoning, params)
            wreq.reasoning.CopyFrom(request.reasoning)
        return model, sla, wreq

    async def _relay(self, request, call: Call, labels: dict[str, str],
                     tenant: Tenant) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        """Authenticated already; then validation, the class grant, quota, the pre-processor, and the stream
        (admission inside it), in that order: nothing a tenant may not have costs a sandbox run or a worker slot."""
        start = time.monotonic()
        model, sla, wreq = self._worker_request(request, labels)
        wreq.cache_salt = self._cache_salt(tenant, request.cache_salt)
        self.tenants.authorize(tenant, sla)
        trace.get_current_span().set_attribute("cotserve.tenant", tenant.name)
        if request.pre_processor:
            self.processors.check_allowed("pre_processor", request.pre_processor, tenant)
        if request.post_processor:
            self.processors.check_allowed("post_processor", request.post_processor, tenant)
        grant = None
        if self.quota is not None and tenant.has_limits:
            # Reserved on the prompt as sent: the pre-processor has not run yet (the refund settles on actual use).
            sp = wreq.sampling
            max_new = max_new_tokens_of(sp)
            grant = await self.quota.admit(tenant, token_reservation(prompt_text(wreq), max_new * samples_of(wreq)))
        renewer = asyncio.create_task(self._renew_lease(grant)) if grant is not None and grant.lease_id else None
        # With a post-processor the client sees only its output: token ids, logprobs and the worker's own
        # reasoning/answer split would give the rewritten text back, unless the tenant may have raw tokens.
        withhold = bool(request.post_processor) and not tenant.raw_tokens
        generated, used_tokens = 0, None
        completion: dict[int, list[str]] = {}  # per sample
        try:
            if request.pre_processor:
                wreq.prompt_text = await self.processors.apply("pre_processor", request.pre_processor, request.prompt, tenant,
                                                               call.time_remaining())
            async for out in self._stream(start, model, sla, wreq, call):
                generated += max(1, len(out.token_ids))
                if out.HasField("usage"):
                    used_tokens = out.usage.prompt_tokens + out.usage.completion_tokens
                if request.post_processor:
                    # Each sample's text is held back until the post-processor has seen all of it.
                    completion.setdefault(out.index, []).append(out.text)
                    out.text = ""
                    if withhold:
                        for name in ("token_ids", "logprobs", "token_logprobs", "reasoning_text", "answer_text"):
                            out.ClearField(name)
                    if out.finish_reason:
                        out.text = await self.processors.apply("post_processor", request.post_processor,
                                                               "".join(completion.pop(out.index)), tenant,
                                                               call.time_remaining())
                yield out
        finally:
            if renewer is not None:
                renewer.cancel()
            if grant is not None:
                if used_tokens is None:  # failed or cancelled: charge what it may have used so far
                    used_tokens = len(prompt_text(wreq).encode()) + SPECIAL_TOKENS_ALLOWANCE + generated
                try:
                    await asyncio.shield(self.quota.release(grant, used_tokens))
                except CotserveError as exc:  # the lease expires by itself; the answer stands
                    log.warning("request %s: could not release its quota grant: %s", wreq.request_id, exc.message)

    async def _renew_lease(self, grant: Grant) -> None:
        """Keep a live stream's concurrency lease from expiring (a lost renewal is retried next period)."""
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            try:
                await self.quota.renew(grant)
            except CotserveError as exc:
                log.warning("tenant %s: lease renewal failed: %s", grant.tenant.name, exc.message)

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

    async def _pick(self, model: str, sla: SlaClass, tried: set[WorkerHandle], prompt_bytes: int, max_new: int,
                    call: Call, span) -> WorkerHandle:
        """A worker of `model` not tried yet (waiting for one to come into rotation, within the deadline); among
        several, the SLO predictor's lowest predicted TTFT when it answers in time."""
        remaining = call.time_remaining()
        wait_s = self.worker_wait_s if remaining is None else max(0.0, min(self.worker_wait_s, remaining - 0.05))
        worker = await self.pool.pick_waiting(model, tried, sla, wait_s)
        candidates = [w for w in self.pool.workers if w.healthy and w.model == model and w not in tried]
        if len(candidates) > 1:
            better = await self.slo.pick(model, candidates, sla, prompt_bytes, max_new) if self.slo is not None else None
            if better is not None:
                worker = better
            by = "load" if better is None else "predicted_ttft"
            span.set_attribute("cotserve.routed_by", by)
            self.metrics.routed.labels(model, by).inc()
        span.set_attributes({"cotserve.worker": worker.address,
                             "cotserve.model_version": f"{model}@{worker.info.model_revision}"})
        return worker

    async def _admit(self, worker: WorkerHandle, sla: SlaClass, call: Call) -> float:
        """Wait for the worker's admission of `sla` (a "queue wait" span); the milliseconds waited."""
        with self.tracer.start_as_current_span("queue wait", attributes={"cotserve.worker": worker.address}) as qspan:
            try:
                return await worker.admission.acquire(sla, call.time_remaining())
            except QueueDeadlineExceeded as exc:
                qspan.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                raise DeadlineExceeded(f"deadline: {exc}; the request never reached a worker") from None

    async def _stream(self, start: float, model: str, sla: SlaClass, wreq: worker_pb2.GenerateRequest,
                      call: Call) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        """Admission, the worker stream with its one retry (only before the first token), each chunk relayed."""
        span = self._annotate(model, wreq)
        held_ms = 0.0
        if self.slo is not None and sla == SlaClass.BATCH:
            held_ms, why = await self.slo.hold_batch(model, call.time_remaining())
            if why is not None:
                span.add_event("held", {"cotserve.reason": why, "cotserve.held_ms": held_ms})
                self.metrics.batch_held.labels(model).observe(held_ms / 1000)
        tried: set[WorkerHandle] = set()
        sp = wreq.sampling
        max_new, samples = max_new_tokens_of(sp), samples_of(wreq)
        prompt_bytes = len(prompt_text(wreq).encode())
        while True:
            worker = await self._pick(model, sla, tried, prompt_bytes, max_new, call, span)
            if self.slo is not None and not tried:  # a retry is not turned away: it has waited already
                try:
                    self.slo.shed(model, worker, sla, prompt_bytes, max_new)
                except ResourceExhausted as exc:
                    self.metrics.shed.labels(model).inc()
                    span.add_event("shed", {"cotserve.reason": str(exc), "cotserve.worker": worker.address})
                    raise
            tried.add(worker)
            observer = AttemptObserver(self.metrics, self.slo, span, model, sla, worker, start, prompt_bytes, max_new,
                                       held_ms / 1000, samples)
            observer.sent(await self._admit(worker, sla, call))
            try:
                async with aclosing(self._attempt(worker, wreq, observer, call)) as relay:
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
                    span.add_event("retry", {"cotserve.failed_worker": worker.address})
                    continue
                where = "after the first token" if observer.first_at is not None else "on retry"
                raise Unavailable(f"worker {worker.address} failed {where}: {err.details()}") from None

    @staticmethod
    async def _attempt(worker: WorkerHandle, wreq: worker_pb2.GenerateRequest, observer: AttemptObserver,
                       call: Call) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        """One worker stream (of the worker's Multiplex call, or a Generate call), relayed: what has arrived since the
        last write goes out merged; the admission slot is given back and the stream cancelled unless it ended
        (freeing the worker's pages) however it ends."""
        stream = None
        try:
            stream = await worker.open_stream(wreq, call.time_remaining())
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
