"""The OpenAI API's wire forms without a server: bodies read into the relay's request (every field mapped, every
bad one named as OpenAI names it), the reasoning split of a streamed sample, and responses built from chunks."""

from __future__ import annotations

import pytest

from cotserve.common.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from cotserve.common.v1 import common_pb2
from cotserve.gateway.http import error_body
from cotserve.gateway.openai_api import ApiError, ReasoningSplit, Responder, parse
from cotserve.gateway.v1 import gateway_pb2

CHAT = {"model": "m", "messages": [{"role": "user", "content": "1+1="}]}


def test_a_chat_body_maps_onto_the_relay_request():
    api = parse("chat", {**CHAT, "messages": [{"role": "system", "content": [{"type": "text", "text": "Add"},
                                                                               {"type": "text", "text": "."}]},
                                              {"role": "assistant", "content": "2", "reasoning": "1+1=2"},
                                              {"role": "user", "content": "2+2="}],
                         "max_completion_tokens": 40, "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 7,
                         "stop": "\n", "logprobs": True, "top_logprobs": 3, "service_tier": "flex", "user": "u1",
                         "stream": True, "stream_options": {"include_usage": True}, "top_k": 5, "cache_salt": "s",
                         "frequency_penalty": 0.5, "presence_penalty": -0.25, "repetition_penalty": 1.25, "min_p": 0.125,
                         "logit_bias": {"7": -3, "12": 100}, "tools": []})
    req = api.request
    assert [(m.role, m.content, m.reasoning_content) for m in req.messages] == [
        ("system", "Add.", ""), ("assistant", "2", "1+1=2"), ("user", "2+2=", "")]
    sp = req.sampling
    assert (sp.max_new_tokens, round(sp.temperature, 6), round(sp.top_p, 6), sp.n, sp.seed, list(sp.stop)) == (40, 0.5, 0.9, 2, 7, ["\n"])
    assert (sp.logprobs, sp.top_logprobs, sp.top_k) == (True, 3, 5)
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty, sp.min_p) == (0.5, -0.25, 1.25, 0.125)
    assert dict(sp.logit_bias) == {7: -3.0, 12: 100.0}
    assert req.sla_class == common_pb2.SLA_CLASS_BATCH and api.service_tier == "flex"
    assert (api.stream, api.include_usage, api.user, req.model, req.cache_salt) == (True, True, "u1", "m", "s")


def test_defaults_service_tiers_and_reasoning_effort():
    chat = parse("chat", CHAT)
    assert not chat.request.sampling.HasField("max_new_tokens")  # the gateway's one default applies
    assert chat.request.sla_class == common_pb2.SLA_CLASS_INTERACTIVE and chat.service_tier == "default"
    assert parse("completion", {"prompt": ["1+1="]}).request.sampling.max_new_tokens == 16  # OpenAI's default
    assert parse("chat", {**CHAT, "service_tier": "priority"}).request.sla_class == common_pb2.SLA_CLASS_REALTIME
    assert parse("chat", {**CHAT, "service_tier": "auto"}).service_tier == "default"
    assert parse("chat", {**CHAT, "reasoning_effort": "low"}).request.reasoning.max_thinking_tokens == 256
    assert parse("chat", {**CHAT, "reasoning_effort": "none"}).request.reasoning.max_thinking_tokens == 0
    assert not parse("chat", {**CHAT, "reasoning_effort": "high"}).request.HasField("reasoning")
    vote = parse("chat", {**CHAT, "self_consistency": {"max_samples": 8, "threshold": 0.6},
                          "early_exit": {"probe_every_steps": 1}}).request.reasoning
    assert (vote.self_consistency.max_samples, round(vote.self_consistency.threshold, 6), vote.early_exit.probe_every_steps) == (8, 0.6, 1)
    legacy = parse("completion", {"prompt": "1+1=", "logprobs": 2, "max_tokens": 5})
    assert (legacy.logprobs, legacy.request.sampling.logprobs, legacy.request.sampling.top_logprobs) == (True, True, 2)


@pytest.mark.parametrize("kind,body,param,message", [
    ("chat", {"messages": []}, "messages", "required"),
    ("chat", {"messages": "hi"}, "messages", "expected an array, got string"),
    ("chat", {"messages": [{"content": "x"}]}, "messages[0].role", "required"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", "only text parts"),
    ("chat", {"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages[0].audio", "not supported"),
    ("chat", {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0]", "expected {id: string, type: function"),
    ("chat", {**CHAT, "tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0]", "expected"),
    ("chat", {**CHAT, "tools": [{"function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters",
     "expected a JSON Schema object"),
    ("chat", {**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ("chat", {**CHAT, "tools": [{"function": {"name": "f"}}], "tool_choice": "always"}, "tool_choice", "expected"),
    ("chat", {**CHAT, "temperature": "hot"}, "temperature", "expected a finite number, got string"),
    ("chat", {**CHAT, "max_tokens": 1.5}, "max_tokens", "expected an integer, got number"),
    ("chat", {**CHAT, "max_tokens": True}, "max_tokens", "expected an integer, got boolean"),
    ("chat", {**CHAT, "n": -1}, "n", "-1 is out of range (0..4294967295)"),
    ("chat", {**CHAT, "seed": 1 << 70}, "seed", "out of range"),
    ("chat", {**CHAT, "stop": [1]}, "stop", "expected a string or an array of strings"),
    ("chat", {**CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ("chat", {**CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "disagrees"),
    ("chat", {**CHAT, "service_tier": "gold"}, "service_tier", "'gold' is not one of priority, default, auto, flex"),
    ("chat", {**CHAT, "reasoning_effort": "max"}, "reasoning_effort", "is not one of"),
    ("chat", {**CHAT, "reasoning_effort": "low", "max_thinking_tokens": 5}, "max_thinking_tokens", "not both"),
    ("chat", {**CHAT, "early_exit": {"probe_every_tokens": "x"}}, "early_exit", "probe_every_tokens"),
    ("chat", {**CHAT, "store": True}, "store", "not supported by cotserve"),
    ("chat", {**CHAT, "frequency_penalty": "x"}, "frequency_penalty", "expected a finite number"),
    ("chat", {**CHAT, "logit_bias": {"a": 1}}, "logit_bias", "keys are token ids"),
    ("chat", {**CHAT, "logit_bias": {"5": "x"}}, "logit_bias", "must be a finite number"),
    ("chat", {**CHAT, "frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ("chat", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ("chat", {**CHAT, "prompt": "x"}, "prompt", "Unrecognized request argument"),
    ("completion", {"prompt": ["a", "b"]}, "prompt", "a list of several prompts"),
    ("completion", {"prompt": ""}, "prompt", "must not be empty"),
    ("completion", {"prompt": "x", "best_of": 3}, "best_of", "only best_of equal to n"),
    ("completion", {"prompt": "x", "messages": []}, "messages", "Unrecognized request argument"),
    ("completion", [], None, "must be a JSON object, got array"),
])
def test_bad_bodies_are_refused_naming_the_field(kind, body, param, message):
    with pytest.raises(ApiError) as err:
        parse(kind, body)
    assert err.value.param == param and message in err.value.message
    status, error, _ = error_body(err.value)
    assert status == 400 and error["error"]["param"] == param and error["error"]["type"] == "invalid_request_error"


def test_relay_errors_map_to_statuses_and_this_apis_field_names():
    status, body, headers = error_body(InvalidArgument("sampling.max_new_tokens: 9999 is out of range (1..256)"))
    assert (status, body["error"]["param"], body["error"]["message"]) == (400, "max_tokens", "max_tokens: 9999 is out of range (1..256)")
    status, body, _ = error_body(PermissionDenied("sla_class: tenant 'a' may not use REALTIME (allowed: INTERACTIVE)"))
    assert (status, body["error"]["param"], body["error"]["type"]) == (403, "service_tier", "permission_error")
    status, body, headers = error_body(ResourceExhausted("requests_per_min: over", trailers={"retry-after-ms": "1500"}))
    assert (status, headers["Retry-After"], headers["retry-after-ms"], body["error"]["type"]) == (429, "2", "1500", "rate_limit_error")


def _feed(split: ReasoningSplit, pieces: list[tuple[str, int]]) -> tuple[list[str], list[str]]:
    reasoning, content = [], []
    for text, part in pieces:
        r, c = split.feed(text, part)
        reasoning.append(r)
        content.append(c)
    reasoning.append(split.finish())
    return reasoning, content


R, A = common_pb2.TEXT_PART_REASONING, common_pb2.TEXT_PART_ANSWER


def test_reasoning_split_drops_the_markers_even_split_across_chunks():
    split = ReasoningSplit("<think>", "</think>")
    reasoning, content = _feed(split, [("<thi", R), ("nk>1+1", R), ("=2.</th", R), ("ink>", R), (" 2", A)])
    assert reasoning == ["", "1+1", "=2.", "", "", ""] and "".join(content) == " 2"


def test_reasoning_split_holds_back_only_what_may_still_be_the_end_marker():
    split = ReasoningSplit("<think>", "</think>")
    reasoning, content = _feed(split, [("<think>a<", R), ("b", R), ("</", R)])  # thinking that never ended
    assert reasoning == ["a", "<b", "", "</"] and "".join(content) == ""
    plain = ReasoningSplit("", "")
    assert _feed(plain, [("hello", common_pb2.TEXT_PART_UNSPECIFIED)]) == (["", ""], ["hello"])


def test_streamed_events_and_the_whole_response_say_the_same():
    api = parse("chat", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [gateway_pb2.GenerateStreamResponse(text=t, part=p, token_ids=[i]) for i, (t, p) in
              enumerate([("<think>", R), ("1+1=2.", R), ("</think>", R), (" 2", A)])]
    chunks[-1].finish_reason = common_pb2.FINISH_REASON_STOP
    chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens, chunks[-1].usage.reasoning_tokens = 3, 4, 3
    responder = Responder(api, "id1", "m", ("<think>", "</think>"))
    events = [e for c in chunks for e in responder.chunk(c)]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning", "") for d in deltas) == "1+1=2."
    assert all(d.get("reasoning_content") == d.get("reasoning") for d in deltas)  # the name DeepSeek's API uses too
    assert "".join(d.get("content", "") for d in deltas) == " 2"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 7
    assert all(e["usage"] is None for e in events[:-1]) and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert {e["object"] for e in events} == {"chat.completion.chunk"} and events[0]["id"] == "chatcmpl-id1"
    whole = Responder(parse("chat", CHAT), "id2", "m", ("<think>", "</think>")).whole(chunks)
    assert whole["choices"] == [{"index": 0, "message": {"role": "assistant", "content": " 2", "reasoning": "1+1=2.",
                                                         "reasoning_content": "1+1=2."},
                                 "logprobs": None, "finish_reason": "stop"}]
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3} and whole["object"] == "chat.completion"
