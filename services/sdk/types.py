"""Typed results of the SDK, converted from the gateway's protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass, field

from cotserve.common.sampling import FINISH_PB
from cotserve.common.v1 import common_pb2
from cotserve.gateway.v1 import gateway_pb2

_FINISH = {common_pb2.FINISH_REASON_UNSPECIFIED: None, **{pb: name for name, pb in FINISH_PB.items()}}
_RULES = {"window": common_pb2.SELF_CONSISTENCY_RULE_WINDOW, "posterior": common_pb2.SELF_CONSISTENCY_RULE_POSTERIOR}
_PARTS = {common_pb2.TEXT_PART_UNSPECIFIED: None, common_pb2.TEXT_PART_REASONING: "reasoning",
          common_pb2.TEXT_PART_ANSWER: "answer"}


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # summed over every sample
    cached_prompt_tokens: int = 0  # prompt tokens served from the worker's prefix cache
    reasoning_tokens: int = 0  # of completion_tokens, those of the reasoning (every sample)
    probe_tokens: int = 0  # computed by early-exit probes (not part of completion_tokens)


@dataclass(slots=True, frozen=True)
class Timing:
    queue_ms: float
    ttft_ms: float
    total_ms: float


def _set_fields(cls_pb, obj, **overrides):
    values = {k: getattr(obj, k) for k in obj.__slots__ if getattr(obj, k) is not None}
    values.update(overrides)
    return cls_pb(**values)


@dataclass(slots=True, frozen=True)
class EarlyExit:
    """Stop thinking once the answer has converged: probe every `probe_every_tokens` thinking tokens or
    every `probe_every_steps` reasoning steps (exactly one), stop when `agree` probes in a row give the
    same answer (with a mean token probability of at least `min_confidence`, when set)."""

    probe_every_tokens: int | None = None
    probe_every_steps: int | None = None
    agree: int | None = None  # default 2
    min_confidence: float | None = None
    probe_max_tokens: int | None = None  # default 16

    def to_pb(self) -> common_pb2.EarlyExit:
        return _set_fields(common_pb2.EarlyExit, self)


@dataclass(slots=True, frozen=True)
class SelfConsistency:
    """Adaptive self-consistency: up to `max_samples` samples in rounds of `min_samples`, stopped once the
    vote is settled by `rule` ("window": `window` identical answers in a row; "posterior": the leader
    stays the majority with probability `threshold`). Needs a temperature > 0."""

    max_samples: int
    min_samples: int | None = None  # default min(3, max_samples)
    rule: str = "window"
    window: int | None = None  # default min_samples
    threshold: float | None = None  # default 0.95
    confidence_weighted: bool = False
    drop_fraction: float | None = None  # default 0

    def to_pb(self) -> common_pb2.SelfConsistency:
        if self.rule not in _RULES:
            raise ValueError(f"rule: {self.rule!r} is not one of {sorted(_RULES)}")
        return _set_fields(common_pb2.SelfConsistency, self, rule=_RULES[self.rule])


@dataclass(slots=True, frozen=True)
class Reasoning:
    """Reasoning controls for a reasoning model (None: no limit / off). The worker must know the model's
    reasoning markers, else the call fails with FAILED_PRECONDITION."""

    max_thinking_tokens: int | None = None  # then the forcing text ends the thinking and the model answers
    max_thinking_steps: int | None = None  # steps end with the worker's --reasoning-step
    min_thinking_tokens: int | None = None  # the end marker cannot be sampled before this many thinking tokens
    forcing_text: str | None = None  # appended when a budget ends the thinking (default: the end marker)
    early_exit: EarlyExit | None = None
    self_consistency: SelfConsistency | None = None

    @property
    def is_set(self) -> bool:
        return self != Reasoning()

    def to_pb(self) -> common_pb2.ReasoningOptions:
        nested = {k: getattr(self, k).to_pb() for k in ("early_exit", "self_consistency") if getattr(self, k) is not None}
        return _set_fields(common_pb2.ReasoningOptions, self, **nested)


@dataclass(slots=True, frozen=True)
class Vote:
    answer: str
    count: int
    weight: float


@dataclass(slots=True, frozen=True)
class SelfConsistencyResult:
    """How a self-consistency vote ended."""

    answer: str
    votes: list[Vote]  # heaviest first
    samples_used: int
    samples_cancelled: int
    sample_tokens: list[int]  # completion tokens of each sample, by index
    stop_reason: str  # "window", "posterior" or "max_samples"


@dataclass(slots=True, frozen=True)
class ToolCall:
    """A call the model made of one of the request's tools."""

    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(slots=True, frozen=True)
class Choice:
    """One sample of a completion."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "tool_calls"
    logprobs: list[float] | None = None
    reasoning_text: str | None = None  # a reasoning model's thinking, without the markers
    answer_text: str | None = None  # a reasoning model's answer
    tool_calls: list[ToolCall] = field(default_factory=list)  # with tools: the calls it made (not in its text)


@dataclass(slots=True, frozen=True)
class GenerateResult:
    """A whole completion: `text`, `token_ids`, `finish_reason` and `logprobs` are the first
    sample's; `choices` has every sample (n of them) in index order."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" or "length"
    usage: Usage
    timing: Timing
    logprobs: list[float] | None = None
    choices: list[Choice] = field(default_factory=list)
    reasoning_text: str | None = None  # the first sample's thinking (reasoning models)
    answer_text: str | None = None  # the first sample's answer (reasoning models); the voted one with self-consistency
    self_consistency: SelfConsistencyResult | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # the first sample's calls (with tools)


@dataclass(slots=True, frozen=True)
class StreamChunk:
    """One or more tokens of one sample, all reasoning or all answer. While the client keeps up a chunk holds one
    token; a client that reads slower than the model generates gets what was pending merged into fewer chunks
    (nothing dropped, order kept): `text` is their text, `token_ids` and `logprobs` have one entry per token."""

    text: str
    token_ids: list[int]  # empty on a sample cancelled by a settled vote, and when a post-processor withholds them
    logprobs: list[float] | None  # one per token, when asked for
    finish_reason: str | None  # set on each sample's last chunk
    usage: Usage | None  # the stream's last chunk only
    timing: Timing | None  # the stream's last chunk only
    index: int = 0  # which sample (0..n-1) the chunk belongs to
    part: str | None = None  # "reasoning" or "answer" (None: the model has no reasoning markers)
    reasoning_text: str | None = None  # on each sample's last chunk, for a reasoning model
    answer_text: str | None = None  # likewise
    self_consistency: SelfConsistencyResult | None = None  # the stream's last chunk, with self-consistency
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls whose text ended in this chunk (with tools)


@dataclass(slots=True, frozen=True)
class ModelInfo:
    name: str
    revision: str
    max_context_tokens: int
    num_healthy_workers: int
    aliases: tuple[str, ...] = ()  # other names requests may use for it


def _usage(u: common_pb2.Usage) -> Usage:
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens, u.reasoning_tokens, u.probe_tokens)


def _vote(msg) -> SelfConsistencyResult | None:
    if not msg.HasField("self_consistency"):
        return None
    v = msg.self_consistency
    return SelfConsistencyResult(v.answer, [Vote(e.answer, e.count, e.weight) for e in v.votes], v.samples_used,
                                 v.samples_cancelled, list(v.sample_tokens), v.stop_reason)


def _opt(msg, name: str) -> str | None:
    return getattr(msg, name) if msg.HasField(name) else None


def _timing(t: common_pb2.Timing) -> Timing:
    return Timing(t.queue_ms, t.ttft_ms, t.total_ms)


def _calls(msg) -> list[ToolCall]:
    return [ToolCall(c.id, c.name, c.arguments) for c in msg.tool_calls]


def result_from_pb(r: gateway_pb2.GenerateResponse) -> GenerateResult:
    choices = [Choice(c.index, c.text, list(c.token_ids), _FINISH[c.finish_reason], list(c.logprobs) if c.logprobs else None,
                      _opt(c, "reasoning_text"), _opt(c, "answer_text"), _calls(c)) for c in r.choices]
    return GenerateResult(r.text, list(r.token_ids), _FINISH[r.finish_reason], _usage(r.usage), _timing(r.timing),
                          list(r.logprobs) if r.logprobs else None, choices, _opt(r, "reasoning_text"), _opt(r, "answer_text"),
                          _vote(r), choices[0].tool_calls if choices else [])


def chunk_from_pb(c: gateway_pb2.GenerateStreamResponse) -> StreamChunk:
    last = c.HasField("usage")
    return StreamChunk(c.text, list(c.token_ids), list(c.logprobs) if c.logprobs else None, _FINISH[c.finish_reason],
                       _usage(c.usage) if last else None, _timing(c.timing) if last else None, c.index, _PARTS[c.part],
                       _opt(c, "reasoning_text"), _opt(c, "answer_text"), _vote(c), _calls(c))


def model_from_pb(m: gateway_pb2.ModelEntry) -> ModelInfo:
    return ModelInfo(m.name, m.revision, m.max_context_tokens, m.num_healthy_workers, tuple(m.aliases))
