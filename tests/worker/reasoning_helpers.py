"""A reply through the worker's text path and the gateway's reasoning split, as the reasoning-parser tests drive it."""

from __future__ import annotations

from cotserve.common.sampling import ReasoningParams
from cotserve.gateway.openai_api import ReasoningSplit
from cotserve.worker.detokenizer import IncrementalDetokenizer, TokenBytes
from cotserve.worker.reasoning import ReasoningFormat, ThinkingTracker


def worker_pieces(fmt: ReasoningFormat, tok, prompt: list[int], reply: list[int], stops: set[int]):
    """The reply token by token as the engine emits it, up to its first stop token (which ends the sample: no text):
    ([(text, part)], the sample's detokenizer, its tracker)."""
    detok = IncrementalDetokenizer(tok, prompt, (), TokenBytes.of(tok), fmt.channels(prompt))
    tracker = ThinkingTracker(fmt, ReasoningParams(), prompt)
    pieces = []
    for t in reply:
        if t in stops:
            break
        text = detok.add_token(t)
        pieces.append((text, int(tracker.observe(t, text))))
    pieces[-1] = (pieces[-1][0] + detok.flush(), pieces[-1][1])
    return pieces, detok, tracker


def gateway_split(fmt: ReasoningFormat, pieces: list[tuple[str, int]], size: int) -> tuple[str, str]:
    """(reasoning, content), stripped, as the gateway's HTTP responder splits `pieces` sent `size` tokens a message
    (the worker sends one message per part per write)."""
    split, reasoning, content, i = ReasoningSplit(*fmt.text_markers), "", "", 0
    while i < len(pieces):
        j = i
        while j < len(pieces) and j - i < size and pieces[j][1] == pieces[i][1]:
            j += 1
        r, c = split.feed("".join(text for text, _ in pieces[i:j]), pieces[i][1])
        reasoning, content, i = reasoning + r, content + c, j
    return (reasoning + split.finish()).strip(), content.strip()
