"""Chat requests' template variables (`chat_template_kwargs`): what a client may pass to the model's chat template,
checked once for the gateway (at the edge) and the worker (before it renders). No grpc."""

from __future__ import annotations

import json
import re
from typing import Any

from cotserve.common.errors import InvalidArgument

MAX_TEMPLATE_KWARGS = 32
"""Variables one request may pass at most."""
MAX_TEMPLATE_KWARGS_BYTES = 16 << 10
"""Their JSON at most (a template reads flags and short strings; anything larger belongs in the messages)."""
RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token", "unk_token",
                      "pad_token", "raise_exception", "strftime_now", "namespace"})
"""Names the renderer itself sets: a client's variable may not replace them."""
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
"""A variable's name."""


def template_kwargs(struct: Any) -> dict[str, Any]:
    """A `google.protobuf.Struct` of template variables as a dict; InvalidArgument naming `chat_template_kwargs`
    and the bad name when there are too many, a name is not an identifier or is the renderer's own, or they are too
    large. Numbers arrive as JSON numbers (floats): a whole number is passed as an int, as a template expects."""
    from google.protobuf import json_format

    values = json_format.MessageToDict(struct)
    if len(values) > MAX_TEMPLATE_KWARGS:
        raise InvalidArgument(f"chat_template_kwargs: {len(values)} variables, at most {MAX_TEMPLATE_KWARGS} allowed")
    for name in values:
        if not NAME.fullmatch(name):
            raise InvalidArgument(f"chat_template_kwargs.{name[:64]}: not a template variable name (ASCII letters, "
                                  "digits and _, starting with a letter)")
        if name in RESERVED:
            raise InvalidArgument(f"chat_template_kwargs.{name}: set by the renderer itself, cannot be replaced")
    size = len(json.dumps(values))
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidArgument(f"chat_template_kwargs: {size} bytes of JSON, at most {MAX_TEMPLATE_KWARGS_BYTES} allowed")
    return {name: _whole(value) for name, value in values.items()}


def _whole(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    return value
