"""The relay's own work, without a worker: what it validates at the edge (with the field and the limit named), the
worker request it builds, and how a tenant's prefix-cache partition is made. The chain's rules have their tests in
test_rules.py; the stream, retries and post-processors run end to end in test_failover.py and test_processors.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cotserve.common.errors import InvalidArgument
from cotserve.common.sampling import SlaClass
from cotserve.common.v1 import common_pb2
from cotserve.gateway.metrics import GatewayMetrics
from cotserve.gateway.relay import MAX_CACHE_SALT_CHARS, Relay, samples_of
from cotserve.gateway.rules import Chain, RequestContext
from cotserve.gateway.tenants import Tenant
from cotserve.gateway.v1 import gateway_pb2
from cotserve.worker.v1 import worker_pb2

INFO = worker_pb2.InfoResponse(max_context_tokens=512, max_token_chars=4, vocab_size=100)


def relay(scope: str = "tenant", max_prompt_chars: int = 0) -> Relay:
    pool = SimpleNamespace(workers=[], resolve_model=lambda name: "m", models=lambda: {"m": [SimpleNamespace(info=INFO)]})
    return Relay(pool, GatewayMetrics(pool), Chain([]), prefix_cache_scope=scope, max_prompt_chars=max_prompt_chars)


def validated(r: Relay, **fields) -> RequestContext:
    ctx = RequestContext(SimpleNamespace(time_remaining=lambda: None), gateway_pb2.GenerateStreamRequest(**fields),
                         tenant=Tenant("acme"))
    r._validate(ctx, {})
    return ctx


def test_a_valid_request_becomes_the_worker_request_with_what_the_rules_count():
    ctx = validated(relay(), prompt="2+2=", sla_class=common_pb2.SLA_CLASS_BATCH, cache_salt="s",
                    sampling=common_pb2.SamplingParams(max_new_tokens=8, n=3))
    assert (ctx.model, ctx.sla, ctx.prompt_bytes, ctx.max_new_tokens, ctx.samples) == ("m", SlaClass.BATCH, 4, 8, 3)
    w = ctx.wreq
    assert w.prompt_text == "2+2=" and w.sampling.max_new_tokens == 8 and w.sla_class == common_pb2.SLA_CLASS_BATCH
    assert w.cache_salt == "tenant:acme\x00s" and w.tenant == "acme" and len(w.request_id) == 32


def test_the_cache_partition_is_the_tenants_unless_global_and_a_salt_never_widens_it():
    assert validated(relay(), prompt="x").wreq.cache_salt == "tenant:acme\x00"
    assert validated(relay("global"), prompt="x", cache_salt="s").wreq.cache_salt == "s"
    with pytest.raises(InvalidArgument, match=f"cache_salt: {MAX_CACHE_SALT_CHARS + 1} characters, at most {MAX_CACHE_SALT_CHARS}"):
        validated(relay(), prompt="x", cache_salt="s" * (MAX_CACHE_SALT_CHARS + 1))


@pytest.mark.parametrize("fields,message", [
    (dict(prompt="x", messages=[common_pb2.ChatMessage(role="user", content="x")]), "prompt / messages: give exactly one"),
    (dict(), "prompt / messages: give exactly one"),
    (dict(messages=[common_pb2.ChatMessage(role="user", content="x")], pre_processor="strip"),
     "pre_processor: runs on a prompt's text"),
    (dict(messages=[common_pb2.ChatMessage(role="", content="x")]), r"messages\[0\].role: 0 characters, allowed 1..64"),
    (dict(messages=[common_pb2.ChatMessage(role="r" * 65, content="x")]), r"messages\[0\].role: 65 characters, allowed 1..64"),
    (dict(prompt="x" * 2049), r"prompt: 2049 characters, at most 2048 allowed \(what model 'm''s context can hold\)"),
    (dict(prompt="x", sampling=common_pb2.SamplingParams(temperature=3.0)), "sampling.temperature: 3.0 is out of range"),
])
def test_bad_requests_are_refused_naming_the_field_and_the_limit(fields, message):
    with pytest.raises(InvalidArgument, match=message):
        validated(relay(), **fields)


def test_an_operator_limit_on_prompt_characters_is_named_as_such():
    with pytest.raises(InvalidArgument, match=r"prompt: 11 characters, at most 10 allowed \(the limit\)"):
        validated(relay(max_prompt_chars=10), prompt="x" * 11)


def test_a_vote_counts_all_its_samples_for_tokens_and_a_rounds_worth_at_once():
    ctx = validated(relay(), prompt="2+2=", sampling=common_pb2.SamplingParams(temperature=1.0),
                    reasoning=common_pb2.ReasoningOptions(self_consistency=common_pb2.SelfConsistency(
                        max_samples=16, min_samples=4)))
    assert (ctx.samples, ctx.samples_at_once) == (16, 4)
    ctx = validated(relay(), prompt="2+2=", sampling=common_pb2.SamplingParams(n=3))
    assert (ctx.samples, ctx.samples_at_once) == (3, 3)


def test_samples_are_self_consistencys_most_or_n():
    req = worker_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(n=2))
    assert samples_of(req) == 2 and samples_of(worker_pb2.GenerateRequest()) == 1
    req.reasoning.self_consistency.max_samples = 6
    assert samples_of(req) == 6
