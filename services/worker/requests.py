"""Protobuf <-> engine types for the worker, with every field validated at the edge."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenizers import Tokenizer

from cotserve.common.errors import InvalidArgument
from cotserve.common.v1 import common_pb2
from cotserve.worker.engine import RequestOutput
from cotserve.worker.sequence import SamplingParams, SlaClass
from cotserve.worker.v1 import worker_pb2

DEFAULT_MAX_NEW_TOKENS = 256
MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256

_SLA = {
    common_pb2.SLA_CLASS_UNSPECIFIED: SlaClass.INTERACTIVE,
    common_pb2.SLA_CLASS_REALTIME: SlaClass.REALTIME,
    common_pb2.SLA_CLASS_INTERACTIVE: SlaClass.INTERACTIVE,
    common_pb2.SLA_CLASS_BATCH: SlaClass.BATCH,
}
_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH}


@dataclass(slots=True, frozen=True)
class GenerateCall:
    prompt_ids: list[int]
    params: SamplingParams
    sla_class: SlaClass


def sla_from_pb(value: int) -> SlaClass:
    if value not in _SLA:
        raise InvalidArgument(f"sla_class: unknown value {value} (allowed: REALTIME, INTERACTIVE, BATCH)")
    return _SLA[value]


def sampling_from_pb(
    sp: common_pb2.SamplingParams, *, vocab_size: int, max_model_len: int, max_new_tokens_limit: int
) -> SamplingParams:
    """Validate and convert. `max_new_tokens` may be up to the model's context; generation is
    capped at `max_new_tokens_limit`, what the context leaves after the prompt ("length")."""
    max_new = sp.max_new_tokens if sp.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    if not 1 <= max_new <= max_model_len:
        raise InvalidArgument(f"sampling.max_new_tokens: {max_new} is out of range (1..{max_model_len})")
    temperature = sp.temperature if sp.HasField("temperature") else 0.0
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 2.0):
        raise InvalidArgument(f"sampling.temperature: {temperature} is out of range (0..2)")
    top_p = sp.top_p if sp.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidArgument(f"sampling.top_p: {top_p} is out of range (0 < top_p <= 1)")
    top_k = sp.top_k if sp.HasField("top_k") else 0
    if not 0 <= top_k <= vocab_size:
        raise InvalidArgument(f"sampling.top_k: {top_k} is out of range (0..{vocab_size}, 0 = off)")
    if len(sp.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"sampling.stop: {len(sp.stop)} strings, at most {MAX_STOP_STRINGS} allowed")
    for s in sp.stop:
        if not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
            raise InvalidArgument(f"sampling.stop: each stop string must have 1..{MAX_STOP_STRING_CHARS} characters")
    for t in sp.stop_token_ids:
        if t >= vocab_size:
            raise InvalidArgument(f"sampling.stop_token_ids: {t} is out of range (0..{vocab_size - 1})")
    return SamplingParams(
        max_new_tokens=min(max_new, max_new_tokens_limit),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        seed=sp.seed if sp.HasField("seed") else None,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        logprobs=sp.logprobs,
        ignore_eos=sp.ignore_eos,
    )


def generate_from_pb(req: worker_pb2.GenerateRequest, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> GenerateCall:
    if req.prompt_text and req.prompt_token_ids:
        raise InvalidArgument("prompt_text and prompt_token_ids: set exactly one, not both")
    if req.prompt_text:
        ids = tokenizer.encode(req.prompt_text).ids
    elif req.prompt_token_ids:
        ids = list(req.prompt_token_ids)
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"prompt_token_ids: token {bad} is out of range (0..{vocab_size - 1})")
    else:
        raise InvalidArgument("prompt_text / prompt_token_ids: the prompt is empty")
    if not ids:
        raise InvalidArgument("prompt_text: the prompt encodes to no tokens")
    if len(ids) >= max_model_len:
        raise InvalidArgument(
            f"prompt: {len(ids)} tokens is over the model's context (prompt must be at most {max_model_len - 1} "
            f"tokens, leaving room for one generated token)"
        )
    params = sampling_from_pb(
        req.sampling, vocab_size=vocab_size, max_model_len=max_model_len, max_new_tokens_limit=max_model_len - len(ids)
    )
    return GenerateCall(ids, params, sla_from_pb(req.sla_class))


def output_to_pb(out: RequestOutput) -> worker_pb2.GenerateResponse:
    msg = worker_pb2.GenerateResponse(token_id=out.token_id, text=out.text)
    if out.logprob is not None:
        msg.logprob = out.logprob
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH[out.finish_reason]
        msg.usage.prompt_tokens = out.prompt_tokens
        msg.usage.completion_tokens = out.completion_tokens
    if out.timing is not None:
        msg.timing.queue_ms = out.timing.queue_ms
        msg.timing.ttft_ms = out.timing.ttft_ms
        msg.timing.total_ms = out.timing.total_ms
    return msg
