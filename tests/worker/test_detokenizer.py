"""Streaming text: valid UTF-8 deltas, stop strings never sent."""

from __future__ import annotations

import pytest

from cotserve.demo.tokenizer import build_tokenizer
from cotserve.worker.detokenizer import IncrementalDetokenizer, TokenBytes

TOKENIZER = build_tokenizer()


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

