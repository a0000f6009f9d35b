"""gpt-oss's "harmony" output format, read by OpenAI's `openai-harmony` package. No torch, no grpc.

A gpt-oss reply is a run of messages, each a header and content: `<|channel|>analysis<|message|>` thinking `<|end|>`
`<|start|>assistant<|channel|>final<|message|>` answer `<|return|>`. To the engine it is a reasoning format like any
other (`reasoning.ReasoningFormat`): the analysis header opens the thinking and the switch to the final channel ends
it, so thinking budgets force that switch and early-exit probes decode the final channel. What harmony adds is the
text: its headers are special tokens and channel names, never text the user reads. `HarmonyChannels` follows one
sample's tokens through harmony's own streaming parser and keeps only the content of each message, with the offset
where the answer begins; a sample that stops being valid harmony (a model off its format) is served as plain answer
text from there on, never an error.

The package reads the o200k vocabulary from a file it checks by hash, and would download it. A gpt-oss checkpoint's
`tokenizer.json` holds the same vocabulary: `load_encoding` writes it in tiktoken's format to a cache folder (the
package's hash check then proves it is o200k) and points the package there, so no download is ever attempted.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

HARMONY_START = "<|channel|>analysis<|message|>"
HARMONY_END = "<|end|><|start|>assistant<|channel|>final<|message|>"
_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")
_ENCODINGS_BASE = "TIKTOKEN_ENCODINGS_BASE"


def is_harmony_tokenizer(tokenizer: Tokenizer) -> bool:
    """The tokenizer has harmony's control tokens (gpt-oss's o200k_harmony)."""
    return all(tokenizer.token_to_id(t) is not None for t in _TOKENS)


def o200k_vocabulary(tokenizer: Tokenizer) -> bytes:
    """The tokenizer's byte-level BPE vocabulary, added tokens left out, as a tiktoken file: one `base64(bytes) rank`
    line per token, by rank."""
    from cotserve.worker.detokenizer import _byte_level_decoder

    chars = _byte_level_decoder()
    added = set(tokenizer.get_added_tokens_decoder())
    lines = []
    for piece, rank in sorted(tokenizer.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1]):
        if rank in added:
            continue
        if not all(c in chars for c in piece):
            raise ValueError(f"tokenizer.json: token {rank} ({piece!r}) is not byte-level BPE: not gpt-oss's vocabulary")
        lines.append(b"%s %d\n" % (base64.b64encode(bytes(chars[c] for c in piece)), rank))
    return b"".join(lines)


def cache_dir() -> Path:
    """Where the vocabulary files go: COTSERVE_CACHE_DIR, else XDG_CACHE_HOME/cotserve, else ~/.cache/cotserve."""
    if os.environ.get("COTSERVE_CACHE_DIR"):
        return Path(os.environ["COTSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cotserve"


def load_encoding(tokenizer: Tokenizer) -> Any:
    """harmony's gpt-oss encoding over the tokenizer's vocabulary (see the module docstring). Where the operator set
    TIKTOKEN_ENCODINGS_BASE, the vocabulary is read from there instead. Raises ValueError naming what is wrong."""
    try:
        from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding
    except ImportError:
        raise ValueError("reasoning_parser: harmony needs the openai-harmony package (pip install openai-harmony)") from None
    if not os.environ.get(_ENCODINGS_BASE):
        vocabulary = o200k_vocabulary(tokenizer)
        folder = cache_dir() / "tiktoken" / hashlib.sha256(vocabulary).hexdigest()[:16]
        if not (folder / "o200k_base.tiktoken").exists():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f"o200k_base.tiktoken.{os.getpid()}"
            tmp.write_bytes(vocabulary)
            tmp.replace(folder / "o200k_base.tiktoken")
        os.environ[_ENCODINGS_BASE] = str(folder)
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as exc:
        raise ValueError(f"reasoning_parser: harmony cannot read this tokenizer's vocabulary as o200k (gpt-oss's) "
                         f"from {os.environ[_ENCODINGS_BASE]}: {exc}") from None


class HarmonyChannels:
    """One sample's output through harmony's streaming parser: `take` keeps a token's text only where it is message
    content, and notes where the first content outside the analysis channel (the answer) begins. Header text is held
    until its header completes; a header that fails to parse, or runs past `MAX_HEADER_TOKENS`, releases it as answer
    text and the sample is plain text from there."""

    MAX_HEADER_TOKENS = 32  # a real header is a few tokens (a tool call's recipient and content type included)
    __slots__ = ("parser", "answer_start", "plain", "held")

    def __init__(self, encoding: Any, prompt_ids: list[int]) -> None:
        """The parser starts where the prompt's last message does (`<|start|>assistant`, or a header the prompt
        began for the model, as a prefilled `<|channel|>analysis<|message|>`)."""
        from openai_harmony import HarmonyError, Role, StreamableParser

        self.answer_start: int | None = None  # offset in the sample's text of the answer's first character
        self.plain = False  # the output left the format: the rest is answer text as written
        self.held: list[str] = []  # the text of the header being read
        start = encoding.encode("<|start|>", allowed_special="all")[0]
        last = max((i for i, t in enumerate(prompt_ids) if t == start), default=None)
        if last is None:
            self.parser = StreamableParser(encoding, role=Role.ASSISTANT)
            return
        self.parser = StreamableParser(encoding, role=None)
        try:
            for t in prompt_ids[last:]:
                self.parser.process(t)
        except HarmonyError:
            self.plain = True

    def take(self, token_id: int, text: str, offset: int) -> str:
        """The text to keep for one token: `text` (its decoded text, at `offset` in the sample's text) where it is
        message content, "" for a header or control token, or held header text released when the format breaks."""
        from openai_harmony import HarmonyError, StreamState

        if not self.plain:
            before = self.parser.state
            try:
                self.parser.process(token_id)
            except HarmonyError:
                self.plain = True
            if not self.plain:
                after = self.parser.state
                if before == StreamState.CONTENT == after:
                    if self.parser.current_channel == "analysis":
                        return text
                elif after == StreamState.HEADER and len(self.held) < self.MAX_HEADER_TOKENS:
                    self.held.append(text)
                    return ""
                elif after != StreamState.HEADER:  # a header completed, or a control token
                    self.held.clear()
                    return ""
                else:
                    self.plain = True
            text, self.held = "".join(self.held) + text, []
        if self.answer_start is None and text:
            self.answer_start = offset
        return text

    def finish(self, offset: int) -> str:
        """At the sample's end: header text still held (an output that stopped inside a header), as answer text."""
        text, self.held = "".join(self.held), []
        if self.answer_start is None and text:
            self.answer_start = offset
        return text

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of the sample's content `text` (what `take` kept), each stripped."""
        cut = len(text) if self.answer_start is None else self.answer_start
        return text[:cut].strip(), text[cut:].strip()
