"""Property-based tests of the edges that take untrusted input: whatever a client sends, the HTTP API's parser, the
relay's validation and the request converters answer with an error that names the problem (a `CotserveError`:
INVALID_ARGUMENT and its kin), never an unexpected exception (a 500 / INTERNAL). Bounded and derandomized here, so
that CI is repeatable; `make fuzz` runs them with more examples and a fresh seed (COTSERVE_FUZZ_EXAMPLES)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cotserve.common.errors import CotserveError
from cotserve.common.sampling import reasoning_from_pb, sampling_from_pb
from cotserve.common.v1 import common_pb2
from cotserve.gateway.http import _json_response, check_text, error_body
from cotserve.gateway.metrics import GatewayMetrics
from cotserve.gateway.openai_api import _FIELDS, parse
from cotserve.gateway.relay import Relay
from cotserve.gateway.rules import Chain, RequestContext
from cotserve.gateway.tenants import Tenant
from cotserve.worker.v1 import worker_pb2

EXAMPLES = int(os.environ.get("COTSERVE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="COTSERVE_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

surrogates = st.integers(0xD800, 0xDFFF).map(chr)  # lone surrogates: JSON's \u escapes can spell them, UTF-8 cannot
text = st.text(st.characters() | surrogates, max_size=20)
scalars = st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=True) | text
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)
message = st.fixed_dictionaries({}, optional={"role": json_values | st.sampled_from(["user", "system", "assistant"]),
                                              "content": json_values | text,
                                              "reasoning_content": json_values})


def body(kind: str):
    """A request body of `kind`: known fields with values of any JSON type (and sometimes plausible ones)."""
    fields = {name: json_values for name in sorted(_FIELDS[kind])}
    if kind == "chat":
        fields["messages"] = st.lists(message, max_size=3) | json_values
    else:
        fields["prompt"] = text | st.lists(text | st.integers(-5, 2000), max_size=3) | json_values
    return st.fixed_dictionaries({}, optional=fields) | json_values


INFO = worker_pb2.InfoResponse(max_context_tokens=256, max_token_chars=4, vocab_size=100)
POOL = SimpleNamespace(workers=[], resolve_model=lambda name: "m", models=lambda: {"m": [SimpleNamespace(info=INFO)]})
RELAY = Relay(POOL, GatewayMetrics(POOL), Chain([]))


def validate(request) -> None:
    """The relay's validation, then the worker request serialized as the relay sends it."""
    ctx = RequestContext(SimpleNamespace(time_remaining=lambda: None), request, tenant=Tenant("t"))
    RELAY._validate(ctx, {})
    ctx.wreq.SerializeToString()


@FUZZ
@given(kind=st.sampled_from(["chat", "completion"]), data=st.data())
def test_any_body_is_a_request_or_an_error_that_names_it(kind, data):
    value = data.draw(body(kind))
    try:
        check_text(value)
        api = parse(kind, value)
        validate(api.request)
    except CotserveError as exc:
        status, error, headers = error_body(exc)  # the answer as the HTTP API writes it: its bytes must encode
        assert 400 <= status < 500 and exc.message and _json_response(status, error, headers).body


int_fields = ("max_new_tokens", "top_k", "seed", "n", "top_logprobs")


@FUZZ
@given(temperature=st.none() | st.floats(width=32), top_p=st.none() | st.floats(width=32),
       ints=st.fixed_dictionaries({}, optional={f: st.integers(0, (1 << 32) - 1) for f in int_fields}),
       stop=st.lists(st.text(max_size=80), max_size=10), stop_ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=4),
       flags=st.tuples(st.booleans(), st.booleans()))
def test_any_sampling_message_converts_or_names_the_bad_field(temperature, top_p, ints, stop, stop_ids, flags):
    sp = common_pb2.SamplingParams(stop=stop, stop_token_ids=stop_ids, logprobs=flags[0], ignore_eos=flags[1])
    if temperature is not None:
        sp.temperature = temperature
    if top_p is not None:
        sp.top_p = top_p
    for name, value in ints.items():
        try:
            setattr(sp, name, value)
        except ValueError:  # out of the proto field's own range: not sendable
            return
    try:
        params = sampling_from_pb(sp, vocab_size=100, max_model_len=256, max_new_tokens_limit=256)
    except CotserveError as exc:
        assert exc.message.startswith("sampling.")
        return
    assert 1 <= params.max_new_tokens <= 256 and 0 <= params.temperature <= 2 and 0 < params.top_p <= 1


@FUZZ
@given(fields=st.fixed_dictionaries({}, optional={
    "max_thinking_tokens": st.integers(-(1 << 31), (1 << 31) - 1), "max_thinking_steps": st.integers(-(1 << 31), (1 << 31) - 1),
    "min_thinking_tokens": st.integers(-(1 << 31), (1 << 31) - 1), "forcing_text": st.text(max_size=300)}),
    early=st.none() | st.fixed_dictionaries({}, optional={"probe_every_tokens": st.integers(-(1 << 31), (1 << 31) - 1),
                                                          "agree": st.integers(-(1 << 31), (1 << 31) - 1),
                                                          "min_confidence": st.floats(width=32)}),
    vote=st.none() | st.fixed_dictionaries({}, optional={"max_samples": st.integers(-(1 << 31), (1 << 31) - 1),
                                                         "min_samples": st.integers(-(1 << 31), (1 << 31) - 1),
                                                         "threshold": st.floats(width=32)}))
def test_any_reasoning_message_converts_or_names_the_bad_field(fields, early, vote):
    ro = common_pb2.ReasoningOptions(**fields)
    try:
        if early is not None:
            ro.early_exit.CopyFrom(common_pb2.EarlyExit(**early))
        if vote is not None:
            ro.self_consistency.CopyFrom(common_pb2.SelfConsistency(**vote))
    except (ValueError, TypeError):  # not representable in the message: not sendable
        return
    try:
        reasoning_from_pb(ro)
    except CotserveError as exc:
        assert exc.message.startswith("reasoning")
