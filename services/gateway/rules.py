"""Admission as one ordered chain of rules: every check a request passes between the edge and a worker stream.

A rule is a small object with one method, `check(ctx)`, that answers `ADMIT`, `Wait(until)` (the chain waits, then
asks the same rule again) or `Refuse(error)` (the request fails with that status). Each rule has a `stage`, what it
needs to know: the caller (`CALLER`), the validated request (`REQUEST`), or the worker picked for an attempt
(`WORKER`, asked again for a retry's attempt). What a rule takes (a quota grant, a queue slot) it gives back through
the context's `on_end`, which the relay runs however the request ends.

The chain the gateway runs (`default_chain`), in order: authenticate, grant (the tenant's class and modules), quota,
pre-process, the SLO predictor's BATCH hold, then per worker the SLO shed and the worker's admission queue. A new
rule is a class here (or beside the part it asks), one line in `default_chain`, and its settings a dataclass group of
`GatewayConfig`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Protocol

from opentelemetry import trace

from cotserve.common.errors import CotserveError, DeadlineExceeded
from cotserve.common.sampling import SlaClass
from cotserve.gateway.admission import QueueDeadlineExceeded
from cotserve.gateway.processors import Processors
from cotserve.gateway.quota import RENEW_EVERY_S, SPECIAL_TOKENS_ALLOWANCE, QuotaEnforcer, token_reservation
from cotserve.gateway.tenants import Tenant, TenantRegistry
from cotserve.worker.v1 import worker_pb2

log = logging.getLogger("cotserve.gateway")


class Stage(enum.IntEnum):
    """What a rule needs to know, in the order the relay learns it."""

    CALLER = 0  # the call's metadata (who asks)
    REQUEST = 1  # the validated request: model, class, worker request
    WORKER = 2  # the worker picked for an attempt (asked again at a retry)


@dataclass(frozen=True, slots=True)
class Admit:
    """The rule lets the request go on."""


ADMIT = Admit()


@dataclass(frozen=True, slots=True)
class Wait:
    """The rule holds the request until `until` completes, then is asked again."""

    until: Awaitable[Any]


@dataclass(frozen=True, slots=True)
class Refuse:
    """The request fails with `error`'s status and message (and trailers, such as retry-after-ms)."""

    error: CotserveError


Verdict = Admit | Wait | Refuse


class Call(Protocol):
    """The edge's request, as the gateway sees it (a grpc.aio servicer context is one)."""

    def invocation_metadata(self) -> Iterable[tuple[str, str | bytes]] | None: ...

    def time_remaining(self) -> float | None: ...


@dataclass(eq=False)
class RequestContext:
    """One request on its way through the chain; each stage fills in more."""

    call: Call
    request: Any  # gateway_pb2.GenerateStreamRequest or GenerateRequest, as the edge received it
    tools: Any = None  # the request's checked tools (`common.tools.ToolSpec`), when it has some
    start: float = field(default_factory=time.monotonic)
    tenant: Tenant | None = None  # CALLER on
    model: str = ""  # REQUEST on
    sla: SlaClass = SlaClass.INTERACTIVE
    wreq: worker_pb2.GenerateRequest | None = None
    prompt_bytes: int = 0
    max_new_tokens: int = 0
    samples: int = 1  # samples the request may run in all (self-consistency's max_samples, else n)
    samples_at_once: int = 1  # of them, at once (a vote's round: its min_samples)
    span: Any = None  # the request's span
    worker: Any = None  # WORKER: the pick of this attempt (a pool.WorkerHandle)
    attempt: int = 0  # WORKER: 0 for the first attempt, 1 for the retry
    held_ms: float = 0.0  # how long the request was held before it was routed (the BATCH hold)
    queue_ms: float = 0.0  # WORKER: how long this attempt waited in the worker's admission queue
    generated: int = 0  # tokens relayed so far (what a failed request is charged)
    used_tokens: int | None = None  # prompt + completion tokens, once the worker reported its usage
    on_end: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # what rules give back, in reverse
    state: dict[str, Any] = field(default_factory=dict)  # a rule's own per-request state, by the rule's name

    def time_remaining(self) -> float | None:
        return self.call.time_remaining()

    async def end(self) -> None:
        """Give back what the rules took, last taken first; a failure to give one back is logged, not raised."""
        while self.on_end:
            try:
                await asyncio.shield(self.on_end.pop()())
            except CotserveError as exc:
                log.warning("request %s: %s", self.wreq.request_id if self.wreq else "?", exc.message)


class Rule(Protocol):
    stage: Stage

    async def check(self, ctx: RequestContext) -> Verdict: ...


class Chain:
    """The rules in order; `admit` runs one stage's."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = sorted(rules, key=lambda r: r.stage)  # stable: a stage's rules keep their order

    async def admit(self, stage: Stage, ctx: RequestContext) -> None:
        """Run `stage`'s rules in order; raises the first refusal's error."""
        for rule in self.rules:
            if rule.stage != stage:
                continue
            while True:
                verdict = await rule.check(ctx)
                if isinstance(verdict, Admit):
                    break
                if isinstance(verdict, Refuse):
                    raise verdict.error
                await verdict.until


# ---- the rules every gateway runs ---------------------------------------------------------------------------------
class Authenticate:
    """The caller's API key names its tenant (UNAUTHENTICATED otherwise)."""

    stage = Stage.CALLER

    def __init__(self, tenants: TenantRegistry) -> None:
        self.tenants = tenants

    async def check(self, ctx: RequestContext) -> Verdict:
        try:
            ctx.tenant = self.tenants.authenticate(ctx.call.invocation_metadata() or ())
        except CotserveError as exc:
            return Refuse(exc)
        return ADMIT


class Grant:
    """The tenant may use the request's SLA class and the sandbox modules it names (PERMISSION_DENIED otherwise):
    checked before anything costs quota, a sandbox run or a worker slot."""

    stage = Stage.REQUEST

    def __init__(self, tenants: TenantRegistry, processors: Processors) -> None:
        self.tenants, self.processors = tenants, processors

    async def check(self, ctx: RequestContext) -> Verdict:
        try:
            self.tenants.authorize(ctx.tenant, ctx.sla)
            for name in ("pre_processor", "post_processor"):
                module = getattr(ctx.request, name)
                if module:
                    self.processors.check_allowed(name, module, ctx.tenant)
        except CotserveError as exc:
            return Refuse(exc)
        trace.get_current_span().set_attribute("cotserve.tenant", ctx.tenant.name)
        return ADMIT


class Quota:
    """A tenant with limits reserves its tokens (on the prompt as sent: the pre-processor has not run yet) and a
    concurrency lease, renewed while the stream lives, counted per sample (tokens of every sample it may run, slots
    of those it runs at once); what the request used is settled
    when it ends (its usage, probes included; the prompt and what was relayed when it failed before its usage came),
    and a release that fails is retried until the lease would have expired."""

    stage = Stage.REQUEST

    def __init__(self, quota: QuotaEnforcer) -> None:
        self.quota = quota

    async def check(self, ctx: RequestContext) -> Verdict:
        if not ctx.tenant.has_limits:
            return ADMIT
        prompt = prompt_text(ctx.wreq)
        try:
            grant = await self.quota.admit(ctx.tenant, token_reservation(prompt, ctx.max_new_tokens * ctx.samples),
                                           ctx.samples_at_once)
        except CotserveError as exc:
            return Refuse(exc)
        renewer = asyncio.create_task(self._renew(grant)) if grant.lease_id else None

        async def release() -> None:
            if renewer is not None:
                renewer.cancel()
            used = ctx.used_tokens
            if used is None:  # failed or cancelled: charge what it may have used so far
                used = len(prompt.encode()) + SPECIAL_TOKENS_ALLOWANCE + ctx.generated
            await self.quota.release_or_retry(grant, used)

        ctx.on_end.append(release)
        return ADMIT

    async def _renew(self, grant) -> None:
        """Keep a live stream's concurrency lease from expiring (a lost renewal is retried next period)."""
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            try:
                await self.quota.renew(grant)
            except CotserveError as exc:
                log.warning("tenant %s: lease renewal failed: %s", grant.tenant.name, exc.message)


class PreProcess:
    """The request's pre-processor (a sandbox module) rewrites its prompt."""

    stage = Stage.REQUEST

    def __init__(self, processors: Processors) -> None:
        self.processors = processors

    async def check(self, ctx: RequestContext) -> Verdict:
        module = ctx.request.pre_processor
        if module:
            try:
                ctx.wreq.prompt_text = await self.processors.apply("pre_processor", module, ctx.request.prompt,
                                                                   ctx.tenant, ctx.time_remaining())
            except CotserveError as exc:
                return Refuse(exc)
        return ADMIT


class WorkerAdmission:
    """The picked worker's admission (`admission.Admission`) lets the request's class start: at once, or after a wait
    in its class queue, in its tenant's fair turn (a "queue wait" span); a full queue is RESOURCE_EXHAUSTED, the deadline passing there
    DEADLINE_EXCEEDED. The slot is the attempt's, given back when its stream ends (`AttemptObserver.done`)."""

    stage = Stage.WORKER

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    async def check(self, ctx: RequestContext) -> Verdict:
        worker = ctx.worker
        with self.tracer.start_as_current_span("queue wait", attributes={"cotserve.worker": worker.address}) as span:
            try:
                ctx.queue_ms = await worker.admission.acquire(ctx.sla, ctx.time_remaining(), ctx.tenant.name,
                                                              ctx.samples)
            except QueueDeadlineExceeded as exc:
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                return Refuse(DeadlineExceeded(f"deadline: {exc}; the request never reached a worker"))
            except CotserveError as exc:
                return Refuse(exc)
        return ADMIT


def prompt_text(request) -> str:
    """What a request's prompt says: its text, or its chat messages' contents (what quotas and the SLO predictor
    count before the worker renders and tokenizes them)."""
    text = getattr(request, "prompt", None) or getattr(request, "prompt_text", "")
    return text or "".join(m.content for m in request.messages)
