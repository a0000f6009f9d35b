"""The OpenAI-compatible API's wire forms, without HTTP (that is `gateway/http.py`): a `/v1/chat/completions` or
`/v1/completions` body read into the gateway's `GenerateStreamRequest` (the one request the relay serves, whichever
edge received it), and the relay's chunks written back as OpenAI's objects, streamed or whole.

What the body may say, and how it maps:

- `model`, `messages` (chat: `content` a string or text parts; an assistant turn's `reasoning` /
  `reasoning_content` goes to the template), `prompt` (completions: a string, or a list of one string),
  `max_completion_tokens` / `max_tokens` (default: 256 for chat, 16 for completions, as OpenAI's), `temperature`,
  `top_p`, `n`, `stop`, `seed`, `logprobs` / `top_logprobs` (completions: `logprobs` is the number of alternatives),
  `stream`, `stream_options.include_usage`, `user` (recorded on the trace).
- `service_tier` chooses the SLA class: `priority` -> REALTIME, `default` and `auto` -> INTERACTIVE, `flex` ->
  BATCH (the response says which tier served it).
- `reasoning_effort` sets the thinking budget of a reasoning model: `none` 0 tokens, `minimal` 64, `low` 256,
  `medium` 1024, `high` no budget.
- `chat_template_kwargs` (chat): variables for the model's chat template, as vLLM and SGLang take them (e.g.
  `{"enable_thinking": false}` for Qwen3); `reasoning_effort` reaches the template as a variable of that name too.
- cotserve's own fields, beside OpenAI's: `top_k`, `ignore_eos`, `stop_token_ids`, `cache_salt`, `pre_processor`,
  `post_processor`, `max_thinking_tokens`, `min_thinking_tokens`, `early_exit` and `self_consistency` (the
  `ReasoningOptions` fields of the gRPC API, same names).
- Structured output: `response_format` (`json_object`, `json_schema` with `strict`), or vLLM's `structured_outputs`
  (`json`, `regex`, `choice`, `grammar`, `json_object`) and `guided_json` / `guided_regex` / `guided_choice` /
  `guided_grammar`; one of them a request. A reasoning model's answer follows it, its thinking stays free.
- `presence_penalty`, `frequency_penalty` and `logit_bias` (OpenAI's), `repetition_penalty` and `min_p` (vLLM's).
- Tool calling: `tools`, `tool_choice`, `parallel_tool_calls`, and `messages` with an assistant's `tool_calls` and
  tool turns' `tool_call_id` (the gRPC API's ToolOptions and ChatMessage fields); calls come back as
  `message.tool_calls` / `delta.tool_calls` with finish reason `tool_calls`.
- Fields OpenAI has that cotserve does not implement are refused by name unless they hold their neutral value
  (`store: false`, `modalities: ["text"]`, ...); any other field is refused as OpenAI refuses one it does not know.

A reasoning model's thinking is returned as vLLM returns it: `message.reasoning` / `delta.reasoning`, without the
model's markers, and the answer in `content`. A sample a settled self-consistency vote stopped ends with
`finish_reason: "cancelled"`; the vote itself is in the response's `self_consistency` field.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from cotserve.common.errors import InvalidArgument
from cotserve.common.sampling import FINISH_PB
from cotserve.common.v1 import common_pb2
from cotserve.gateway.v1 import gateway_pb2

SERVICE_TIERS = {"priority": common_pb2.SLA_CLASS_REALTIME, "default": common_pb2.SLA_CLASS_INTERACTIVE,
                 "auto": common_pb2.SLA_CLASS_INTERACTIVE, "flex": common_pb2.SLA_CLASS_BATCH}
"""`service_tier` -> SLA class."""
TIER_OF_CLASS = {common_pb2.SLA_CLASS_REALTIME: "priority", common_pb2.SLA_CLASS_INTERACTIVE: "default",
                 common_pb2.SLA_CLASS_BATCH: "flex"}
REASONING_EFFORT = {"none": 0, "minimal": 64, "low": 256, "medium": 1024, "high": None}
"""`reasoning_effort` -> reasoning.max_thinking_tokens (None: no budget)."""
DEFAULT_MAX_TOKENS = {"chat": None, "completion": 16}
"""Each endpoint's default max_tokens (None: the gateway's own default, `common.sampling.DEFAULT_MAX_NEW_TOKENS`)."""
FINISH_NAME = {pb: name for name, pb in FINISH_PB.items()}

_NEUTRAL = {  # OpenAI fields cotserve does not implement, accepted only when they ask for nothing
    "store": (False,),
    "modalities": (["text"],), "metadata": ({},), "echo": (False,),
    "suffix": ("",), "prediction": (), "functions": ([],), "function_call": ("none", "auto"),
}
_REASONING_FIELDS = ("max_thinking_tokens", "min_thinking_tokens", "early_exit", "self_consistency")
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
"""vLLM's structured-output fields -> the kind they ask for."""
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                       "json_object": "json_object"}
"""vLLM's `structured_outputs` object's fields -> the kind they ask for."""
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", *_GUIDED)
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
_COMMON_FIELDS = {"model", "stream", "stream_options", "n", "stop", "max_tokens", "temperature", "top_p", "seed",
                  "logprobs", "user", "service_tier", "top_k", "ignore_eos", "stop_token_ids", "cache_salt",
                  "pre_processor", "post_processor", "best_of", *_REASONING_FIELDS, *_STRUCTURED_FIELDS, *_PENALTIES,
                  "logit_bias"}
_FIELDS = {"chat": _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "reasoning_effort",
                                     "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls"},
           "completion": _COMMON_FIELDS | {"prompt"}}
PARAM_OF = {  # the relay's field names (its InvalidArgument messages begin with one) -> this API's
    "sampling.max_new_tokens": "max_tokens", "sampling.temperature": "temperature", "sampling.top_p": "top_p",
    "sampling.top_k": "top_k", "sampling.n": "n", "sampling.stop_token_ids": "stop_token_ids", "sampling.stop": "stop",
    "sampling.top_logprobs": "top_logprobs", "sampling.seed": "seed", "sla_class": "service_tier",
    "prompt / messages": "messages", "pre_processor": "pre_processor", "post_processor": "post_processor",
    "cache_salt": "cache_salt", "model": "model", "prompt": "prompt", "messages": "messages",
    "chat_template_kwargs": "chat_template_kwargs", "tools.choice": "tool_choice", "tool_choice": "tool_choice",
    "tools": "tools",
    "sampling.structured_output": "response_format", "sampling.logit_bias": "logit_bias",
    **{f"sampling.{name}": name for name in _PENALTIES},
    **{f"reasoning.{name}": name for name in _REASONING_FIELDS}, "reasoning": "reasoning_effort",
}
_INT32, _UINT32, _UINT64 = (-(1 << 31), (1 << 31) - 1), (0, (1 << 32) - 1), (0, (1 << 64) - 1)


class ApiError(InvalidArgument):
    """A bad request body; `param` is the field, as this API names it."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


@dataclass(slots=True)
class _Body:
    """A JSON object read field by field, each one type-checked and named in its error."""

    data: dict[str, Any]

    def get(self, name: str, kind: str, default: Any = None) -> Any:
        value = self.data.get(name)
        if value is None:
            return default
        if kind == "integer" and isinstance(value, float) and value.is_integer():
            value = int(value)  # 2.0 is an integer to JSON Schema (and to OpenAI's API): take it as one
        ok = {"string": isinstance(value, str), "boolean": isinstance(value, bool), "object": isinstance(value, dict),
              "integer": isinstance(value, int) and not isinstance(value, bool),
              "number": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
              "array": isinstance(value, list)}[kind]
        if not ok:
            want = "a finite number" if kind == "number" else ("an " if kind[0] in "aeiou" else "a ") + kind
            raise ApiError(name, f"expected {want}, got {_type_name(value)}")
        return value

    def int_in(self, name: str, bounds: tuple[int, int]) -> int | None:
        value = self.get(name, "integer")
        if value is not None and not bounds[0] <= value <= bounds[1]:
            raise ApiError(name, f"{value} is out of range ({bounds[0]}..{bounds[1]})")
        return value


@dataclass(slots=True)
class ApiRequest:
    """One body, read: the relay's request and what shapes the answer."""

    kind: str  # "chat" or "completion"
    request: gateway_pb2.GenerateStreamRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    user: str | None = None
    service_tier: str = "default"


def parse(kind: str, data: Any) -> ApiRequest:
    """A chat (`kind` "chat") or completions ("completion") body as the relay's request; ApiError names the field."""
    if not isinstance(data, dict):
        raise ApiError(None, f"the request body must be a JSON object, got {_type_name(data)}")
    for name, value in data.items():
        if name in _FIELDS[kind] or value is None:
            continue
        if name in _NEUTRAL:
            if value not in _NEUTRAL[name]:
                raise ApiError(name, f"not supported by cotserve (only {', '.join(map(repr, _NEUTRAL[name])) or 'null'} "
                                     "is accepted)")
            continue
        raise ApiError(name, f"Unrecognized request argument supplied: {name}")
    body = _Body(data)
    req = gateway_pb2.GenerateStreamRequest(model=body.get("model", "string", ""))
    api = ApiRequest(kind, req, stream=body.get("stream", "boolean", False), user=body.get("user", "string"))
    options = body.get("stream_options", "object")
    if options is not None:
        if not api.stream:
            raise ApiError("stream_options", "only allowed when stream is true")
        unknown = set(options) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise ApiError("stream_options", f"unknown field {sorted(unknown)[0]!r} (allowed: include_usage)")
        api.include_usage = _Body(options).get("include_usage", "boolean", False)
    if kind == "chat":
        _messages(body, req)
        _template_kwargs(body, req)
        _tools(body, req)
    else:
        _prompt(body, req)
    _sampling(kind, body, api)
    _structured(body, api.request.sampling)
    tier = body.get("service_tier", "string", "auto")
    if tier not in SERVICE_TIERS:
        raise ApiError("service_tier", f"{tier!r} is not one of {', '.join(SERVICE_TIERS)}")
    req.sla_class = SERVICE_TIERS[tier]
    api.service_tier = TIER_OF_CLASS[req.sla_class]
    for name in ("cache_salt", "pre_processor", "post_processor"):
        setattr(req, name, body.get(name, "string", ""))
    _reasoning(body, req)
    return api


def _text_content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiError(where, f"expected a string or an array of text parts, got {_type_name(value)}")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else _type_name(part)
            raise ApiError(f"{where}[{j}]", f"only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported, got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: _Body, req: gateway_pb2.GenerateStreamRequest) -> None:
    messages = body.get("messages", "array")
    if not messages:
        raise ApiError("messages", "required: a non-empty array of {role, content} objects")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(where, f"expected an object, got {_type_name(m)}")
        unknown = set(m) - {"role", "content", "name", "reasoning", "reasoning_content", "tool_calls", "tool_call_id"}
        if unknown:
            raise ApiError(f"{where}.{sorted(unknown)[0]}", "not supported by cotserve (messages take role, content, "
                                                            "name, reasoning, tool_calls and tool_call_id)")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(f"{where}.role", "required: a non-empty string")
        content = m.get("content")
        msg = req.messages.add(role=role, content="" if content is None else _text_content(content, f"{where}.content"))
        for key in ("name", "reasoning", "reasoning_content"):  # each checked, though only one reasoning is kept
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ApiError(f"{where}.{key}", f"expected a string, got {_type_name(m[key])}")
        thought = m.get("reasoning", m.get("reasoning_content"))
        if thought is not None:
            msg.reasoning_content = thought
        _message_tools(m, msg, where)


def _message_tools(m: dict[str, Any], msg: common_pb2.ChatMessage, where: str) -> None:
    """An assistant turn's `tool_calls`, a tool turn's `tool_call_id` and `name`."""
    if m.get("tool_call_id") is not None:
        if not isinstance(m["tool_call_id"], str):
            raise ApiError(f"{where}.tool_call_id", f"expected a string, got {_type_name(m['tool_call_id'])}")
        msg.tool_call_id = m["tool_call_id"]
    if isinstance(m.get("name"), str):
        msg.name = m["name"]
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ApiError(f"{where}.tool_calls", f"expected an array, got {_type_name(calls)}")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or call.get("type", "function") != "function"
                or not isinstance(call.get("id", ""), str) or not isinstance(fn.get("arguments", ""), str)):
            raise ApiError(f"{where}.tool_calls[{j}]", "expected {id: string, type: function, function: {name: string, "
                                                       "arguments: JSON text}}")
        msg.tool_calls.add(id=call.get("id", ""), name=fn["name"], arguments=fn.get("arguments", ""))


def _tools(body: _Body, req: gateway_pb2.GenerateStreamRequest) -> None:
    """`tools` (functions), `tool_choice` and `parallel_tool_calls` as the gRPC API's ToolOptions."""
    tools = body.get("tools", "array", [])
    choice = body.data.get("tool_choice")
    parallel = body.get("parallel_tool_calls", "boolean")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError("tool_choice", "needs tools")
        return
    options = req.tools
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(f"tools[{i}]", "expected {type: function, function: {name, description?, parameters?}}")
        if not isinstance(fn.get("strict", False), bool):
            raise ApiError(f"tools[{i}].function.strict", f"expected a boolean, got {_type_name(fn['strict'])}")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(f"tools[{i}].function.parameters", f"expected a JSON Schema object, got {_type_name(params)}")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ApiError(f"tools[{i}].function.description", f"expected a string, got {_type_name(description)}")
        options.tools.add(name=fn["name"], description=description, parameters=json.dumps(params) if params else "")
    if choice in (None, "auto"):
        options.choice.auto = True
    elif choice in ("none", "required"):
        setattr(options.choice, choice, True)
    elif (isinstance(choice, dict) and choice.get("type", "function") == "function"
          and isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)):
        options.choice.function = choice["function"]["name"]
    else:
        raise ApiError("tool_choice", 'expected "none", "auto", "required" or {"type": "function", "function": {"name"}}')
    if parallel is not None:
        options.parallel_tool_calls = parallel


def _template_kwargs(body: _Body, req: gateway_pb2.GenerateStreamRequest) -> None:
    """`chat_template_kwargs` (checked by the relay, `common.chat`), and `reasoning_effort` as the template variable
    of that name too (gpt-oss's template reads it) unless the kwargs set it."""
    variables = dict(body.get("chat_template_kwargs", "object", {}))
    effort = body.data.get("reasoning_effort")
    if isinstance(effort, str) and effort in REASONING_EFFORT:
        variables.setdefault("reasoning_effort", effort)
    if variables:
        try:
            req.chat_template_kwargs.update(variables)
        except (ValueError, TypeError) as exc:  # a value JSON cannot carry as a Struct value
            raise ApiError("chat_template_kwargs", f"values must be JSON values ({exc})") from None


def _prompt(body: _Body, req: gateway_pb2.GenerateStreamRequest) -> None:
    prompt = body.data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        kind = "a list of several prompts" if isinstance(prompt, list) else _type_name(prompt)
        raise ApiError("prompt", f"expected a string (or a list of one string), got {kind}")
    if not prompt:
        raise ApiError("prompt", "must not be empty")
    req.prompt = prompt


def _sampling(kind: str, body: _Body, api: ApiRequest) -> None:
    sp = api.request.sampling
    max_tokens = body.int_in("max_tokens", _INT32)
    if kind == "chat":
        newer = body.int_in("max_completion_tokens", _INT32)
        if newer is not None and max_tokens is not None and newer != max_tokens:
            raise ApiError("max_completion_tokens", f"{newer} disagrees with max_tokens ({max_tokens}); send one")
        max_tokens = newer if newer is not None else max_tokens
    max_tokens = max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS[kind]
    if max_tokens is not None:
        sp.max_new_tokens = max_tokens
    for name in ("temperature", "top_p", *_PENALTIES):
        value = body.get(name, "number")
        if value is not None:
            setattr(sp, name, value)
    for name, bounds in (("n", _UINT32), ("top_k", _INT32), ("seed", _UINT64)):
        value = body.int_in(name, bounds)
        if value is not None:
            setattr(sp, name, value)
    best_of = body.int_in("best_of", _UINT32)
    if best_of is not None and best_of != (sp.n if sp.HasField("n") else 1):
        raise ApiError("best_of", f"{best_of}: only best_of equal to n is supported")
    stop = body.data.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ApiError("stop", f"expected a string or an array of strings, got {_type_name(stop)}")
        sp.stop.extend(stops)
    ids = [int(t) if isinstance(t, float) and t.is_integer() else t for t in body.get("stop_token_ids", "array", [])]
    if not all(isinstance(t, int) and not isinstance(t, bool) and _UINT32[0] <= t <= _UINT32[1] for t in ids):
        raise ApiError("stop_token_ids", "expected an array of token ids (integers >= 0)")
    sp.stop_token_ids.extend(ids)
    sp.ignore_eos = body.get("ignore_eos", "boolean", False)
    for token, bias in body.get("logit_bias", "object", {}).items():  # token ids as strings (JSON keys), OpenAI's
        if not token.isdigit() or len(token) > 10:
            raise ApiError("logit_bias", f"{token[:20]!r}: keys are token ids (integers >= 0 as strings)")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ApiError("logit_bias", f"the bias of token {token} must be a finite number, got {_type_name(bias)}")
        sp.logit_bias[int(token)] = float(bias)
    if kind == "chat":
        api.logprobs = sp.logprobs = body.get("logprobs", "boolean", False)
        top = body.int_in("top_logprobs", _UINT32)
        if top is not None:
            if not api.logprobs:
                raise ApiError("top_logprobs", "needs logprobs: true")
            sp.top_logprobs = top
    else:  # the legacy API: logprobs is how many alternatives, 0 for the sampled token's alone
        top = body.int_in("logprobs", _UINT32)
        if top is not None:
            api.logprobs = sp.logprobs = True
            sp.top_logprobs = top


def _structured(body: _Body, sp: common_pb2.SamplingParams) -> None:
    """`response_format` (OpenAI's), or vLLM's `structured_outputs` / `guided_*`: at most one format a request."""
    given = [name for name in _STRUCTURED_FIELDS if body.data.get(name) is not None
             and not (name == "response_format" and body.data[name] == {"type": "text"})]
    if len(given) > 1:
        raise ApiError(given[1], f"give one of {', '.join(_STRUCTURED_FIELDS)} (got {given[0]} too)")
    if not given:
        return
    name = given[0]
    so = sp.structured_output
    if name == "response_format":
        _response_format(body.get(name, "object"), so)
    elif name == "structured_outputs":
        options = body.get(name, "object")
        chosen = [key for key in options if options[key] is not None]
        unknown = [key for key in chosen if key not in _STRUCTURED_OUTPUTS]
        if unknown or len(chosen) != 1:
            raise ApiError(name, f"give exactly one of {', '.join(_STRUCTURED_OUTPUTS)}"
                                 + (f" (unknown: {unknown[0]!r})" if unknown else ""))
        _format(f"{name}.{chosen[0]}", _STRUCTURED_OUTPUTS[chosen[0]], options[chosen[0]], so)
    else:
        _format(name, _GUIDED[name], body.data[name], so)


def _response_format(value: dict[str, Any], so: common_pb2.StructuredOutput) -> None:
    kind = value.get("type")
    if kind == "json_object":
        so.json_object = True
    elif kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ApiError("response_format.json_schema", "expected {name, schema: a JSON Schema object, strict?}")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ApiError("response_format.json_schema.strict", f"expected a boolean, got {_type_name(strict)}")
        so.json_schema.schema = json.dumps(spec["schema"])
        so.json_schema.strict = bool(strict)
    else:
        raise ApiError("response_format.type", f"{kind!r} is not one of text, json_object, json_schema")


def _format(param: str, kind: str, value: Any, so: common_pb2.StructuredOutput) -> None:
    """One of vLLM's formats: a JSON Schema (an object, or its JSON text), a regex, a choice or a grammar."""
    if kind == "json_object":
        if value is not True:
            raise ApiError(param, "expected true")
        so.json_object = True
    elif kind == "json_schema":
        if isinstance(value, str):
            so.json_schema.schema = value
        elif isinstance(value, dict):
            so.json_schema.schema = json.dumps(value)
        else:
            raise ApiError(param, f"expected a JSON Schema (an object or its JSON text), got {_type_name(value)}")
        so.json_schema.strict = True
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ApiError(param, f"expected an array of strings, got {_type_name(value)}")
        so.choice.choices.extend(value)
    elif not isinstance(value, str):
        raise ApiError(param, f"expected a string, got {_type_name(value)}")
    else:
        setattr(so, kind, value)


def _reasoning(body: _Body, req: gateway_pb2.GenerateStreamRequest) -> None:
    effort = body.get("reasoning_effort", "string")
    options: dict[str, Any] = {}
    if effort is not None:
        if effort not in REASONING_EFFORT:
            raise ApiError("reasoning_effort", f"{effort!r} is not one of {', '.join(REASONING_EFFORT)}")
        if REASONING_EFFORT[effort] is not None:
            options["max_thinking_tokens"] = REASONING_EFFORT[effort]
    for name in _REASONING_FIELDS:
        value = body.data.get(name)
        if value is None:
            continue
        if name in options:
            raise ApiError(name, "give reasoning_effort or max_thinking_tokens, not both")
        options[name] = value
    if not options:
        return
    try:
        json_format.ParseDict(options, req.reasoning)
    except json_format.ParseError as exc:
        raise ApiError(next(iter(options)) if len(options) == 1 else None, f"{exc}") from None


# ---- responses ----


@dataclass(slots=True)
class ReasoningSplit:
    """One sample's text as reasoning and content deltas: the reasoning part's text without the model's markers
    (held back while it may still be the start of the end marker), everything else content."""

    start: str
    end: str
    raw: str = ""
    sent: int = 0
    closed: bool = False

    def feed(self, text: str, part: int) -> tuple[str, str]:
        """(reasoning, content) this chunk adds."""
        if part == common_pb2.TEXT_PART_REASONING and not self.closed:
            self.raw += text
            return self._take(final=False), ""
        reasoning = "" if self.closed else self._take(final=True)
        self.closed = self.closed or bool(self.raw)
        return reasoning, text

    def finish(self) -> str:
        """What is still held back when the sample ends (thinking that never reached its end marker)."""
        return "" if self.closed else self._take(final=True)

    def _take(self, final: bool) -> str:
        clean = self.raw
        if self.start and clean.startswith(self.start):
            clean = clean[len(self.start):]
        elif self.start and self.start.startswith(clean) and not final:
            return ""
        if final:
            clean = clean.removesuffix(self.end) if self.end else clean
        else:
            clean = clean[:len(clean) - _held(clean, self.end)]
        out = clean[self.sent:]
        self.sent = max(self.sent, len(clean))
        return out


def _held(text: str, marker: str) -> int:
    """Characters at the end of `text` that are (the start of) `marker`."""
    for n in range(min(len(text), len(marker)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def usage_json(usage: common_pb2.Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}}


def _top(entry: common_pb2.TokenLogprob) -> list[dict[str, Any]]:
    return [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)} for t in entry.top_logprobs]


def chat_logprobs(entries) -> list[dict[str, Any]]:
    """`logprobs.content` of a chat choice."""
    return [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token_bytes), "top_logprobs": _top(e)}
            for e in entries]


@dataclass(slots=True)
class CompletionLogprobs:
    """The legacy `logprobs` object of a completions choice, built up chunk by chunk (`text_offset` runs on)."""

    offset: int = 0

    def add(self, entries) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e.token)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({t.token: t.logprob for t in e.top_logprobs})
            out["text_offset"].append(self.offset)
            self.offset += len(e.token)
        return out


@dataclass(slots=True)
class Responder:
    """Writes one request's relay chunks as OpenAI objects: `chunk` for each streamed event, `whole` for the
    response when not streaming. `markers` are the model's reasoning markers (empty: none)."""

    api: ApiRequest
    request_id: str
    model: str
    markers: tuple[str, str] = ("", "")
    created: int = field(default_factory=lambda: int(time.time()))
    _splits: dict[int, ReasoningSplit] = field(default_factory=dict)
    _offsets: dict[int, CompletionLogprobs] = field(default_factory=dict)
    _roles_sent: set[int] = field(default_factory=set)
    _calls_sent: dict[int, int] = field(default_factory=dict)  # tool calls sent per choice

    @property
    def object_id(self) -> str:
        return ("chatcmpl-" if self.api.kind == "chat" else "cmpl-") + self.request_id

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.object_id, "object": obj, "created": self.created, "model": self.model,
                "service_tier": self.api.service_tier}

    def _split(self, index: int) -> ReasoningSplit:
        split = self._splits.get(index)
        if split is None:
            split = self._splits[index] = ReasoningSplit(*self.markers)
        return split

    def _choice_delta(self, chunk: gateway_pb2.GenerateStreamResponse) -> dict[str, Any]:
        finish = FINISH_NAME.get(chunk.finish_reason)
        if self.api.kind == "chat":
            split = self._split(chunk.index)
            # a post-processor's output is all text of its own: no reasoning part to split off
            part = common_pb2.TEXT_PART_UNSPECIFIED if self.api.request.post_processor else chunk.part
            reasoning, content = split.feed(chunk.text, part)
            if finish is not None:
                reasoning += split.finish()
            delta: dict[str, Any] = {}
            if chunk.index not in self._roles_sent:
                self._roles_sent.add(chunk.index)
                delta["role"] = "assistant"
            if reasoning:  # also as reasoning_content: the name DeepSeek's API and most clients read
                delta["reasoning"] = delta["reasoning_content"] = reasoning
            if content or not (reasoning or chunk.tool_calls):
                delta["content"] = content
            if chunk.tool_calls:
                delta["tool_calls"] = self._tool_calls(chunk)
            logprobs = {"content": chat_logprobs(chunk.token_logprobs)} if self.api.logprobs else None
            return {"index": chunk.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        logprobs = self._offsets.setdefault(chunk.index, CompletionLogprobs()).add(chunk.token_logprobs) \
            if self.api.logprobs else None
        return {"index": chunk.index, "text": chunk.text, "logprobs": logprobs, "finish_reason": finish}

    def _tool_calls(self, chunk: gateway_pb2.GenerateStreamResponse) -> list[dict[str, Any]]:
        """A chunk's calls in OpenAI's shape, each with its index among its choice's calls (id and name once, the
        arguments whole)."""
        first = self._calls_sent.get(chunk.index, 0)
        self._calls_sent[chunk.index] = first + len(chunk.tool_calls)
        return [{"index": first + i, "id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}} for i, call in enumerate(chunk.tool_calls)]

    def chunk(self, chunk: gateway_pb2.GenerateStreamResponse) -> list[dict[str, Any]]:
        """The stream events one relay chunk makes: its choice's delta, then (on the stream's last chunk) the vote
        and, with include_usage, the usage event."""
        obj = "chat.completion.chunk" if self.api.kind == "chat" else "text_completion"
        event = {**self._head(obj), "choices": [self._choice_delta(chunk)]}
        if chunk.HasField("self_consistency"):
            event["self_consistency"] = json_format.MessageToDict(chunk.self_consistency, preserving_proto_field_name=True)
        if self.api.include_usage:
            event["usage"] = None
        events = [event]
        if chunk.HasField("usage") and self.api.include_usage:
            events.append({**self._head(obj), "choices": [], "usage": usage_json(chunk.usage)})
        return events

    def whole(self, chunks: list[gateway_pb2.GenerateStreamResponse]) -> dict[str, Any]:
        """The non-streamed response: every sample's deltas joined."""
        choices: dict[int, dict[str, Any]] = {}
        usage, vote = common_pb2.Usage(), None
        for chunk in chunks:
            delta = self._choice_delta(chunk)
            choice = choices.setdefault(chunk.index, {"index": chunk.index, "finish_reason": None, "logprobs": None,
                                                      "parts": {"content": [], "reasoning": [], "text": []},
                                                      "tool_calls": []})
            choice["tool_calls"].extend(delta.get("delta", {}).get("tool_calls", []))
            for name in ("content", "reasoning"):
                choice["parts"][name].append(delta.get("delta", {}).get(name, ""))
            choice["parts"]["text"].append(delta.get("text", ""))
            if delta["logprobs"] is not None:
                choice["logprobs"] = _merge_logprobs(choice["logprobs"], delta["logprobs"])
            choice["finish_reason"] = delta["finish_reason"] or choice["finish_reason"]
            if chunk.HasField("usage"):
                usage = chunk.usage
            if chunk.HasField("self_consistency"):
                vote = json_format.MessageToDict(chunk.self_consistency, preserving_proto_field_name=True)
        out = {**self._head("chat.completion" if self.api.kind == "chat" else "text_completion"),
               "choices": [_finish_choice(self.api.kind, choices[i]) for i in sorted(choices)],
               "usage": usage_json(usage)}
        if vote is not None:
            out["self_consistency"] = vote
        return out


def _merge_logprobs(have: dict[str, list] | None, more: dict[str, list]) -> dict[str, list]:
    if have is None:
        return {k: list(v) for k, v in more.items()}
    for k, v in more.items():
        have[k].extend(v)
    return have


def _finish_choice(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    parts, calls = choice.pop("parts"), choice.pop("tool_calls")
    if kind != "chat":
        return {"index": choice["index"], "text": "".join(parts["text"]), "logprobs": choice["logprobs"],
                "finish_reason": choice["finish_reason"]}
    message: dict[str, Any] = {"role": "assistant", "content": "".join(parts["content"])}
    reasoning = "".join(parts["reasoning"])
    if reasoning:  # also as reasoning_content: the name DeepSeek's API and most clients read
        message["reasoning"] = message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
        message["content"] = message["content"] or None
    return {"index": choice["index"], "message": message, "logprobs": choice["logprobs"],
            "finish_reason": choice["finish_reason"]}


def models_json(models: dict[str, list], created: int = 0) -> dict[str, Any]:
    """`GET /v1/models`: every served name and alias (requests may use either), each with its model as `root`."""
    data = []
    for name, workers in sorted(models.items()):
        info = workers[0].info
        for alias in [name, *sorted({a for w in workers for a in w.info.model_aliases})]:
            data.append({"id": alias, "object": "model", "created": created, "owned_by": "cotserve", "root": name,
                         "max_model_len": info.max_context_tokens})
    return {"object": "list", "data": data}
