"""Sampling parameters and SLA classes: the domain types, and their validation from protobuf.

Shared by the gateway (validation at the edge) and the worker (the engine's input).
No torch, no grpc.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass

from cotserve.common.errors import InvalidArgument
from cotserve.common.v1 import common_pb2


class SlaClass(enum.IntEnum):
    """Scheduling class; a lower value is more urgent."""

    REALTIME = 0
    INTERACTIVE = 1
    BATCH = 2


DEFAULT_MAX_NEW_TOKENS = 256
"""Tokens a request generates at most when it does not say (the one default every front and the engine use)."""

SLA_PB = {SlaClass.REALTIME: common_pb2.SLA_CLASS_REALTIME, SlaClass.INTERACTIVE: common_pb2.SLA_CLASS_INTERACTIVE,
          SlaClass.BATCH: common_pb2.SLA_CLASS_BATCH}
"""Each class's wire value (SLA_CLASS_UNSPECIFIED reads as INTERACTIVE)."""
SLA_PB_BY_NAME = {cls.name.lower(): pb for cls, pb in SLA_PB.items()}
"""The classes' wire values by their lower-case names (flags, tenants files, the SDK's `sla=`)."""
FINISH_PB = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
             "cancelled": common_pb2.FINISH_REASON_CANCELLED, "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS}
"""Finish reasons by name, as the engine and every API name them, and their wire values."""


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """A format the output must follow (`worker/grammar.py` enforces it): `kind` one of STRUCTURED_KINDS; `spec` the
    schema's JSON text, the regex or the EBNF grammar; `choices` for a choice; `strict` for a JSON Schema."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    strict: bool = True

    @property
    def is_json(self) -> bool:
        """Its output is one JSON value (votes compare them parsed)."""
        return self.kind in ("json_object", "json_schema")


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Validated sampling parameters (`sampling_from_pb` checks every field)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    ignore_eos: bool = False
    n: int = 1  # samples of the prompt; they share its KV pages
    top_logprobs: int = 0  # with logprobs: the most likely alternatives at each position
    structured: StructuredOutput | None = None  # the format the output (a reasoning model's answer) must follow
    presence_penalty: float = 0.0  # subtracted once from each generated token's logit
    frequency_penalty: float = 0.0  # subtracted per occurrence of each generated token
    repetition_penalty: float = 1.0  # seen tokens (prompt and output): positive logits divided, negative multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) added to the logits
    min_p: float = 0.0  # tokens below min_p x the most likely one's probability are left out

    @property
    def penalizes(self) -> bool:
        """The sampler needs the sample's tokens (presence, frequency or repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256
MAX_SAMPLES = 16
MAX_FORCING_TEXT_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_STRUCTURED_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024

_SLA = {common_pb2.SLA_CLASS_UNSPECIFIED: SlaClass.INTERACTIVE, **{pb: cls for cls, pb in SLA_PB.items()}}


def max_new_tokens_of(sp: common_pb2.SamplingParams) -> int:
    """A request's max_new_tokens as sent, or the default (before validation: quotas and routing estimate with it)."""
    return sp.max_new_tokens if sp.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS


def sla_from_pb(value: int) -> SlaClass:
    if value not in _SLA:
        raise InvalidArgument(f"sla_class: unknown value {value} (allowed: REALTIME, INTERACTIVE, BATCH)")
    return _SLA[value]


def sampling_from_pb(
    sp: common_pb2.SamplingParams, *, vocab_size: int, max_model_len: int, max_new_tokens_limit: int
) -> SamplingParams:
    """Validate and convert. `max_new_tokens` may be up to the model's context; generation is
    capped at `max_new_tokens_limit`, what the context leaves after the prompt ("length")."""
    max_new = max_new_tokens_of(sp)
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
    n = sp.n if sp.HasField("n") else 1
    if not 1 <= n <= MAX_SAMPLES:
        raise InvalidArgument(f"sampling.n: {n} is out of range (1..{MAX_SAMPLES})")
    for t in sp.stop_token_ids:
        if t >= vocab_size:
            raise InvalidArgument(f"sampling.stop_token_ids: {t} is out of range (0..{vocab_size - 1})")
    top_logprobs = sp.top_logprobs if sp.HasField("top_logprobs") else 0
    if not 0 <= top_logprobs <= min(MAX_TOP_LOGPROBS, vocab_size):
        raise InvalidArgument(f"sampling.top_logprobs: {top_logprobs} is out of range "
                              f"(0..{min(MAX_TOP_LOGPROBS, vocab_size)})")
    if top_logprobs and not sp.logprobs:
        raise InvalidArgument("sampling.top_logprobs: needs sampling.logprobs (set it to true)")
    penalties = _penalties_from_pb(sp, vocab_size)
    return SamplingParams(
        **penalties,
        structured=structured_from_pb(sp.structured_output) if sp.HasField("structured_output") else None,
        max_new_tokens=min(max_new, max_new_tokens_limit),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        seed=sp.seed if sp.HasField("seed") else None,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        logprobs=sp.logprobs,
        ignore_eos=sp.ignore_eos,
        n=n,
        top_logprobs=top_logprobs,
    )




def _penalties_from_pb(sp: common_pb2.SamplingParams, vocab_size: int) -> dict:
    """Penalties, logit bias and min_p, each checked against its range."""
    out: dict = {}
    for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0)):
        if sp.HasField(name):
            value = getattr(sp, name)
            if not (math.isfinite(value) and low <= value <= high):
                raise InvalidArgument(f"sampling.{name}: {value:g} is out of range ({low:g}..{high:g})")
            out[name] = float(value)
    if sp.HasField("repetition_penalty"):
        value = sp.repetition_penalty
        if not (math.isfinite(value) and 0.0 < value <= 2.0):
            raise InvalidArgument(f"sampling.repetition_penalty: {value:g} is out of range (0 < it <= 2; 1 is off)")
        out["repetition_penalty"] = float(value)
    if sp.logit_bias:
        if len(sp.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(f"sampling.logit_bias: {len(sp.logit_bias)} tokens, at most {MAX_LOGIT_BIAS}")
        for token, bias in sp.logit_bias.items():
            if token >= vocab_size:
                raise InvalidArgument(f"sampling.logit_bias: token {token} is out of range (0..{vocab_size - 1})")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidArgument(f"sampling.logit_bias: {bias:g} for token {token} is out of range (-100..100)")
        out["logit_bias"] = tuple(sorted((int(t), float(b)) for t, b in sp.logit_bias.items()))
    return out


def structured_from_pb(so: common_pb2.StructuredOutput) -> StructuredOutput:
    """The format's shape checked (sizes, the schema is a JSON object); whether it compiles is the worker's
    (`worker/grammar.py`), which names what it cannot take."""
    where = "sampling.structured_output"
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(f"{where}: set one of {', '.join(STRUCTURED_KINDS)}")
    if kind == "json_object":
        if not so.json_object:
            raise InvalidArgument(f"{where}.json_object: true or unset")
        return StructuredOutput("json_object")
    if kind == "choice":
        choices = tuple(so.choice.choices)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise InvalidArgument(f"{where}.choice: {len(choices)} choices, allowed 1..{MAX_CHOICES}")
        if not all(1 <= len(c) <= MAX_CHOICE_CHARS for c in choices):
            raise InvalidArgument(f"{where}.choice: each choice must have 1..{MAX_CHOICE_CHARS} characters")
        return StructuredOutput("choice", choices=choices)
    spec = so.json_schema.schema if kind == "json_schema" else getattr(so, kind)
    field = f"{where}.{kind}" + (".schema" if kind == "json_schema" else "")
    if not 1 <= len(spec) <= MAX_STRUCTURED_SPEC_CHARS:
        raise InvalidArgument(f"{field}: {len(spec)} characters, allowed 1..{MAX_STRUCTURED_SPEC_CHARS}")
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise InvalidArgument(f"{field}: not JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise InvalidArgument(f"{field}: a JSON Schema is a JSON object, got {type(schema).__name__}")
        return StructuredOutput("json_schema", spec, strict=so.json_schema.strict)
    return StructuredOutput(kind, spec)


MAX_AGREE = 16
MAX_PROBE_TOKENS = 64
DEFAULT_PROBE_TOKENS = 16
MAX_VOTE_SAMPLES = 64


def reasoning_from_pb(ro: common_pb2.ReasoningOptions) -> "ReasoningParams":
    """Validate a request's reasoning options; every field is named in its error."""
    values = {}
    for name in ("max_thinking_tokens", "max_thinking_steps", "min_thinking_tokens"):
        if ro.HasField(name):
            value = getattr(ro, name)
            if value < 0:
                raise InvalidArgument(f"reasoning.{name}: {value} is out of range (>= 0)")
            values[name] = value
    low, high = values.get("min_thinking_tokens", 0), values.get("max_thinking_tokens")
    if high is not None and low > high:
        raise InvalidArgument(f"reasoning.min_thinking_tokens: {low} is above max_thinking_tokens ({high})")
    forcing = ro.forcing_text if ro.HasField("forcing_text") else None
    if forcing is not None and not 1 <= len(forcing) <= MAX_FORCING_TEXT_CHARS:
        raise InvalidArgument(f"reasoning.forcing_text: {len(forcing)} characters, allowed 1..{MAX_FORCING_TEXT_CHARS}")
    early = _early_exit_from_pb(ro.early_exit) if ro.HasField("early_exit") else None
    vote = _self_consistency_from_pb(ro.self_consistency) if ro.HasField("self_consistency") else None
    return ReasoningParams(values.get("max_thinking_tokens"), values.get("max_thinking_steps"), low, forcing, early, vote)


def check_self_consistency(reasoning: "ReasoningParams", params: SamplingParams) -> None:
    """Self-consistency draws its own samples (n stays 1) and needs a temperature to differ by."""
    if reasoning.self_consistency is None:
        return
    if params.n != 1:
        raise InvalidArgument(f"sampling.n: {params.n} with reasoning.self_consistency, which draws its own samples; "
                              "leave n unset (or 1)")
    if params.is_greedy:
        raise InvalidArgument("sampling.temperature: reasoning.self_consistency needs temperature > 0 (greedy samples "
                              "would all be the same)")


def _early_exit_from_pb(ee: common_pb2.EarlyExit) -> "EarlyExitParams":
    tokens = ee.probe_every_tokens if ee.HasField("probe_every_tokens") else None
    steps = ee.probe_every_steps if ee.HasField("probe_every_steps") else None
    if (tokens is None) == (steps is None):
        raise InvalidArgument("reasoning.early_exit: give exactly one of probe_every_tokens and probe_every_steps")
    for name, value in (("probe_every_tokens", tokens), ("probe_every_steps", steps)):
        if value is not None and value < 1:
            raise InvalidArgument(f"reasoning.early_exit.{name}: {value} is out of range (>= 1)")
    agree = ee.agree if ee.HasField("agree") else 2
    if not 1 <= agree <= MAX_AGREE:
        raise InvalidArgument(f"reasoning.early_exit.agree: {agree} is out of range (1..{MAX_AGREE})")
    conf = ee.min_confidence if ee.HasField("min_confidence") else None
    if conf is not None and not (0.0 < conf <= 1.0):
        raise InvalidArgument(f"reasoning.early_exit.min_confidence: {conf:g} is out of range ((0, 1])")
    probe_max = ee.probe_max_tokens if ee.HasField("probe_max_tokens") else DEFAULT_PROBE_TOKENS
    if not 1 <= probe_max <= MAX_PROBE_TOKENS:
        raise InvalidArgument(f"reasoning.early_exit.probe_max_tokens: {probe_max} is out of range (1..{MAX_PROBE_TOKENS})")
    return EarlyExitParams(tokens, steps, agree, conf, probe_max)


_RULES = {common_pb2.SELF_CONSISTENCY_RULE_UNSPECIFIED: "window", common_pb2.SELF_CONSISTENCY_RULE_WINDOW: "window",
          common_pb2.SELF_CONSISTENCY_RULE_POSTERIOR: "posterior"}


def _self_consistency_from_pb(sc: common_pb2.SelfConsistency) -> "SelfConsistencyParams":
    high = sc.max_samples
    if not 1 <= high <= MAX_VOTE_SAMPLES:
        raise InvalidArgument(f"reasoning.self_consistency.max_samples: {high} is out of range (1..{MAX_VOTE_SAMPLES})")
    low = sc.min_samples if sc.HasField("min_samples") else min(3, high)
    if not 1 <= low <= high:
        raise InvalidArgument(f"reasoning.self_consistency.min_samples: {low} is out of range (1..max_samples = {high})")
    if sc.rule not in _RULES:
        raise InvalidArgument(f"reasoning.self_consistency.rule: unknown value {sc.rule}")
    window = sc.window if sc.HasField("window") else low
    if not 1 <= window <= high:
        raise InvalidArgument(f"reasoning.self_consistency.window: {window} is out of range (1..max_samples = {high})")
    threshold = sc.threshold if sc.HasField("threshold") else 0.95
    if not 0.5 <= threshold < 1.0:
        raise InvalidArgument(f"reasoning.self_consistency.threshold: {threshold:g} is out of range ([0.5, 1))")
    drop = sc.drop_fraction if sc.HasField("drop_fraction") else 0.0
    if not 0.0 <= drop <= 0.9:
        raise InvalidArgument(f"reasoning.self_consistency.drop_fraction: {drop:g} is out of range ([0, 0.9])")
    return SelfConsistencyParams(high, low, _RULES[sc.rule], window, float(threshold), sc.confidence_weighted, float(drop))


@dataclass(slots=True, frozen=True)
class EarlyExitParams:
    """Validated early-exit options (see common.proto's EarlyExit)."""

    probe_every_tokens: int | None = None
    probe_every_steps: int | None = None
    agree: int = 2
    min_confidence: float | None = None
    probe_max_tokens: int = DEFAULT_PROBE_TOKENS


@dataclass(slots=True, frozen=True)
class SelfConsistencyParams:
    """Validated adaptive self-consistency options (see common.proto's SelfConsistency)."""

    max_samples: int
    min_samples: int = 3
    rule: str = "window"  # "window" (ESC) or "posterior" (Adaptive-Consistency)
    window: int = 3
    threshold: float = 0.95
    confidence_weighted: bool = False
    drop_fraction: float = 0.0


@dataclass(slots=True, frozen=True)
class ReasoningParams:
    """A request's validated reasoning options (`reasoning_from_pb`). None: no limit / off."""

    max_thinking_tokens: int | None = None
    max_thinking_steps: int | None = None
    min_thinking_tokens: int = 0
    forcing_text: str | None = None  # appended when a budget ends thinking; None: the model's end marker
    early_exit: EarlyExitParams | None = None
    self_consistency: SelfConsistencyParams | None = None

    @property
    def is_set(self) -> bool:
        return self != ReasoningParams()


def finish_reason_to_pb(reason: str) -> int:
    return FINISH_PB[reason]


_FINISH_NAMES = {v: k for k, v in FINISH_PB.items()}


def finish_reason_name(reason: int) -> str:
    """The name of a FinishReason value ("stop", "length", "cancelled"; "unknown" for anything else)."""
    return _FINISH_NAMES.get(reason, "unknown")
