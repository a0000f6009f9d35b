"""Reasoning format and thinking budgets. No torch, no grpc.

A reasoning model writes its thinking between a start and an end marker (`<think>` ... `</think>`
by default, when the tokenizer has them) and then its answer. `ReasoningFormat` is that format
for one model: the markers as token ids, a step delimiter (to count reasoning steps) and an
answer extractor. `ThinkingTracker` follows one sample as it is generated: which part each token
belongs to, how many thinking tokens and steps it has written, and when a budget says thinking
must end now; the engine then appends the forcing text (by default the end marker) as tokens of
the sample's own, so the model answers from there. Everything is configured by strings and
token ids: nothing here knows the demo model's format.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from cotserve.common.sampling import ReasoningParams, SelfConsistencyParams

DEFAULT_START, DEFAULT_END = "<think>", "</think>"
PARSERS = ("auto", "think", "harmony", "none")
"""`--reasoning-parser`: auto (harmony for a tokenizer with its control tokens, else think where the tokenizer has
<think> and </think>, else none), think (text between two markers: Qwen3, Phi-4-reasoning, DeepSeek-R1), harmony
(gpt-oss's analysis and final channels, `harmony.py`), none (no reasoning split)."""


class Part(enum.IntEnum):
    """Which part of a response a token belongs to (the markers belong to the reasoning)."""

    REASONING = 1
    ANSWER = 2


@dataclass(slots=True, frozen=True)
class ReasoningFormat:
    """How one model marks its reasoning. `end_ids` must be a single token for
    `min_thinking_tokens` (the end marker is then banned until the minimum is reached)."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    step: str | None = None  # reasoning steps end with this text (for max_thinking_steps)
    answer_regex: re.Pattern[str] | None = None  # group 1 (or the whole match) of the text after the end marker
    harmony: Any = None  # harmony's encoding for a gpt-oss model (its markers are its channel headers), else None

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, start: str | None = None, end: str | None = None,
                      step: str | None = None, answer_regex: str | None = None,
                      parser: str = "auto") -> "ReasoningFormat | None":
        """The format from flags (`parser`: one of PARSERS), or the tokenizer's `<think>` / `</think>` tokens when it
        has both; None when the model has no reasoning markers. Raises ValueError naming the bad flag."""
        from cotserve.worker import harmony

        if parser not in PARSERS:
            raise ValueError(f"reasoning_parser: {parser!r}, allowed: {', '.join(PARSERS)}")
        if (start is None) != (end is None):
            raise ValueError("reasoning_start / reasoning_end: give both markers or neither")
        if parser == "none":
            return None
        if parser == "harmony" or (parser == "auto" and start is None and harmony.is_harmony_tokenizer(tokenizer)):
            return cls._harmony(tokenizer, start, step, answer_regex)
        if start is None:
            if tokenizer.token_to_id(DEFAULT_START) is None or tokenizer.token_to_id(DEFAULT_END) is None:
                if step is not None or answer_regex is not None:
                    raise ValueError("reasoning_step / answer_regex: the tokenizer has no <think> / </think> tokens; "
                                     "give --reasoning-start and --reasoning-end")
                if parser == "think":  # asked for by name: a model it cannot read is a start-up error, not silence
                    raise ValueError("reasoning_parser: think, but the tokenizer has no <think> / </think> tokens; "
                                     "give --reasoning-start and --reasoning-end")
                return None
            start, end = DEFAULT_START, DEFAULT_END
        if not start or not end:
            raise ValueError("reasoning_start / reasoning_end: markers must not be empty")
        if step == "":
            raise ValueError("reasoning_step: must not be empty")
        try:
            pattern = re.compile(answer_regex) if answer_regex is not None else None
        except re.error as exc:
            raise ValueError(f"answer_regex: {answer_regex!r} is not a regular expression: {exc}") from None
        return cls(start, end, tuple(tokenizer.encode(start, add_special_tokens=False).ids),
                   tuple(tokenizer.encode(end, add_special_tokens=False).ids), step, pattern)

    @classmethod
    def _harmony(cls, tokenizer: Tokenizer, start: str | None, step: str | None,
                 answer_regex: str | None) -> "ReasoningFormat":
        from cotserve.worker import harmony

        if start is not None:
            raise ValueError("reasoning_start / reasoning_end: the harmony parser's markers are its channel headers; "
                             "give --reasoning-parser think for markers of your own")
        if not harmony.is_harmony_tokenizer(tokenizer):
            raise ValueError("reasoning_parser: harmony, but the tokenizer has no <|channel|> / <|message|> tokens "
                             "(not gpt-oss's)")
        plain = cls.for_tokenizer(tokenizer, harmony.HARMONY_START, harmony.HARMONY_END, step, answer_regex, "think")
        return dataclasses.replace(plain, harmony=harmony.load_encoding(tokenizer))

    def channels(self, prompt_ids: list[int]) -> Any:
        """A sample's text filter (`IncrementalDetokenizer`'s `channels`): harmony's, else None (the text is as
        decoded)."""
        if self.harmony is None:
            return None
        from cotserve.worker.harmony import HarmonyChannels

        return HarmonyChannels(self.harmony, prompt_ids)

    @property
    def text_markers(self) -> tuple[str, str]:
        """The markers as they appear in a sample's text (what a client strips from the reasoning): none for
        harmony, whose headers never reach the text."""
        return ("", "") if self.harmony is not None else (self.start, self.end)

    def split_sample(self, detok: Any, thinking_at_start: bool = False) -> tuple[str, str]:
        """A finished sample's (reasoning, answer) from its detokenizer (`IncrementalDetokenizer`)."""
        if detok.channels is not None:
            reasoning, answer = detok.channels.split(detok.text)
            return reasoning, self.answer(answer)
        return self.split(detok.text, thinking_at_start)

    OPENED_WITHIN = 2
    """Tokens a prompt may hold after the start marker that opens the thinking for the model (DeepSeek-R1's template
    ends its prompts with `<think>` and a newline)."""

    def opens_thinking(self, prompt_ids: list[int]) -> bool:
        """The prompt ends with the start marker, or with it and a token or two (a newline), and no end marker after
        it (the chat template opened the thinking): its output starts inside the reasoning."""
        n = len(self.start_ids)
        if not n:
            return False
        tail = prompt_ids[-(n + self.OPENED_WITHIN):]
        for at in range(len(tail) - n, -1, -1):
            if tuple(tail[at:at + n]) == self.start_ids:
                return not _holds(tail[at + n:], self.end_ids)
        return False

    def closes_thinking(self, prompt_ids: list[int]) -> bool:
        """The prompt ends with the end marker, or with it and a token or two (Qwen3's template without thinking
        writes an empty thought and a blank line): its output is the answer from the start."""
        return bool(self.end_ids) and _holds(prompt_ids[-(len(self.end_ids) + self.OPENED_WITHIN):], self.end_ids)

    def split(self, text: str, thinking_at_start: bool = False) -> tuple[str, str]:
        """A sample's whole output text as (reasoning, answer): the reasoning between the markers
        (stripped; up to the end of the text when thinking never ended) and the answer after the
        end marker, through the answer extractor. Text with no marker is all answer."""
        start = 0
        if not thinking_at_start:
            i = text.find(self.start)
            if i == -1:
                return "", self.answer(text)
            start = i + len(self.start)
        j = text.find(self.end, start)
        if j == -1:
            return text[start:].strip(), ""
        return text[start:j].strip(), self.answer(text[j + len(self.end):])

    def answer(self, text: str) -> str:
        """The answer in `text` (what follows the end marker), through the answer extractor."""
        if self.answer_regex is None:
            return text.strip()
        m = self.answer_regex.search(text)
        if m is None:
            return ""
        return (m.group(1) if m.groups() else m.group(0)).strip()


def _holds(seq: list[int], ids: tuple[int, ...]) -> bool:
    """`ids` appear in `seq`, in a row."""
    n = len(ids)
    return any(tuple(seq[i:i + n]) == ids for i in range(len(seq) - n + 1))


class ThinkingTracker:
    """One sample's progress through its reasoning, fed every output token and its text."""

    def __init__(self, fmt: ReasoningFormat, options: ReasoningParams, prompt_ids: list[int]) -> None:
        self.fmt = fmt
        self.options = options
        self.thinking_at_start = fmt.opens_thinking(prompt_ids)
        self.is_thinking = self.thinking_at_start
        self.has_thought = self.thinking_at_start
        self.num_reasoning_tokens = 0  # markers included
        self.num_thinking_tokens = 0  # between the markers
        self.num_steps = 0
        self._recent: list[int] = []  # last output ids, to find multi-token markers
        self._thinking_text = ""
        self._probe_due = False
        self.probe_pending = False  # a probe point passed; its probe forks once the point's token is computed
        self.probe_answers: list[tuple[str, float]] = []  # early-exit probes' (answer, mean token probability) as they finish
        self.exited_early = False  # an early-exit probe's answer ended the thinking
        self.forced_end = False  # a budget ended the thinking

    def observe(self, token_id: int, text: str) -> Part:
        """Account one output token (and the text it completed); returns the part it belongs to."""
        fmt = self.fmt
        self._recent = (self._recent + [token_id])[-max(len(fmt.start_ids), len(fmt.end_ids)):]
        if not self.has_thought and self._ends_with(fmt.start_ids):
            self.is_thinking = self.has_thought = True
            self.num_reasoning_tokens += len(fmt.start_ids)  # a marker of several tokens: all of them
            return Part.REASONING
        if self.is_thinking:
            self.num_reasoning_tokens += 1
            if self._ends_with(fmt.end_ids):
                self.is_thinking = False
                self.num_thinking_tokens -= len(fmt.end_ids) - 1  # the marker's first tokens were counted as thinking
                return Part.REASONING
            self.num_thinking_tokens += 1
            ended_steps = 0
            if fmt.step is not None and text:
                before = self._thinking_text.count(fmt.step)
                self._thinking_text += text
                ended_steps = self._thinking_text.count(fmt.step) - before
                self.num_steps += ended_steps
            ee = self.options.early_exit
            if ee is not None:
                if ee.probe_every_tokens is not None:
                    self._probe_due = self.num_thinking_tokens % ee.probe_every_tokens == 0
                else:
                    self._probe_due = ended_steps > 0 and self.num_steps % ee.probe_every_steps < ended_steps
            return Part.REASONING
        return Part.ANSWER  # before thinking starts, and after it ends

    def _ends_with(self, ids: tuple[int, ...]) -> bool:
        return bool(ids) and tuple(self._recent[-len(ids):]) == ids

    def take_probe_due(self) -> bool:
        """Whether the token just observed is an early-exit probe point (once per point)."""
        due, self._probe_due = self._probe_due and self.is_thinking, False
        return due

    def converged(self) -> str | None:
        """The answer, once the last `agree` probes gave the same non-empty one (with enough confidence)."""
        ee = self.options.early_exit
        if ee is None or len(self.probe_answers) < ee.agree:
            return None
        last = self.probe_answers[-ee.agree:]
        answer = last[0][0]
        if not answer or any(a != answer for a, _ in last):
            return None
        if ee.min_confidence is not None and sum(c for _, c in last) / len(last) < ee.min_confidence:
            return None
        return answer

    def must_stop_thinking(self) -> bool:
        """A budget is spent while the sample still thinks: force the end now."""
        o = self.options
        if not self.is_thinking:
            return False
        return (o.max_thinking_tokens is not None and self.num_thinking_tokens >= o.max_thinking_tokens) or (
            o.max_thinking_steps is not None and self.num_steps >= o.max_thinking_steps)

    def banned_token(self) -> int | None:
        """The end marker's token while `min_thinking_tokens` is not reached (it may not be sampled)."""
        if self.is_thinking and self.num_thinking_tokens < self.options.min_thinking_tokens and len(self.fmt.end_ids) == 1:
            return self.fmt.end_ids[0]
        return None


# ---- adaptive self-consistency ----------------------------------------------------------------


@dataclass(slots=True)
class VoteEntry:
    answer: str
    count: int = 0
    weight: float = 0.0


@dataclass(slots=True)
class Ballot:
    """One finished sample's vote: its answer and confidence (geometric mean token probability)."""

    answer: str
    confidence: float


def mean_probability(logprobs: list[float]) -> float:
    """An early-exit probe's confidence: the mean probability of the tokens it decoded (1.0 with none)."""
    return sum(math.exp(lp) for lp in logprobs) / len(logprobs) if logprobs else 1.0


def confidence(logprobs: list[float]) -> float:
    """A sample's confidence: the geometric mean of its sampled tokens' probabilities (1.0 with none)."""
    return math.exp(sum(logprobs) / len(logprobs)) if logprobs else 1.0


def tally(ballots: list[Ballot], params: SelfConsistencyParams) -> list[VoteEntry]:
    """The vote table, heaviest first (ties: the answer that came first). With `drop_fraction` the
    lowest-confidence share of the ballots is left out; with `confidence_weighted` each vote weighs its
    sample's confidence, else 1."""
    kept = ballots
    drop = int(len(ballots) * params.drop_fraction)
    if drop:  # the least confident go; the rest keep their arrival order (for ties)
        dropped = set(sorted(range(len(ballots)), key=lambda i: ballots[i].confidence)[:drop])
        kept = [b for i, b in enumerate(ballots) if i not in dropped]
    table: dict[str, VoteEntry] = {}
    for b in kept:
        e = table.setdefault(b.answer, VoteEntry(b.answer))
        e.count += 1
        e.weight += b.confidence if params.confidence_weighted else 1.0
    order = {a: i for i, a in enumerate(table)}
    # an empty answer (no answer extracted) never leads while any sample answered
    return sorted(table.values(), key=lambda e: (e.answer == "", -e.weight, order[e.answer]))


def leader_stays_probability(a: float, b: float, remaining: int) -> float:
    """P(the leader, with vote weight `a`, still leads the runner-up (weight `b`) after `remaining` more
    votes), with the leader's share of their votes ~ Beta(a + 1, b + 1) and every remaining vote going to
    one of the two (the conservative case): the Beta-binomial tail, computed exactly."""
    if remaining <= 0:
        return 1.0 if a > b else 0.0
    alpha, beta = a + 1.0, b + 1.0
    log_beta_ab = math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)
    total = 0.0
    for x in range(remaining + 1):  # x more votes for the leader
        if a + x > b + (remaining - x):
            log_choose = math.lgamma(remaining + 1) - math.lgamma(x + 1) - math.lgamma(remaining - x + 1)
            log_b = math.lgamma(x + alpha) + math.lgamma(remaining - x + beta) - math.lgamma(remaining + alpha + beta)
            total += math.exp(log_choose + log_b - log_beta_ab)
    return min(1.0, total)


@dataclass(slots=True)
class VoteState:
    """One request's adaptive self-consistency: ballots in the order samples finished."""

    params: SelfConsistencyParams
    ballots: list[Ballot] = field(default_factory=list)
    started: int = 0
    cancelled: int = 0
    stop_reason: str = ""

    def settled(self) -> str | None:
        """Why the vote is settled now ("window", "posterior", "max_samples"), or None to go on."""
        p, n = self.params, len(self.ballots)
        if n >= p.max_samples:
            return "max_samples"
        if n < p.min_samples:
            return None
        if p.rule == "window":
            last = self.ballots[-p.window:]
            if len(last) == p.window and last[0].answer and all(b.answer == last[0].answer for b in last):
                return "window"
            return None
        table = tally(self.ballots, p)
        if not table or not table[0].answer:
            return None
        a = table[0].weight
        b = table[1].weight if len(table) > 1 else 0.0
        if leader_stays_probability(a, b, p.max_samples - n) >= p.threshold:
            return "posterior"
        return None

    def answer(self) -> str:
        table = tally(self.ballots, self.params)
        return table[0].answer if table else ""
