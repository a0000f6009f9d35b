"""The two detokenization paths (`worker/detokenizer.py`): decoding windows of ids (any tokenizer) and the byte-level
tokenizer's bytes per token; `test_detokenizer.py` runs its tests on both."""

from __future__ import annotations

import random

from cotserve.demo.tokenizer import build_tokenizer
from cotserve.worker.detokenizer import IncrementalDetokenizer, TokenBytes

TOKENIZER = build_tokenizer()


def run(ids: list[int], stop: tuple[str, ...], token_bytes: TokenBytes | None) -> tuple[list[str], str]:
    d = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("1+2=").ids, stop, token_bytes)
    deltas = [d.add_token(t) for t in ids]
    return deltas + ([] if d.stopped_by_string else [d.flush()]), d.text


def test_both_paths_stream_the_same_deltas_special_and_added_tokens_included():
    """The byte-level path gives, delta for delta, what decoding windows of ids gives: multi-byte characters split
    across tokens, special tokens (nothing) and added ones (`<think>`) between them, stop strings across tokens."""
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
        fast, slow = run(ids, stop, TokenBytes.of(TOKENIZER)), run(ids, stop, None)
        assert fast == slow, (trial, ids)


def test_other_decoders_take_the_windowed_path():
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    assert TokenBytes.of(tok) is None
    assert TokenBytes.of(TOKENIZER) is not None
