"""The SDK's typed options: one definition per field (`Sampling`, `RequestOptions`), the keyword conveniences made
from them, and the request they build."""

from __future__ import annotations

import inspect

import pytest

from cotserve.common.v1 import common_pb2
from cotserve.gateway.v1 import gateway_pb2
from cotserve.sdk import AsyncClient, Client, InvalidArgument, Reasoning, RequestOptions, Sampling
from cotserve.sdk.options import build_request, collect_options


def test_every_option_field_is_a_keyword_of_every_generate_and_stream():
    fields = {"max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "logprobs",
              "ignore_eos", "n", "model", "sla", "post_processor", "pre_processor", "cache_salt"}
    for method in (Client.generate, Client.stream, AsyncClient.generate, AsyncClient.stream):
        params = inspect.signature(method).parameters
        assert fields <= set(params), method
        assert all(params[f].kind == inspect.Parameter.KEYWORD_ONLY for f in fields)
        assert params["max_new_tokens"].default is None and params["logprobs"].default is False


def test_keywords_fill_the_objects_and_override_the_same_field_of_one_given():
    got = collect_options({"sampling": Sampling(temperature=0.5, seed=3), "temperature": 1.5, "sla": "batch"})
    assert got == {"sampling": Sampling(temperature=1.5, seed=3), "options": RequestOptions(sla="batch")}
    assert collect_options({}) == {"sampling": Sampling(), "options": RequestOptions()}


def test_the_request_has_exactly_the_fields_given():
    req = build_request(gateway_pb2.GenerateStreamRequest, "2+2=", None,
                        Sampling(max_new_tokens=8, temperature=0.0, stop=["\n"], n=2),
                        RequestOptions(model="m", sla="realtime", cache_salt="s"), Reasoning(max_thinking_tokens=4))
    want = gateway_pb2.GenerateStreamRequest(
        prompt="2+2=", model="m", sla_class=common_pb2.SLA_CLASS_REALTIME, cache_salt="s",
        sampling=common_pb2.SamplingParams(max_new_tokens=8, temperature=0.0, stop=["\n"], n=2),
        reasoning=common_pb2.ReasoningOptions(max_thinking_tokens=4))
    assert req.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
    assert req.sampling.HasField("temperature") and not req.sampling.HasField("top_p")  # 0.0 is sent, None is not


def test_a_bad_sla_class_or_chat_key_names_what_is_allowed():
    with pytest.raises(InvalidArgument, match="sla: 'urgent' is not an SLA class \\(allowed: realtime, interactive, batch\\)"):
        build_request(gateway_pb2.GenerateRequest, "x", None, Sampling(), RequestOptions(sla="urgent"), None)
    with pytest.raises(InvalidArgument, match=r"messages\[0\]: unknown key\(s\) image \(allowed: role, content, "
                                              r"reasoning_content, tool_calls, tool_call_id, name\)"):
        build_request(gateway_pb2.GenerateRequest, "", [{"role": "user", "image": "x"}], Sampling(), RequestOptions(), None)


def test_an_unknown_keyword_is_a_type_error():
    with Client("127.0.0.1:1") as c:
        with pytest.raises(TypeError, match="max_tokens"):
            c.generate("x", max_tokens=3)


def test_options_objects_through_a_real_gateway_match_the_keywords(demo_gateway):
    with Client(demo_gateway, timeout_s=60) as c:
        by_keywords = c.generate("5+5=", temperature=1.5, seed=42, max_new_tokens=12, ignore_eos=True, sla="batch")
        by_objects = c.generate("5+5=", sampling=Sampling(temperature=1.5, seed=42, max_new_tokens=12, ignore_eos=True),
                                options=RequestOptions(sla="batch"))
    assert by_objects.token_ids == by_keywords.token_ids and len(by_keywords.token_ids) == 12
