"""Reasoning format and thinking budgets: the format and tracker alone, then on the demo model."""

from __future__ import annotations

import re

import pytest
import torch

from cotserve.common.errors import FailedPrecondition
from cotserve.common.sampling import ReasoningParams
from cotserve.worker.engine import Engine
from cotserve.worker.engine_config import EngineConfig
from cotserve.worker.outputs import RequestOutput
from cotserve.worker.models.loader import load_model
from cotserve.worker.reasoning import Part, ReasoningFormat, ThinkingTracker
from cotserve.worker.convert import check_budget
from cotserve.worker.sequence import SamplingParams
from cotserve.worker.config import DEMO_MODEL

ANSWER = "<think>37+48=85. 85-12=73.</think> 73"


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_MODEL, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def fmt(demo):
    return ReasoningFormat.for_tokenizer(demo.tokenizer, step=".")


def test_the_tokenizers_think_tokens_are_the_default_format(demo, fmt):
    assert (fmt.start, fmt.end, fmt.start_ids, fmt.end_ids) == ("<think>", "</think>", (1449,), (1450,))
    assert fmt.split(ANSWER) == ("37+48=85. 85-12=73.", "73")
    assert fmt.split("no thinking here ") == ("", "no thinking here")
    assert fmt.split("<think>cut off 1+1") == ("cut off 1+1", "")
    assert fmt.split("1+1=2.</think> 2", thinking_at_start=True) == ("1+1=2.", "2")
    rx = ReasoningFormat.for_tokenizer(demo.tokenizer, answer_regex=r"answer: (-?\d+)")
    assert rx.split("<think>x</think> so the answer: 42.") == ("x", "42")
    custom = ReasoningFormat.for_tokenizer(demo.tokenizer, start="[[", end="]]")
    assert custom.split("[[ a ]] b") == ("a", "b") and len(custom.start_ids) >= 1


@pytest.mark.parametrize("kwargs,message", [
    ({"start": "<s2>"}, "reasoning_start / reasoning_end: give both markers or neither"),
    ({"step": ""}, "reasoning_step: must not be empty"),
    ({"answer_regex": "("}, "answer_regex: '(' is not a regular expression"),
])
def test_bad_format_flags_are_named(demo, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ReasoningFormat.for_tokenizer(demo.tokenizer, **kwargs)


def test_tracker_labels_parts_and_counts_tokens_and_steps(demo, fmt):
    tok = demo.tokenizer
    tracker = ThinkingTracker(fmt, ReasoningParams(), tok.encode("37+48-12=").ids)
    ids = tok.encode(ANSWER, add_special_tokens=False).ids
    parts = [tracker.observe(t, tok.decode([t])) for t in ids]
    end = ids.index(1450)
    assert parts == [Part.REASONING] * (end + 1) + [Part.ANSWER] * (len(ids) - end - 1)
    assert tracker.num_thinking_tokens == end - 1 and tracker.num_reasoning_tokens == end + 1
    assert tracker.num_steps == 2 and not tracker.is_thinking


def test_a_prompt_that_opens_the_thinking_starts_in_it(demo, fmt):
    tracker = ThinkingTracker(fmt, ReasoningParams(max_thinking_tokens=2), demo.tokenizer.encode("1+1=<think>").ids)
    assert tracker.thinking_at_start and tracker.is_thinking
    tracker.observe(5, "a")
    assert not tracker.must_stop_thinking()
    tracker.observe(5, "b")
    assert tracker.must_stop_thinking()


def test_budgets_the_format_cannot_honour_are_failed_precondition(demo, fmt):
    check_budget(ReasoningParams(), None)  # no budget: fine on any model
    with pytest.raises(FailedPrecondition, match="--reasoning-start and --reasoning-end"):
        check_budget(ReasoningParams(max_thinking_tokens=5), None)
    with pytest.raises(FailedPrecondition, match="reasoning.max_thinking_steps: .* --reasoning-step"):
        check_budget(ReasoningParams(max_thinking_steps=2), ReasoningFormat.for_tokenizer(demo.tokenizer))
    two_token_end = ReasoningFormat.for_tokenizer(demo.tokenizer, start="<think>", end="[end]")
    with pytest.raises(FailedPrecondition, match="reasoning.min_thinking_tokens: the end marker '\\[end\\]' is"):
        check_budget(ReasoningParams(min_thinking_tokens=3), two_token_end)


def run(demo, fmt, prompt: str, budget: ReasoningParams, max_new_tokens: int = 64) -> list[RequestOutput]:
    engine = Engine(demo, EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                                       max_model_len=demo.config.max_context), fmt)
    outs: list[RequestOutput] = []
    engine.submit("r", demo.tokenizer.encode(prompt).ids, SamplingParams(max_new_tokens=max_new_tokens), outs.append,
                  budget=budget)
    engine.drain_inbox(block=False)
    while engine.scheduler.has_work():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert outs[-1].error is None and outs[-1].is_last
    return outs


def thinking_ids(outs: list[RequestOutput]) -> list[int]:
    ids = [o.token_id for o in outs]
    return ids[ids.index(1449) + 1: ids.index(1450)]


def test_unbudgeted_output_is_unchanged_and_split(demo, fmt):
    outs = run(demo, fmt, "37+48-12=", ReasoningParams())
    assert "".join(o.text for o in outs) == ANSWER
    last = outs[-1]
    assert (last.reasoning_text, last.answer_text) == ("37+48=85. 85-12=73.", "73")
    assert [o.part for o in outs] == [1] * (len(thinking_ids(outs)) + 2) + [2] * (len(outs) - len(thinking_ids(outs)) - 2)
    assert last.reasoning_tokens == len(thinking_ids(outs)) + 2


# Where the demo model, which never saw cut-off thinking in training, keeps computing after a forced
# end marker instead of answering at once (it answers later, after its own end marker); the
# mechanism is the same at every budget.
DEMO_KEEPS_COMPUTING = {1, 2, 8}


@pytest.mark.parametrize("budget", range(12))
def test_max_thinking_tokens_is_exact_and_the_forced_end_is_followed_by_an_answer(demo, fmt, budget):
    prompt = "12+30-7+5+61-20="  # thinks for 24 tokens unbudgeted
    free = thinking_ids(run(demo, fmt, prompt, ReasoningParams()))
    assert len(free) > 11
    outs = run(demo, fmt, prompt, ReasoningParams(max_thinking_tokens=budget))
    assert thinking_ids(outs) == free[:budget]  # the same thinking, cut exactly at the budget
    ids = [o.token_id for o in outs]
    end = ids.index(1450)
    assert [o.part for o in outs[end + 1:]] == [2] * (len(ids) - end - 1)  # all answer from here
    assert ids[-1] in demo.eos_token_ids and outs[-1].finish_reason == "stop"
    assert outs[-1].reasoning_tokens == budget + 2
    if budget not in DEMO_KEEPS_COMPUTING:
        assert re.fullmatch(r"-?\d+", outs[-1].answer_text), outs[-1].answer_text


def test_max_thinking_steps_stops_after_that_many_steps(demo, fmt):
    outs = run(demo, fmt, "12+30-7+5+61-20=", ReasoningParams(max_thinking_steps=2))
    assert outs[-1].reasoning_text == "12+30=42. 42-7=35."
    assert re.fullmatch(r"-?\d+", outs[-1].answer_text)


def test_min_thinking_tokens_holds_the_end_marker_back(demo, fmt):
    free = thinking_ids(run(demo, fmt, "37+48-12=", ReasoningParams()))
    outs = run(demo, fmt, "37+48-12=", ReasoningParams(min_thinking_tokens=len(free) + 5), max_new_tokens=120)
    held = [o.token_id for o in outs]
    assert 1450 not in held[: held.index(1449) + 1 + len(free) + 5]  # no end marker before the minimum


def test_a_custom_forcing_text_is_what_the_model_reads(demo, fmt):
    outs = run(demo, fmt, "12+30-7+5+61-20=", ReasoningParams(max_thinking_tokens=3, forcing_text=" Time is up.</think>"))
    text = "".join(o.text for o in outs)
    assert text.startswith("<think>12+30 Time is up.</think>")  # three thinking tokens: 12 + 30
    assert outs[-1].reasoning_text == "12+30 Time is up."
