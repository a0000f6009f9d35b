"""Chat template variables (`chat_template_kwargs`): what a client may pass, checked the same at the gateway and the
worker, and carried by the SDK (end to end: tests/gateway/test_openai_http.py)."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2

from cotserve.common.chat import MAX_TEMPLATE_KWARGS, template_kwargs
from cotserve.common.errors import InvalidArgument


def struct(values: dict) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(values)
    return out


def test_variables_pass_with_whole_numbers_as_ints():
    got = template_kwargs(struct({"enable_thinking": False, "reasoning_effort": "low", "depth": 3,
                                  "nested": {"k": [1, 2.5, "x"]}}))
    assert got == {"enable_thinking": False, "reasoning_effort": "low", "depth": 3, "nested": {"k": [1, 2.5, "x"]}}
    assert type(got["depth"]) is int


@pytest.mark.parametrize("values,message", [
    ({"messages": []}, r"chat_template_kwargs\.messages: set by the renderer itself"),
    ({"bos_token": "x"}, r"chat_template_kwargs\.bos_token: set by the renderer itself"),
    ({"_private": 1}, r"chat_template_kwargs\._private: not a template variable name"),
    ({"2fast": 1}, r"chat_template_kwargs\.2fast: not a template variable name"),
    ({"é": 1}, r"chat_template_kwargs\.é: not a template variable name"),
    ({f"v{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)}, r"chat_template_kwargs: 33 variables, at most 32 allowed"),
    ({"big": "x" * 20000}, r"chat_template_kwargs: \d+ bytes of JSON, at most 16384 allowed"),
])
def test_bad_variables_are_refused_naming_them(values, message):
    with pytest.raises(InvalidArgument, match=message):
        template_kwargs(struct(values))


def test_the_sdk_carries_them():
    from cotserve.gateway.v1 import gateway_pb2
    from cotserve.sdk.options import RequestOptions, Sampling, build_request

    req = build_request(gateway_pb2.GenerateStreamRequest, "", [{"role": "user", "content": "1+1="}], Sampling(),
                        RequestOptions(chat_template_kwargs={"enable_thinking": False}), None)
    assert dict(req.chat_template_kwargs) == {"enable_thinking": False}
