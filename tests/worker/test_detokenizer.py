"""Streaming text: valid UTF-8 deltas, stop strings never sent."""

from __future__ import annotations

import random

import pytest

from cotserve.demo.tokenizer import build_tokenizer
from cotserve.worker.detokenizer import IncrementalDetokenizer, TokenBytes

TOKENIZER = build_tokenizer()
BYTE_LEVEL_RULE = TokenBytes.of  # the real rule (the fixture below replaces it per test)


@pytest.fixture(params=["windowed", "byte-level"], autouse=True)
def path(request, monkeypatch):
    """Every test runs on both paths: decoding windows of ids, and the byte-level tokenizer's bytes per token."""
    monkeypatch.setattr(TokenBytes, "of", classmethod(lambda cls, tok: cls(tok) if request.param == "byte-level" else None))
    return request.param


def stream_ids(ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("1+2=").ids, stop, TokenBytes.of(TOKENIZER))
    deltas = [d.add_token(t) for t in ids]
    if not d.stopped_by_string:
        deltas.append(d.flush())
    return deltas, d


def stream(text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    return stream_ids(TOKENIZER.encode(text, add_special_tokens=False).ids, stop)


def test_the_demo_tokenizer_takes_the_byte_level_path_in_the_engine():
    assert type(TOKENIZER.decoder).__name__ == "ByteLevel"


def test_multibyte_characters_arrive_whole():
    text = "héllo ∑ 🙂 done"
    deltas, _ = stream(text)
    assert "".join(deltas) == text
    for piece in deltas:
        assert "\ufffd" not in piece
    assert "🙂" in deltas  # four byte-tokens yield nothing, nothing, nothing, then the emoji


def test_stop_string_is_cut_and_never_streamed():
    deltas, d = stream("<think>1+2=3.</think> 3 and more", stop=("</think>",))
    assert d.stopped_by_string
    assert "".join(deltas) == "<think>1+2=3."
    assert all("</" not in x for x in deltas)


def test_partial_stop_string_that_does_not_complete_is_released():
    deltas, d = stream("a<b<c", stop=("<stop>",))
    assert not d.stopped_by_string
    assert "".join(deltas) == "a<b<c"


def test_earliest_of_several_stop_strings_wins():
    deltas, d = stream("xx END yy STOP", stop=("STOP", " END"))
    assert "".join(deltas) == "xx"


def test_both_paths_stream_the_same_deltas_special_and_added_tokens_included(path):
    """The byte-level path gives, delta for delta, what decoding windows of ids gives: multi-byte characters split
    across tokens, special tokens (nothing) and added ones (`<think>`) between them, stop strings across tokens."""
    if path != "byte-level":
        pytest.skip("compares the two paths once")
    rng = random.Random(0)
    words = ["12+34=46.", " héllo", " ∑", " 🙂", " 中文字", "</think>", "<think>", " done", "\n", "  ", "ünï"]
    special = [i for i, t in TOKENIZER.get_added_tokens_decoder().items() if t.special]
    for trial in range(200):
        ids = []
        for _ in range(rng.randint(1, 12)):
            ids += TOKENIZER.encode(rng.choice(words), add_special_tokens=False).ids
            if rng.random() < 0.2:
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        stop = rng.choice([(), (" done",), ("</think>", "∑")])
        fast = stream_ids(ids, stop)
        windowed = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("1+2=").ids, stop)
        slow = [windowed.add_token(t) for t in ids] + ([] if windowed.stopped_by_string else [windowed.flush()])
        assert fast[0] == slow and fast[1].text == windowed.text, (trial, ids)


def test_other_decoders_take_the_windowed_path():
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    assert BYTE_LEVEL_RULE(tok) is None
    assert BYTE_LEVEL_RULE(TOKENIZER) is not None
