"""`common.tools`: the request's tools checked at the edge, and Hermes' tool calls taken out of an answer however
its text is cut into chunks."""

from __future__ import annotations

import json

import pytest

from cotserve.common.errors import InvalidArgument
from cotserve.common.tools import ToolCallSplit, resolve_parser, tools_from_pb
from cotserve.common.v1 import common_pb2

ANSWER = ('Let me check.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
          '<tool_call>\n{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>'
          ' and <tool_call>not json</tool_call> <tool_')


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 11, 64, len(ANSWER)])
def test_calls_come_out_whole_and_the_rest_is_content_however_the_text_is_cut(piece):
    split, content, calls = ToolCallSplit(), [], []
    for i in range(0, len(ANSWER), piece):
        text, done = split.feed(ANSWER[i:i + piece])
        content.append(text)
        calls.extend(done)
    content.append(split.finish())
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3}), ("weather", {"city": "Oslo"})]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls) and calls[0].id != calls[1].id
    # the text outside the calls, the block that is not a call, and an unclosed start, in order
    assert "".join(content) == "Let me check. and <tool_call>not json</tool_call> <tool_"


def test_tools_are_checked_naming_the_field():
    def options(*tools, choice=None, **kw):
        out = common_pb2.ToolOptions(tools=[common_pb2.Tool(**t) for t in tools], **kw)
        if choice is not None:
            out.choice.CopyFrom(choice)
        return out

    spec = tools_from_pb(options({"name": "add", "parameters": '{"type": "object"}'}, {"name": "x-1"},
                                 choice=common_pb2.ToolChoice(function="add"), parallel_tool_calls=False))
    assert (spec.choice, spec.parallel, spec.forced, spec.shown) == ("add", False, True, True)
    assert json.loads(spec.grammar_spec()) == {"calls": [{"name": "add", "parameters": {"type": "object"}}], "max_calls": 1}
    for bad, message in [(options(), r"tools: 0 tools"),
                         (options({"name": "a b"}), r"tools\[0\].name: 'a b'"),
                         (options({"name": "a"}, {"name": "a"}), r"tools\[1\].name: 'a' is given twice"),
                         (options({"name": "a", "parameters": "[1]"}), r"tools\[0\].parameters: a JSON Schema object"),
                         (options({"name": "a"}, choice=common_pb2.ToolChoice(function="b")), r"tool_choice: function 'b'")]:
        with pytest.raises(InvalidArgument, match=message):
            tools_from_pb(bad)
    assert resolve_parser("auto", "{{ '<tool_call>' }}") == "hermes" and resolve_parser("auto", "plain") == ""
    assert resolve_parser("none", "<tool_call>") == "" and resolve_parser("hermes", None) == "hermes"
