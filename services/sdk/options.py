"""A request's options as typed objects (`Sampling`, `RequestOptions`; reasoning is `types.Reasoning`), and the
keyword conveniences of the clients' `generate` / `stream`, made from the objects' fields once (`with_options`): a new
sampling field is one line in `Sampling` (and the proto), and every method takes it as a keyword."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import grpc

from cotserve.common.sampling import SLA_PB_BY_NAME
from cotserve.common.v1 import common_pb2
from cotserve.sdk.errors import InvalidArgument
from cotserve.sdk.types import Reasoning

SLA_CLASSES = SLA_PB_BY_NAME  # "realtime", "interactive", "batch"


@dataclass(slots=True, frozen=True)
class Sampling:
    """How tokens are drawn (None: the server's default)."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Sequence[str] | None = None  # stop strings: the text ends before the first one
    stop_token_ids: Sequence[int] | None = None
    logprobs: bool = False  # each token's log-probability in the chunks and the result
    ignore_eos: bool = False  # generate on past the end-of-sequence token, up to max_new_tokens
    n: int | None = None  # samples of the prompt (1..16): the result's `choices`, the chunks' `index`
    presence_penalty: float | None = None  # -2..2, subtracted once from each generated token's logit
    frequency_penalty: float | None = None  # -2..2, subtracted per time a token was generated
    repetition_penalty: float | None = None  # (0, 2], 1 off: seen tokens' positive logits divided, negative multiplied
    min_p: float | None = None  # 0..1: tokens below min_p x the likeliest one's probability are left out
    logit_bias: Mapping[int, float] | None = None  # token id -> -100..100 added to its logit
    # structured output, one of these (a reasoning model's answer follows it; its thinking stays free):
    json_schema: Mapping[str, Any] | str | None = None  # the answer is JSON that validates against this schema
    json_object: bool = False  # the answer is a JSON object
    regex: str | None = None  # the answer matches this regular expression
    choice: Sequence[str] | None = None  # the answer is one of these strings
    grammar: str | None = None  # the answer follows this EBNF grammar (GBNF; start rule `root`)

    def to_pb(self) -> common_pb2.SamplingParams:
        """The proto message, field by field of the same name (None: not sent, so the server's default holds);
        InvalidArgument when more than one structured-output format is given."""
        sp = common_pb2.SamplingParams()
        formats = [name for name in _FORMATS if getattr(self, name) not in (None, False)]
        if len(formats) > 1:
            raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"{formats[1]}: give one structured-output format "
                                  f"(got {formats[0]} too)")
        for name in formats:
            self._format(sp.structured_output, name, getattr(self, name))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in _FORMATS:
                continue
            if isinstance(value, Mapping):
                getattr(sp, f.name).update(value)
                continue
            if isinstance(value, (list, tuple)):
                getattr(sp, f.name).extend(value)
            else:
                setattr(sp, f.name, value)
        return sp


    @staticmethod
    def _format(so: common_pb2.StructuredOutput, name: str, value: Any) -> None:
        if name == "json_schema":
            so.json_schema.schema = value if isinstance(value, str) else json.dumps(value)
            so.json_schema.strict = True
        elif name == "json_object":
            so.json_object = True
        elif name == "choice":
            so.choice.choices.extend(value)
        else:
            setattr(so, name, value)


_FORMATS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True, frozen=True)
class RequestOptions:
    """Where and how a request is served, besides sampling and reasoning."""

    model: str = ""  # a served model's name or alias ("": the gateway's only model)
    sla: str | int | None = None  # "realtime", "interactive" (the default) or "batch", or a common_pb2.SlaClass
    post_processor: str = ""  # a sandbox module run on each sample's completed text
    pre_processor: str = ""  # a sandbox module run on the prompt
    cache_salt: str = ""  # narrows who shares the worker's cached prompt blocks with this request
    tools: Sequence[Mapping[str, Any]] | None = None  # functions the model may call (with messages): each {name,
    # description, parameters (a JSON Schema)}; the result's `tool_calls` has the calls it made
    tool_choice: str | None = None  # "auto" (the default with tools), "none", "required", or a function's name
    parallel_tool_calls: bool | None = None  # several calls in one answer (default: yes)
    chat_template_kwargs: Mapping[str, Any] | None = None  # variables for the chat template (with messages), e.g.
    # {"enable_thinking": False}

    def sla_pb(self) -> int:
        """The SLA class as the proto's enum; InvalidArgument names the allowed classes."""
        if not isinstance(self.sla, str):
            return self.sla or common_pb2.SLA_CLASS_UNSPECIFIED
        if self.sla.lower() not in SLA_CLASSES:
            raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"sla: {self.sla!r} is not an SLA class (allowed: {', '.join(SLA_CLASSES)})")
        return SLA_CLASSES[self.sla.lower()]


OPTION_TYPES: dict[str, type] = {"sampling": Sampling, "options": RequestOptions}
"""The option objects a method decorated with `with_options` takes, by parameter name."""

_FIELDS = {kind: tuple(f.name for f in dataclasses.fields(cls)) for kind, cls in OPTION_TYPES.items()}

F = TypeVar("F", bound=Callable)


def collect_options(kwargs: dict) -> dict:
    """`kwargs` with every option field given as a keyword moved into its option object (a keyword overrides the
    same field of an object also given)."""
    for kind, cls in OPTION_TYPES.items():
        given = {name: kwargs.pop(name) for name in _FIELDS[kind] if name in kwargs}
        base = kwargs.get(kind) or cls()
        kwargs[kind] = dataclasses.replace(base, **given) if given else base
    return kwargs


def with_options(method: F) -> F:
    """Let `method` (which takes `sampling` and `options` objects) also take each of their fields as a keyword of its
    own: `generate("2+2=", max_new_tokens=8, sla="batch")`. Its signature (for help() and editors) lists them."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        return method(*args, **collect_options(kwargs))

    sig = inspect.signature(method)
    extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
             for cls in OPTION_TYPES.values() for f in dataclasses.fields(cls)]
    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *extra])  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def build_request(cls, prompt: str, messages: Sequence[Mapping[str, str]] | None, sampling: Sampling,
                  options: RequestOptions, reasoning: Reasoning | None):
    """A gateway GenerateRequest or GenerateStreamRequest (`cls`); InvalidArgument names a bad chat message key or SLA
    class."""
    turns = []
    for i, m in enumerate(messages or ()):
        unknown = set(m) - {"role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name"}
        if unknown:
            raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"messages[{i}]: unknown key(s) "
                                  f"{', '.join(sorted(unknown))} (allowed: role, content, reasoning_content, "
                                  "tool_calls, tool_call_id, name)")
        turn = common_pb2.ChatMessage(role=m.get("role", ""), content=m.get("content") or "",
                                      reasoning_content=m.get("reasoning_content") or "",
                                      tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or "")
        for call in m.get("tool_calls") or ():  # the result's ToolCall objects, or OpenAI's dicts
            if isinstance(call, Mapping):
                fn = call.get("function", call)
                turn.tool_calls.add(id=call.get("id", ""), name=fn["name"], arguments=fn.get("arguments", ""))
            else:
                turn.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
        turns.append(turn)
    req = cls(prompt=prompt, messages=turns, model=options.model, sampling=sampling.to_pb(), sla_class=options.sla_pb(),
              post_processor=options.post_processor, pre_processor=options.pre_processor, cache_salt=options.cache_salt)
    if reasoning is not None:
        req.reasoning.CopyFrom(reasoning.to_pb())
    if options.chat_template_kwargs:
        req.chat_template_kwargs.update(dict(options.chat_template_kwargs))
    if options.tools:
        _tools(req.tools, options.tools, options.tool_choice, options.parallel_tool_calls)
    return req


def _tools(out: common_pb2.ToolOptions, tools: Sequence[Mapping[str, Any]], choice: str | None,
           parallel: bool | None) -> None:
    """`tools` (each {name, description?, parameters?}, or OpenAI's {type: function, function: {...}}) and the
    choice: "auto" (None), "none", "required" or a function's name."""
    for tool in tools:
        fn = tool.get("function", tool)
        params = fn.get("parameters")
        out.tools.add(name=fn["name"], description=fn.get("description", ""),
                      parameters=json.dumps(params) if isinstance(params, Mapping) else (params or ""))
    if choice in (None, "auto", "none", "required"):
        setattr(out.choice, choice or "auto", True)
    else:
        out.choice.function = choice
    if parallel is not None:
        out.parallel_tool_calls = parallel
