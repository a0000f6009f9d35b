"""A model's chat template: the Jinja2 program that turns chat messages into the prompt text the model was trained
on, rendered as Hugging Face renders it (issue 17).

Where it comes from: `chat_template.jinja` in the model folder, else `chat_template` in `tokenizer_config.json` (a
string, or a list of named templates of which "default" is used). Templates come from model repositories, so they
are untrusted code: they run in Jinja2's immutable sandbox (no attribute starting with `_`, no mutation of the
values passed in, no I/O), with what Hugging Face's `apply_chat_template` gives them and nothing more:

- `messages` (each a dict with `role` and `content`, plus any other keys the caller gave, e.g. `reasoning_content`),
  `add_generation_prompt`, `tools` (JSON schemas, when given), the tokenizer's special tokens by name (`bos_token`,
  `eos_token`, `unk_token`, `pad_token`, ...), and any extra variables (e.g. `enable_thinking`);
- `raise_exception(message)` (the render fails with that message), `strftime_now(format)`, `namespace(...)`;
- the `tojson` filter as Hugging Face defines it (no HTML escaping; `indent`, `separators`, `sort_keys`), the
  `loopcontrols` extension (`break`, `continue`) and the `{% generation %}` block (rendered as its body: it only
  marks assistant tokens for training masks).

The engine never sees messages: a rendered template is a prompt like any other (its special tokens are in the
text, so the worker tokenizes it without adding them again).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from cotserve.common.errors import InvalidArgument

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAX_MESSAGES = 4096


class ChatTemplateError(InvalidArgument):
    """The template refused the messages (`raise_exception`), or broke the sandbox's rules; the message says which."""


def _environment():
    """Jinja2's immutable sandbox set up as Hugging Face sets it up for chat templates."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body (the mark is for training masks only)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as a template may see them: a non-empty list of dicts, each with a string `role` and a `content`
    that is a string (or a list of parts, as multimodal templates take); InvalidArgument names the first bad field."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages: must be a non-empty list of {role, content}")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"messages: {len(messages)} messages, at most {MAX_MESSAGES} allowed")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgument(f"messages[{i}]: must be an object with role and content")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidArgument(f"messages[{i}].role: must be a non-empty string")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidArgument(f"messages[{i}].content: must be a string or a list of parts")
    return messages


class ChatTemplate:
    """One model's chat template, compiled once; `render` is safe to call from any thread."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = "chat template") -> None:
        import jinja2

        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"{origin}: not a valid Jinja2 template (line {exc.lineno}: {exc.message})") from None

    @classmethod
    def from_folder(cls, folder: Path) -> ChatTemplate | None:
        """The template a model folder ships, or None when it has none; a ValueError names a broken file."""
        config_path = folder / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.exists() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_path}: not valid JSON ({exc})") from None
        tokens = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.exists():
            return cls(jinja_file.read_text(), tokens, str(jinja_file))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one serves chat requests
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
        if source is None:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{config_path}: chat_template must be a string or a list of named templates")
        return cls(source, tokens, f"{config_path} (chat_template)")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **variables: Any) -> str:
        """The prompt text for `messages` (checked first: `check_messages`). `variables` are extra template
        variables (e.g. enable_thinking=False); the special tokens cannot be overridden by them."""
        import jinja2

        check_messages(messages)
        context = {**variables, **self.special_tokens, "messages": messages,
                   "add_generation_prompt": add_generation_prompt, "tools": tools, "documents": None}
        try:
            return self._template.render(**context)
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"messages: the chat template tried something its sandbox forbids ({exc})") from None
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"messages: the model's chat template refused them: {exc}") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as exc:
            # the template is the model's and fixed: what it trips over is the messages (a null content added to a
            # string, a missing key), so the client's request is what is wrong, not the server
            raise ChatTemplateError(f"messages: the model's chat template failed on them ({type(exc).__name__}: "
                                    f"{str(exc)[:200]})") from None
