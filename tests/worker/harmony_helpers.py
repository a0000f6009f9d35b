"""A gpt-oss tokenizer (o200k_harmony) for tests, built from the o200k_base vocabulary in tests/data with
transformers' own tiktoken converter, and harmony's encoding over it."""

from __future__ import annotations

import base64
import functools
import gzip
import os
import tempfile
from pathlib import Path

VOCABULARY = Path(__file__).resolve().parents[1] / "data" / "o200k_base.tiktoken.gz"
O200K_PATTERN = "|".join([  # o200k's pre-tokenizer split, as tiktoken and harmony define it
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
VOCAB_SIZE = 201088  # gpt-oss's embedding rows: o200k_base's 199,998 tokens, then harmony's special tokens


@functools.cache
def vocabulary_dir() -> Path:
    """A folder holding o200k_base.tiktoken (what TIKTOKEN_ENCODINGS_BASE names for harmony)."""
    folder = Path(tempfile.mkdtemp(prefix="cotserve-o200k-"))
    (folder / "o200k_base.tiktoken").write_bytes(gzip.decompress(VOCABULARY.read_bytes()))
    return folder


@functools.cache
def encoding():
    """harmony's gpt-oss encoding, read from the test vocabulary (TIKTOKEN_ENCODINGS_BASE set for this load only)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(vocabulary_dir())
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if before is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = before


@functools.cache
def tokenizer_json() -> Path:
    """tokenizer.json of o200k_harmony: transformers' TikTokenConverter over the vocabulary, harmony's special tokens
    (their names as the encoding decodes them) added in id order, as gpt-oss's checkpoints ship it."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:  # tiktoken's reader, without the tiktoken package
            lines = Path(path).read_bytes().splitlines()
            return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines)}

    tok = Converter(vocab_file=str(vocabulary_dir() / "o200k_base.tiktoken"), pattern=O200K_PATTERN).converted()
    enc = encoding()
    tok.add_special_tokens([AddedToken(enc.decode([i]), normalized=False, special=True)
                            for i in range(tok.get_vocab_size(), VOCAB_SIZE)])
    path = vocabulary_dir() / "tokenizer.json"
    tok.save(str(path))
    return path
