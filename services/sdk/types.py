"""Typed results of the SDK, converted from the gateway's protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass, field

from cotserve.common.v1 import common_pb2
from cotserve.gateway.v1 import gateway_pb2

_FINISH = {common_pb2.FINISH_REASON_UNSPECIFIED: None, common_pb2.FINISH_REASON_STOP: "stop",
           common_pb2.FINISH_REASON_LENGTH: "length"}
SLA_CLASSES = {"realtime": common_pb2.SLA_CLASS_REALTIME, "interactive": common_pb2.SLA_CLASS_INTERACTIVE,
               "batch": common_pb2.SLA_CLASS_BATCH}


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # summed over every sample
    cached_prompt_tokens: int = 0  # prompt tokens served from the worker's prefix cache


@dataclass(slots=True, frozen=True)
class Timing:
    queue_ms: float
    ttft_ms: float
    total_ms: float


@dataclass(slots=True, frozen=True)
class Choice:
    """One sample of a completion."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" or "length"
    logprobs: list[float] | None = None


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


@dataclass(slots=True, frozen=True)
class StreamChunk:
    text: str
    token_id: int
    logprob: float | None
    finish_reason: str | None  # set on each sample's last chunk
    usage: Usage | None  # the stream's last chunk only
    timing: Timing | None  # the stream's last chunk only
    index: int = 0  # which sample (0..n-1) the chunk belongs to


@dataclass(slots=True, frozen=True)
class ModelInfo:
    name: str
    revision: str
    max_context_tokens: int
    num_healthy_workers: int


def _usage(u: common_pb2.Usage) -> Usage:
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)


def _timing(t: common_pb2.Timing) -> Timing:
    return Timing(t.queue_ms, t.ttft_ms, t.total_ms)


def result_from_pb(r: gateway_pb2.GenerateResponse) -> GenerateResult:
    choices = [Choice(c.index, c.text, list(c.token_ids), _FINISH[c.finish_reason], list(c.logprobs) if c.logprobs else None)
               for c in r.choices]
    return GenerateResult(r.text, list(r.token_ids), _FINISH[r.finish_reason], _usage(r.usage), _timing(r.timing),
                          list(r.logprobs) if r.logprobs else None, choices)


def chunk_from_pb(c: gateway_pb2.GenerateStreamResponse) -> StreamChunk:
    last = c.HasField("usage")
    return StreamChunk(c.text, c.token_id, c.logprob if c.HasField("logprob") else None, _FINISH[c.finish_reason],
                       _usage(c.usage) if last else None, _timing(c.timing) if last else None, c.index)


def model_from_pb(m: gateway_pb2.ModelEntry) -> ModelInfo:
    return ModelInfo(m.name, m.revision, m.max_context_tokens, m.num_healthy_workers)
