"""Tool calling: a request's tools checked at the edge (`ToolSpec`), in the shapes chat templates read them, and the
parser that takes the calls out of a model's answer as it streams (`ToolCallSplit`).

One format for now, Hermes' (`hermes`): the model writes each call as `<tool_call>` + a JSON object with `name` and
`arguments` + `</tool_call>`, as Qwen2.5, Qwen3 and the Hermes models are trained to and their chat templates render
past calls; a worker whose template writes `<tool_call>` parses with it (`--tool-call-parser`). A required or named
choice is enforced by the grammar engine (`worker/grammar.py` compiles `grammar_spec`'s format). No torch, no grpc.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from cotserve.common.errors import InvalidArgument
from cotserve.common.v1 import common_pb2

PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 4  # calls a required choice allows in one answer (the grammar spells out each count)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(slots=True, frozen=True)
class ToolSpec:
    """A request's checked tools: each (name, description, parameters schema), and the choice ("auto", "none",
    "required" or a function's name)."""

    tools: tuple[tuple[str, str, dict[str, Any]], ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def shown(self) -> bool:
        """The template shows the tools and the answer is parsed for calls (every choice but none)."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """The answer must be calls (required, or a named function)."""
        return self.choice not in ("auto", "none")

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates read them (OpenAI's shape)."""
        return [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
                for n, d, p in self.tools]

    def grammar_spec(self) -> str:
        """What `worker/grammar.py` compiles for a forced choice: the functions allowed and how many calls."""
        names = [n for n, _, _ in self.tools] if self.choice == "required" else [self.choice]
        return json.dumps({"calls": [{"name": n, "parameters": p} for n, _, p in self.tools if n in names],
                           "max_calls": MAX_PARALLEL_CALLS if self.parallel and self.choice == "required" else 1})


def tools_from_pb(options: common_pb2.ToolOptions) -> ToolSpec:
    """INVALID_ARGUMENT naming the field for a bad tool, a duplicate name, or a choice of a function not given."""
    if not 1 <= len(options.tools) <= MAX_TOOLS:
        raise InvalidArgument(f"tools: {len(options.tools)} tools, allowed 1..{MAX_TOOLS}")
    tools, seen = [], set()
    for i, tool in enumerate(options.tools):
        if not NAME.fullmatch(tool.name):
            raise InvalidArgument(f"tools[{i}].name: {tool.name!r}: 1..64 of a-z, A-Z, 0-9, _ and -")
        if tool.name in seen:
            raise InvalidArgument(f"tools[{i}].name: {tool.name!r} is given twice")
        seen.add(tool.name)
        try:
            params = json.loads(tool.parameters) if tool.parameters else {"type": "object"}
        except ValueError as exc:
            raise InvalidArgument(f"tools[{i}].parameters: not JSON ({exc})") from None
        if not isinstance(params, dict):
            raise InvalidArgument(f"tools[{i}].parameters: a JSON Schema object, got {type(params).__name__}")
        tools.append((tool.name, tool.description, params))
    kind = options.choice.WhichOneof("choice") if options.HasField("choice") else None
    choice = options.choice.function if kind == "function" else (kind or "auto")
    if kind == "function" and choice not in seen:
        raise InvalidArgument(f"tool_choice: function {choice!r} is not among the tools ({', '.join(sorted(seen))})")
    parallel = options.parallel_tool_calls if options.HasField("parallel_tool_calls") else True
    return ToolSpec(tuple(tools), choice, parallel)


def template_tool_calls(calls) -> list[dict[str, Any]]:
    """An assistant turn's calls (`common_pb2.ToolCall`) as chat templates read them (OpenAI's shape; arguments
    parsed, as Qwen's templates write them out, or the text when it is not JSON)."""
    out = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.arguments) if call.arguments else {}
        except ValueError:
            arguments = call.arguments
        out.append({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}})
    return out


def resolve_parser(name: str, template_source: str | None) -> str:
    """`--tool-call-parser`: auto (hermes when the chat template writes `<tool_call>`, else none), hermes or none;
    "" for none."""
    if name == "auto":
        return "hermes" if template_source and OPEN in template_source else ""
    if name == "none":
        return ""
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser: {name!r}, allowed: auto, none, {', '.join(PARSERS)}")
    return name


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallSplit:
    """One sample's answer text, streamed, as (content, calls): text outside `<tool_call>` blocks is content (held
    back while it may be the start of one); each block that closes on a JSON object with a string `name` and object
    `arguments` is a call; a block that does not is content as written (the model left the format). Whitespace after
    a call goes out only if more content follows (not before another call, nor at the end), however the text is cut."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet given out: a possible start of OPEN, or an open block
        self._blank = ""  # whitespace since the last call, held until content or a call follows
        self.calls: list[common_pb2.ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[common_pb2.ToolCall]]:
        self._pending += text
        content: list[str] = []
        calls: list[common_pb2.ToolCall] = []
        while True:
            start = self._pending.find(OPEN)
            if start == -1:
                keep = _partial_suffix(self._pending, OPEN)
                self._emit(self._pending[:len(self._pending) - keep], content)
                self._pending = self._pending[len(self._pending) - keep:]
                break
            self._emit(self._pending[:start], content)
            end = self._pending.find(CLOSE, start)
            if end == -1:
                self._pending = self._pending[start:]
                break
            block = self._pending[start:end + len(CLOSE)]
            self._pending = self._pending[end + len(CLOSE):]
            call = _parse(block[len(OPEN):-len(CLOSE)])
            if call is None:
                self._emit(block, content)
            else:
                self._blank = ""  # (whitespace between two calls is no content)
                calls.append(call)
                self.calls.append(call)
        return "".join(content), calls

    def _emit(self, text: str, content: list[str]) -> None:
        if self.calls or self._blank:
            if not text.strip():
                self._blank += text
                return
            text, self._blank = self._blank + text, ""
        content.append(text)

    def finish(self) -> str:
        """What is left (an unclosed block, or a held-back start) as content."""
        rest, self._pending = self._pending, ""
        if rest:
            rest, self._blank = self._blank + rest, ""
        return rest


def _parse(body: str) -> common_pb2.ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return common_pb2.ToolCall(id=new_call_id(), name=value["name"], arguments=json.dumps(arguments))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (text that may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
