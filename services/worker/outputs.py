"""What the engine hands back per request: one `RequestOutput` per generated token of each sample, to the request's
`Sink`. No torch, no grpc: the worker front, the engine process and the converters all import it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from cotserve.worker.reasoning import VoteEntry
from cotserve.worker.sequence import Sequence, TraceEvent

NO_TOKEN = -1  # token_id of a cancelled or front-stopped sample's last output: it carries no token


@dataclass(slots=True, frozen=True)
class Timing:
    """A request's milliseconds since its arrival: when first scheduled, at its first token, at its end."""

    queue_ms: float
    ttft_ms: float
    total_ms: float
    kv_used_fraction_at_admission: float = 0.0


def timing_of(seq: Sequence, end: float | None = None) -> Timing:
    """`seq`'s timing so far (`end`: when its request ended, `time.monotonic()`)."""
    def ms(t: float | None) -> float:
        return 0.0 if t is None else (t - seq.arrival_time) * 1000

    return Timing(queue_ms=ms(seq.first_scheduled_time), ttft_ms=ms(seq.first_token_time), total_ms=ms(end),
                  kv_used_fraction_at_admission=seq.kv_used_fraction_at_admission)


@dataclass(slots=True, frozen=True)
class VoteResult:
    """How a request's self-consistency vote ended."""

    answer: str
    votes: tuple[VoteEntry, ...]
    samples_used: int
    samples_cancelled: int
    sample_tokens: tuple[int, ...]
    stop_reason: str
    samples_saved: int = 0  # max_samples minus samples used


@dataclass(slots=True)
class RequestOutput:
    """One generated token of one sample (`index`) of a request. `finish_reason` ("stop"/"length"/"cancelled") is set
    on each sample's last token; `is_last` on the request's last output, which carries the usage (the prompt once,
    completion tokens summed over the samples) and the timing.

    Not frozen, but never changed once a sink has it (`dataclasses.replace` makes another; the front's `FrontText`
    fills in the text of one it has just unpickled, before its sink sees it): one is made per token in the engine and
    again in the worker front, and a frozen dataclass's `__init__` pays an `object.__setattr__` per field."""

    request_id: str
    token_id: int
    text: str
    logprob: float | None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timing: Timing | None = None
    error: str | None = None  # set when the request failed inside the engine
    events: tuple[tuple[TraceEvent, int], ...] = ()  # engine events since the previous output: (event, wall ns)
    index: int = 0
    cached_prompt_tokens: int = 0  # on the last output: prompt tokens found in the prefix cache
    is_last: bool = False
    part: int = 0  # reasoning.Part of the token; 0 for a model without reasoning markers
    reasoning_text: str | None = None  # on each sample's last output, for a reasoning model
    answer_text: str | None = None  # likewise
    reasoning_tokens: int = 0  # on the last output: reasoning tokens of every sample
    probe_tokens: int = 0  # on the last output: tokens early-exit probes computed
    early_exits: int = 0  # on the last output: samples whose thinking an early exit ended
    vote: VoteResult | None = None  # on the last output, with self-consistency
    top_logprobs: tuple[tuple[int, ...], tuple[float, ...]] | None = None  # with sampling.top_logprobs: (ids, logprobs)

    def __reduce__(self) -> tuple:
        # crosses the engine process's pipe once per token: positional fields pickle in less time than the slot-state
        # dict a slots dataclass gets by default
        return (RequestOutput, tuple([getattr(self, f) for f in _OUTPUT_FIELDS]))


_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutput))

Sink = Callable[[RequestOutput], None]
"""Where a request's outputs go, called on the engine's thread (or the engine process front's reader thread)."""
