"""The OpenAPI document of the gateway's HTTP API, served at `/openapi.json`: what `gateway/openai_api.py` reads and
writes, with the ranges it enforces (`common/sampling.py`'s limits), so that clients can be generated from it and
`tests/gateway/test_openapi_fuzz.py` can fuzz the API with schemathesis against it.

Written by hand beside the parser rather than generated from it: the parser reads a body field by field to name the
bad one in OpenAI's error shape, and a model-validation layer in front of it (pydantic) would answer in its own.
A test checks both agree: every field the parser accepts is in the document and every documented field is accepted.
"""

from __future__ import annotations

from typing import Any

from cotserve.common import chat, sampling

_INT32 = {"type": "integer", "minimum": -(1 << 31), "maximum": (1 << 31) - 1}
_UINT32 = {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1}
_STOP = {"oneOf": [{"type": "string", "minLength": 1, "maxLength": sampling.MAX_STOP_STRING_CHARS},
                   {"type": "array", "maxItems": sampling.MAX_STOP_STRINGS,
                    "items": {"type": "string", "minLength": 1, "maxLength": sampling.MAX_STOP_STRING_CHARS}}]}
_EARLY_EXIT = {"type": "object", "additionalProperties": False, "properties": {
    "probe_every_tokens": {"type": "integer", "minimum": 1, "maximum": (1 << 32) - 1},
    "probe_every_steps": {"type": "integer", "minimum": 1, "maximum": (1 << 32) - 1},
    "agree": {"type": "integer", "minimum": 1, "maximum": sampling.MAX_AGREE},
    "min_confidence": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "probe_max_tokens": {"type": "integer", "minimum": 1, "maximum": sampling.MAX_PROBE_TOKENS}}}
_SELF_CONSISTENCY = {"type": "object", "additionalProperties": False, "properties": {
    "max_samples": {"type": "integer", "minimum": 1, "maximum": sampling.MAX_VOTE_SAMPLES},
    "min_samples": {"type": "integer", "minimum": 1, "maximum": sampling.MAX_VOTE_SAMPLES},
    "rule": {"type": "string", "enum": ["window", "posterior"]},
    "window": {"type": "integer", "minimum": 1, "maximum": sampling.MAX_VOTE_SAMPLES},
    "threshold": {"type": "number", "minimum": 0.5, "exclusiveMaximum": 1},
    "drop_fraction": {"type": "number", "minimum": 0, "maximum": 0.9},
    "confidence_weighted": {"type": "boolean"}}}

_TEXT_SPEC = {"type": "string", "minLength": 1, "maxLength": sampling.MAX_STRUCTURED_SPEC_CHARS}
_JSON_SCHEMA = {"oneOf": [{"type": "object"}, _TEXT_SPEC], "description": "A JSON Schema, or its JSON text."}
_CHOICES = {"type": "array", "minItems": 1, "maxItems": sampling.MAX_CHOICES,
            "items": {"type": "string", "minLength": 1, "maxLength": sampling.MAX_CHOICE_CHARS}}

COMMON: dict[str, Any] = {
    "model": {"type": "string", "description": "A served model's name or alias (default: the only one served)."},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "additionalProperties": False,
                       "properties": {"include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}}},
    "n": {"type": "integer", "minimum": 1, "maximum": sampling.MAX_SAMPLES},
    "best_of": {"type": "integer", "minimum": 1, "maximum": sampling.MAX_SAMPLES, "description": "Only equal to n."},
    "stop": _STOP,
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": (1 << 32) - 1,
                   "description": "At most the model's context less the prompt."},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "seed": {"type": "integer", "minimum": 0, "maximum": (1 << 64) - 1},
    "user": {"type": "string"},
    "service_tier": {"type": "string", "enum": ["auto", "default", "priority", "flex"],
                     "description": "priority: REALTIME, default/auto: INTERACTIVE, flex: BATCH."},
    "top_k": {"type": "integer", "minimum": 0, "maximum": (1 << 31) - 1, "description": "0: off; at most the vocabulary."},
    "ignore_eos": {"type": "boolean"},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": (1 << 31) - 1}},
    "cache_salt": {"type": "string"},
    "pre_processor": {"type": "string", "description": "A sandbox module run on the prompt."},
    "post_processor": {"type": "string", "description": "A sandbox module run on the answer."},
    "max_thinking_tokens": {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1},
    "min_thinking_tokens": {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1},
    "early_exit": _EARLY_EXIT,
    "self_consistency": _SELF_CONSISTENCY,
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2, "description": "1: off."},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "logit_bias": {"type": "object", "maxProperties": sampling.MAX_LOGIT_BIAS,
                   "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                   "description": "Token id (as a string) -> bias added to its logit."},
    "response_format": {"oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["schema"], "properties": {
                "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}}],
        "description": "The answer's format (a reasoning model's thinking stays free). One structured-output field a "
                       "request: this, structured_outputs or a guided_* field."},
    "structured_outputs": {"type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False,
                           "properties": {"json": _JSON_SCHEMA, "regex": _TEXT_SPEC, "choice": _CHOICES,
                                          "grammar": _TEXT_SPEC, "json_object": {"const": True}},
                           "description": "vLLM's: exactly one format."},
    "guided_json": _JSON_SCHEMA,
    "guided_regex": _TEXT_SPEC,
    "guided_choice": _CHOICES,
    "guided_grammar": {**_TEXT_SPEC, "description": "EBNF (GBNF), start rule root."},
}
_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
         "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_MESSAGE = {"type": "object", "required": ["role"], "additionalProperties": False, "properties": {
    "role": {"type": "string", "minLength": 1, "maxLength": 64},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _PART}, {"type": "null"}]},
    # (an optional field sent as null is read as absent, as OpenAI reads it)
    "name": {"type": ["string", "null"]},
    "reasoning": {"type": ["string", "null"]}, "reasoning_content": {"type": ["string", "null"]},
    "tool_call_id": {"type": ["string", "null"]},
    "tool_calls": {"type": ["array", "null"], "items": {"type": "object", "required": ["function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string"}}}}}}}}
_TOOL = {"type": "object", "required": ["function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}}


def _body(required: str, properties: dict[str, Any]) -> dict[str, Any]:
    """A request body's schema: `properties`, each optional one also null (read as absent, as OpenAI reads it)."""
    return {"type": "object", "required": [required], "additionalProperties": False,
            "properties": {name: schema if name == required else {"anyOf": [schema, {"type": "null"}]}
                           for name, schema in properties.items()}}


CHAT = _body("messages", {
    **COMMON,
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "max_completion_tokens": COMMON["max_tokens"],
    "logprobs": {"type": "boolean"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": sampling.MAX_TOP_LOGPROBS,
                     "description": "Needs logprobs: true."},
    "reasoning_effort": {"type": "string", "enum": ["none", "minimal", "low", "medium", "high"]},
    "tools": {"type": "array", "maxItems": 128, "items": _TOOL,
              "description": "Functions the model may call (names unique); needs a model whose worker parses calls."},
    "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                              {"type": "object", "required": ["function"], "properties": {
                                  "type": {"const": "function"},
                                  "function": {"type": "object", "required": ["name"],
                                               "properties": {"name": {"type": "string"}}}}}]},
    "parallel_tool_calls": {"type": "boolean"},
    "chat_template_kwargs": {"type": "object", "maxProperties": chat.MAX_TEMPLATE_KWARGS,
                             "propertyNames": {"pattern": f"^{chat.NAME.pattern}$", "not": {"enum": sorted(chat.RESERVED)}},
                             "description": "Variables for the model's chat template (e.g. enable_thinking)."},
})
COMPLETION = _body("prompt", {
    **COMMON,
    "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}}]},
    "logprobs": {"type": "integer", "minimum": 0, "maximum": sampling.MAX_TOP_LOGPROBS},
})
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _errors(*codes: int) -> dict[str, Any]:
    reasons = {400: "A field is invalid (named in param).", 401: "No or a wrong API key.",
               404: "No such model.", 408: "The body did not arrive in time.", 413: "The body is too large.",
               415: "The body is not application/json.", 429: "A quota or rate limit, or too many connections.",
               503: "No worker can serve the model now, or the request was shed.",
               504: "The deadline passed."}
    return {str(c): {"description": reasons[c], "content": {"application/json": {"schema": ERROR}}} for c in codes}


def _generate(summary: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": "The completion (JSON), or a stream of its chunks (server-sent events).",
                                  "content": {"application/json": {"schema": {"type": "object"}},
                                              "text/event-stream": {"schema": {"type": "string"}}}},
                          **_errors(400, 401, 404, 408, 413, 415, 429, 503, 504)}}


def document(version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of this gateway's HTTP API (public: it names no model, the models are behind the
    API key)."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "cotserve gateway: OpenAI-compatible API", "version": version},
        "components": {"securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                                      "description": "A tenant's API key (none without a tenants file)."}}},
        "security": [{"apiKey": []}, {}],
        "paths": {
            "/v1/chat/completions": {"post": _generate("A chat completion.", CHAT)},
            "/v1/completions": {"post": _generate("A text completion.", COMPLETION)},
            "/v1/models": {"get": {"summary": "The models served.", "responses": {
                "200": {"description": "A list of models.", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["object", "data"],
                    "properties": {"object": {"const": "list"}, "data": {"type": "array"}}}}}},
                **_errors(401)}}},
            "/v1/models/{model}": {"get": {
                "summary": "One served model (a name or an alias).",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "The model.", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["id", "object", "created", "owned_by"]}}}}, **_errors(401, 404)}}},
            "/health": {"get": {"summary": "Whether a worker is in rotation.", "security": [{}], "responses": {
                "200": {"description": "Serving."}, **_errors(503)}}},
        },
    }
