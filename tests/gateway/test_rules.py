"""The admission chain and its rules on their own: the order, waits and refusals; what a rule takes given back
however the request ends; the quota rule against a real Redis. No worker, no gRPC server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cotserve.common.errors import PermissionDenied, ResourceExhausted, Unauthenticated
from cotserve.common.sampling import SlaClass
from cotserve.gateway.processors import Processors
from cotserve.gateway.quota import QuotaEnforcer
from cotserve.gateway.rules import (
    ADMIT, Authenticate, Chain, Grant, Quota, Refuse, RequestContext, Stage, Wait,
)
from cotserve.gateway.tenants import Tenant, TenantRegistry, hash_key
from cotserve.gateway.v1 import gateway_pb2
from cotserve.worker.v1 import worker_pb2


class _Recorder:
    """A rule that answers from a script and records each time it was asked."""

    def __init__(self, name: str, stage: Stage, verdicts: list, asked: list[str]) -> None:
        self.name, self.stage, self.verdicts, self.asked = name, stage, verdicts, asked

    async def check(self, ctx):
        self.asked.append(self.name)
        return self.verdicts.pop(0) if self.verdicts else ADMIT


def call(metadata=(), remaining=None):
    return SimpleNamespace(invocation_metadata=lambda: metadata, time_remaining=lambda: remaining)


def test_a_stage_runs_its_rules_in_order_asks_again_after_a_wait_and_stops_at_a_refusal():
    async def main():
        asked: list[str] = []
        woke = asyncio.Event()

        async def later():
            await asyncio.sleep(0.01)
            woke.set()

        chain = Chain([_Recorder("worker", Stage.WORKER, [], asked),
                       _Recorder("a", Stage.REQUEST, [Wait(later()), ADMIT], asked),
                       _Recorder("b", Stage.REQUEST, [Refuse(PermissionDenied("no"))], asked),
                       _Recorder("c", Stage.REQUEST, [], asked)])
        with pytest.raises(PermissionDenied, match="no"):
            await chain.admit(Stage.REQUEST, RequestContext(call(), None))
        assert asked == ["a", "a", "b"] and woke.is_set()  # c never asked; the WORKER rule not in this stage
        await chain.admit(Stage.WORKER, RequestContext(call(), None))
        assert asked[-1] == "worker"

    asyncio.run(main())


def test_what_rules_took_is_given_back_last_first_even_when_one_give_back_fails():
    async def main():
        ctx, order = RequestContext(call(), None), []

        def giving_back(name, fail=False):
            async def back():
                order.append(name)
                if fail:
                    raise ResourceExhausted("redis is gone")
            return back

        ctx.on_end += [giving_back("quota"), giving_back("lease", fail=True), giving_back("slot")]
        await ctx.end()
        assert order == ["slot", "lease", "quota"] and ctx.on_end == []

    asyncio.run(main())


def test_authenticate_and_grant_refuse_with_the_status_that_names_the_problem():
    async def main():
        a = Tenant("a", key_sha256=frozenset({hash_key("sk-a")}), sla_classes=frozenset({SlaClass.BATCH}),
                   modules=frozenset({"strip"}))
        tenants = TenantRegistry({"a": a}, is_open=False, _by_hash={hash_key("sk-a"): a})
        chain = Chain([Authenticate(tenants), Grant(tenants, Processors(None))])
        with pytest.raises(Unauthenticated):
            await chain.admit(Stage.CALLER, RequestContext(call([("authorization", "Bearer sk-x")]), None))
        ctx = RequestContext(call([("authorization", "Bearer sk-a")]), gateway_pb2.GenerateStreamRequest(prompt="x"))
        await chain.admit(Stage.CALLER, ctx)
        assert ctx.tenant.name == "a"
        ctx.sla = SlaClass.INTERACTIVE
        with pytest.raises(PermissionDenied, match="INTERACTIVE"):
            await chain.admit(Stage.REQUEST, ctx)
        ctx.sla = SlaClass.BATCH
        ctx.request = gateway_pb2.GenerateStreamRequest(prompt="x", post_processor="other")
        with pytest.raises(PermissionDenied, match="other"):
            await chain.admit(Stage.REQUEST, ctx)
        ctx.request = gateway_pb2.GenerateStreamRequest(prompt="x", pre_processor="strip")
        await chain.admit(Stage.REQUEST, ctx)

    asyncio.run(main())


def test_quota_reserves_on_admit_and_charges_what_a_failed_request_relayed(redis_url):
    async def main():
        q = QuotaEnforcer.from_url(redis_url)
        tenant = Tenant("t", tokens_per_min=100, max_concurrent=1)
        rule = Chain([Quota(q)])

        def request(prompt: str) -> RequestContext:
            ctx = RequestContext(call(), None, tenant=tenant, max_new_tokens=40)
            ctx.wreq = worker_pb2.GenerateRequest(prompt_text=prompt)
            return ctx

        try:
            first = request("1234")
            await rule.admit(Stage.REQUEST, first)  # reserves 4 + 8 + 40 = 52 tokens and the one seat
            with pytest.raises(ResourceExhausted, match="max_concurrent"):
                await rule.admit(Stage.REQUEST, request("1"))
            first.generated = 3  # failed after 3 tokens: charged 4 + 8 + 3, the rest comes back
            await first.end()
            second = request("1234")
            await rule.admit(Stage.REQUEST, second)  # 15 + 52 <= 100
            second.used_tokens = 60  # the worker's usage: charged as reported
            await second.end()
            with pytest.raises(ResourceExhausted, match="tokens_per_min"):
                await rule.admit(Stage.REQUEST, request("1234"))  # 75 used + 52 > 100
        finally:
            await q.close()

    asyncio.run(main())
