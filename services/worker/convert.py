"""Protobuf <-> engine types for the worker, with every field validated at the edge."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from cotserve.common.chat import template_kwargs
from cotserve.common.tools import template_tool_calls, tools_from_pb
from cotserve.common.errors import FailedPrecondition, InvalidArgument
from cotserve.common.sampling import (
    ReasoningParams, SamplingParams, SlaClass, StructuredOutput, check_self_consistency, finish_reason_to_pb, reasoning_from_pb, sampling_from_pb, sla_from_pb,
)
from cotserve.worker.detokenizer import TokenTexts
from cotserve.worker.reasoning import ReasoningFormat
from cotserve.common.v1 import common_pb2
from cotserve.worker.outputs import NO_TOKEN, RequestOutput, VoteResult
from cotserve.worker.v1 import worker_pb2


@dataclass(slots=True, frozen=True)
class GenerateCall:
    prompt_ids: list[int]
    params: SamplingParams
    sla_class: SlaClass
    cache_salt: str = ""
    budget: ReasoningParams = ReasoningParams()
    tenant: str = ""


def max_token_chars(tokenizer: Tokenizer) -> int:
    """Characters of the longest vocabulary entry (byte-level entries count one per byte, never fewer
    than the characters they stand for): a text longer than `max_tokens` times this cannot encode to
    `max_tokens` tokens or fewer, unless the tokenizer's normalizer drops characters."""
    return max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1) or 1


def check_text_length(text: str, field: str, max_tokens: int, token_chars: int) -> None:
    """INVALID_ARGUMENT for a text too long to be `max_tokens` tokens, decided without tokenizing it."""
    if len(text) > max_tokens * token_chars:
        raise InvalidArgument(f"{field}: {len(text)} characters cannot fit in {max_tokens} tokens (at most "
                              f"{max_tokens * token_chars} characters: the longest token is {token_chars})")


def generate_from_pb(req: worker_pb2.GenerateRequest, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                     reasoning: ReasoningFormat | None = None, token_chars: int | None = None,
                     chat_template: Any = None, tool_parser: str = "") -> GenerateCall:
    """Validate and tokenize (rendering chat messages with the model's `chat_template` first, with the request's
    tools). Long prompts take a while to tokenize: call this off the event loop."""
    if sum(map(bool, (req.prompt_text, req.prompt_token_ids, req.messages))) > 1:
        raise InvalidArgument("prompt_text, prompt_token_ids and messages: set exactly one")
    max_prompt = max_model_len - 1
    if req.max_prompt_tokens:
        max_prompt = min(max_prompt, req.max_prompt_tokens)
    chars = token_chars or max_token_chars(tokenizer)
    tools = tools_from_pb(req.tools) if req.HasField("tools") else None
    if req.prompt_text:
        check_text_length(req.prompt_text, "prompt_text", max_prompt, chars)
        ids = tokenizer.encode(req.prompt_text).ids
    elif req.prompt_token_ids:
        ids = list(req.prompt_token_ids)
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"prompt_token_ids: token {bad} is out of range (0..{vocab_size - 1})")
    elif req.messages:
        variables = template_kwargs(req.chat_template_kwargs) if req.HasField("chat_template_kwargs") else {}
        if tools is not None and tools.shown:
            check_tool_parser(tool_parser)
            variables["tools"] = tools.template_tools()
        text = render_messages(req.messages, chat_template, variables)
        check_text_length(text, "messages", max_prompt, chars)
        ids = tokenizer.encode(text, add_special_tokens=False).ids  # the template wrote the special tokens
    else:
        raise InvalidArgument("prompt_text / prompt_token_ids / messages: the prompt is empty")
    if not ids:
        raise InvalidArgument("prompt_text: the prompt encodes to no tokens")
    if len(ids) >= max_model_len:
        raise InvalidArgument(
            f"prompt: {len(ids)} tokens is over the model's context (prompt must be at most {max_model_len - 1} "
            f"tokens, leaving room for one generated token)"
        )
    if len(ids) > max_prompt:
        raise InvalidArgument(f"prompt: {len(ids)} tokens is over the limit of {max_prompt} prompt tokens")
    params = sampling_from_pb(
        req.sampling, vocab_size=vocab_size, max_model_len=max_model_len, max_new_tokens_limit=max_model_len - len(ids)
    )
    if tools is not None and tools.forced:
        if params.structured is not None:
            raise InvalidArgument("tools.choice: a required or named tool choice is a format of its own; drop "
                                  "sampling.structured_output")
        params = dataclasses.replace(params, structured=StructuredOutput("tool_calls", tools.grammar_spec()))
    budget = reasoning_from_pb(req.reasoning) if req.HasField("reasoning") else ReasoningParams()
    check_self_consistency(budget, params)
    check_budget(budget, reasoning)
    return GenerateCall(ids, params, sla_from_pb(req.sla_class), req.cache_salt, budget, req.tenant)


def render_messages(messages, chat_template: Any, variables: dict[str, Any] | None = None) -> str:
    """Chat messages as the model's prompt text, with the client's template `variables` (`common.chat`);
    FAILED_PRECONDITION when the model has no chat template."""
    if chat_template is None:
        raise FailedPrecondition("messages: this model has no chat template (chat_template.jinja, or chat_template in "
                                 "tokenizer_config.json); send a prompt instead")
    turns = []
    knows_developer = "developer" in chat_template.source
    for m in messages:
        # OpenAI's `developer` role is the system turn of a template that has none of that name
        role = "system" if m.role == "developer" and not knows_developer else m.role
        turn: dict[str, Any] = {"role": role, "content": m.content}
        if m.reasoning_content:  # by the names templates read it: Qwen3's and DeepSeek's, and gpt-oss's `thinking`
            turn["reasoning_content"] = turn["thinking"] = m.reasoning_content
        if m.tool_calls:
            turn["tool_calls"] = template_tool_calls(m.tool_calls)
        for key in ("tool_call_id", "name"):
            if getattr(m, key):
                turn[key] = getattr(m, key)
        turns.append(turn)
    return chat_template.render(turns, add_generation_prompt=True, **(variables or {}))


def check_tool_parser(parser: str) -> None:
    """FAILED_PRECONDITION where the model writes no tool calls the worker can parse."""
    if not parser:
        raise FailedPrecondition("tools: this model's chat template writes no tool calls the worker can parse; start "
                                 "the worker with --tool-call-parser hermes if the model writes <tool_call> blocks")


def check_budget(budget: ReasoningParams, fmt: ReasoningFormat | None) -> None:
    """FAILED_PRECONDITION, naming the worker flag to set, for budgets this model's format cannot honour."""
    if not budget.is_set:
        return
    if fmt is None:
        raise FailedPrecondition("reasoning: this model has no reasoning markers (its tokenizer has no <think> / </think>); "
                                 "start the worker with --reasoning-start and --reasoning-end")
    if budget.max_thinking_steps is not None and fmt.step is None:
        raise FailedPrecondition("reasoning.max_thinking_steps: the worker counts no steps; start it with --reasoning-step "
                                 "(the text that ends a reasoning step, e.g. '.' or a newline)")
    if budget.min_thinking_tokens and len(fmt.end_ids) != 1:
        raise FailedPrecondition(f"reasoning.min_thinking_tokens: the end marker {fmt.end!r} is {len(fmt.end_ids)} tokens; "
                                 "only a single-token end marker can be held back")
    ee = budget.early_exit
    if ee is not None and ee.probe_every_steps is not None and fmt.step is None:
        raise FailedPrecondition("reasoning.early_exit.probe_every_steps: the worker counts no steps; start it with "
                                 "--reasoning-step (the text that ends a reasoning step, e.g. '.' or a newline)")


def output_to_pb(out: RequestOutput, token_texts: TokenTexts | None = None) -> worker_pb2.GenerateResponse:
    """One engine output as a stream chunk; `token_texts` names the tokens of its logprobs."""
    msg = worker_pb2.GenerateResponse(text=out.text, index=out.index, part=out.part)
    if out.token_id != NO_TOKEN:
        msg.token_ids.append(out.token_id)
        if out.logprob is not None and token_texts is not None:
            msg.token_logprobs.append(_token_logprob(out, token_texts))
    if out.reasoning_text is not None:
        msg.reasoning_text = out.reasoning_text
        msg.answer_text = out.answer_text or ""
    if out.logprob is not None:
        msg.logprobs.append(out.logprob)
    if out.finish_reason is not None:
        msg.finish_reason = finish_reason_to_pb(out.finish_reason)
    if out.is_last:
        msg.usage.prompt_tokens = out.prompt_tokens
        msg.usage.completion_tokens = out.completion_tokens
        msg.usage.cached_prompt_tokens = out.cached_prompt_tokens
        msg.usage.reasoning_tokens = out.reasoning_tokens
        msg.usage.probe_tokens = out.probe_tokens
    if out.vote is not None:
        vote_to_pb(out.vote, msg.self_consistency)
    if out.timing is not None:
        msg.timing.queue_ms = out.timing.queue_ms
        msg.timing.ttft_ms = out.timing.ttft_ms
        msg.timing.total_ms = out.timing.total_ms
        msg.timing.kv_used_fraction_at_admission = out.timing.kv_used_fraction_at_admission
    return msg


def _token_logprob(out: RequestOutput, token_texts: TokenTexts) -> common_pb2.TokenLogprob:
    text, raw = token_texts(out.token_id)
    entry = common_pb2.TokenLogprob(token=text, token_bytes=raw, logprob=out.logprob)
    if out.top_logprobs is not None:
        for token_id, logprob in zip(*out.top_logprobs):
            text, raw = token_texts(token_id)
            entry.top_logprobs.add(token_id=token_id, token=text, token_bytes=raw, logprob=logprob)
    return entry


def vote_to_pb(vote: VoteResult, msg: common_pb2.SelfConsistencyResult) -> None:
    msg.answer = vote.answer
    msg.votes.extend(common_pb2.VoteEntry(answer=e.answer, count=e.count, weight=e.weight) for e in vote.votes)
    msg.samples_used = vote.samples_used
    msg.samples_cancelled = vote.samples_cancelled
    msg.sample_tokens.extend(vote.sample_tokens)
    msg.stop_reason = vote.stop_reason
