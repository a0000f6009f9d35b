"""A request's tool calls taken out of its stream (`common.tools.ToolCallSplit`, one per sample): the answer's text
outside the calls stays text, each call rides on the chunk where its text ended, and a sample that called a tool
ends with finish reason TOOL_CALLS. The thinking of a reasoning model is never parsed."""

from __future__ import annotations

from cotserve.common.tools import ToolCallSplit
from cotserve.common.v1 import common_pb2
from cotserve.gateway.v1 import gateway_pb2


class ToolCalls:
    def __init__(self) -> None:
        self._splits: dict[int, ToolCallSplit] = {}
        self._content: dict[int, list[str]] = {}

    def take(self, out: gateway_pb2.GenerateStreamResponse) -> None:
        """Rewrite `out` in place: its answer text without the calls, the calls it completed in `tool_calls`."""
        split = self._splits.setdefault(out.index, ToolCallSplit())
        if out.part != common_pb2.TEXT_PART_REASONING:
            text, calls = split.feed(out.text)
            out.text = text
            out.tool_calls.extend(calls)
            self._content.setdefault(out.index, []).append(text)
        if out.finish_reason:
            rest = split.finish()
            out.text += rest
            content = "".join(self._content.pop(out.index, [])) + rest
            if out.HasField("answer_text"):
                out.answer_text = content.strip() if split.calls else out.answer_text
            if split.calls and out.finish_reason == common_pb2.FINISH_REASON_STOP:
                out.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
