"""Streaming detokenization with stop strings.

Text deltas are valid UTF-8: a token that ends inside a multi-byte character yields nothing
until the character completes. Text that could be the start of a stop string is held back until
it is known not to be one, so a stop string never reaches the client.
"""

from __future__ import annotations

import codecs
from typing import Any

from tokenizers import Tokenizer

_CONTEXT_TOKENS = 4  # prompt tokens decoded ahead of the output, so leading-space rules hold


class TokenBytes:
    """Each token's output bytes for a tokenizer whose decoder is GPT-2's byte-level one (GPT-2, Llama 3, Qwen,
    DeepSeek; the demo model's): a token's characters stand for bytes one to one, so its bytes do not depend on its
    neighbours and an incremental UTF-8 decoder streams the text, with no call into the tokenizer per token (the
    general path decodes two windows of ids per token: a third of the engine's per-token output work on the demo
    model). Special tokens give nothing (`skip_special_tokens`); other added tokens give their decoded text.
    Bytes that are not UTF-8 stream as U+FFFD as soon as the decoder knows (the windowed path held them until its
    window ended cleanly); valid text streams delta for delta as the windowed path does. `of(tokenizer)` is None for
    any other decoder."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._chars = _byte_level_decoder()
        self._added = dict(tokenizer.get_added_tokens_decoder())
        self._cache: dict[int, bytes] = {}

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> TokenBytes | None:
        return cls(tokenizer) if type(tokenizer.decoder).__name__ == "ByteLevel" else None

    def __call__(self, token_id: int) -> bytes:
        raw = self._cache.get(token_id)
        if raw is None:
            added, piece = self._added.get(token_id), self.tokenizer.id_to_token(token_id)
            if (added is not None and added.special) or piece is None:  # skipped, as decode skips unknown ids
                raw = b""
            elif added is None and (piece_raw := _piece_bytes(self._chars, piece)) is not None:
                raw = piece_raw
            else:
                raw = self.tokenizer.decode([token_id], skip_special_tokens=True).encode()
            self._cache[token_id] = raw
        return raw


class IncrementalDetokenizer:
    """One sample's output text, token by token. With `channels` (`harmony.HarmonyChannels`) only what they keep of
    each token's text is the sample's text (a harmony reply's message content, without its headers)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: tuple[str, ...],
                 token_bytes: TokenBytes | None = None, channels: Any = None) -> None:
        self.tokenizer = tokenizer
        self.channels = channels
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text so far (truncated at a stop string once one is found)
        self._emitted = 0
        self.stopped_by_string = False
        self._bytes = token_bytes
        # a character split across tokens waits in the decoder; one still incomplete at the end is dropped, as the
        # windowed path drops it
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if token_bytes is not None else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_token(self, token_id: int) -> str:
        """Append a generated token; return the text that can be sent now (possibly empty)."""
        new = self._new_text(token_id)
        if self.channels is not None:
            new = self.channels.take(token_id, new, len(self.text))
        if new:
            self._append(new)
        return self._ready(final=False)

    def _new_text(self, token_id: int) -> str:
        """The text `token_id` completes (possibly empty)."""
        if self._utf8 is not None:
            return self._utf8.decode(self._bytes(token_id))
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix) :]
        return ""

    def _append(self, new: str) -> None:
        if self.stopped_by_string:
            return
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped_by_string = True

    def _ready(self, final: bool) -> str:
        limit = len(self.text) if (final or self.stopped_by_string) else len(self.text) - self._holdback
        limit = max(limit, self._emitted)
        out = self.text[self._emitted : limit]
        self._emitted = limit
        return out

    def flush(self) -> str:
        """At the end of the request: whatever was held back."""
        if self.channels is not None and (rest := self.channels.finish(len(self.text))):
            self._append(rest)
        return self._ready(final=True)


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character each byte is written as, to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _piece_bytes(chars: dict[str, int], piece: str) -> bytes | None:
    """A byte-level BPE vocabulary piece's bytes (`chars`: `_byte_level_decoder()`), or None when a character of it
    is not in the byte alphabet (an added token's own text, say)."""
    return bytes(chars[c] for c in piece) if all(c in chars for c in piece) else None


class TokenTexts:
    """Each vocabulary entry's text and bytes on its own (what logprobs report per token), decoded once per id.
    A byte-level BPE token's bytes are exact even when it holds part of a character; other tokenizers' are the
    UTF-8 of the decoded text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level = _byte_level_decoder() if type(tokenizer.decoder).__name__ == "ByteLevel" else None
        self._special = {t.content for t in tokenizer.get_added_tokens_decoder().values()} \
            if hasattr(tokenizer, "get_added_tokens_decoder") else set()
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = text.encode()
            piece = self.tokenizer.id_to_token(token_id)
            if self._byte_level is not None and piece is not None and piece not in self._special:
                piece_raw = _piece_bytes(self._byte_level, piece)
                raw = raw if piece_raw is None else piece_raw
            hit = self._cache[token_id] = (text, raw)
        return hit
