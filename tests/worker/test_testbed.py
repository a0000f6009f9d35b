"""The bundled reasoning testbed: its format, and early exit on it (greedy, so every expectation is a run)."""

from __future__ import annotations

import pytest
import torch

from cotserve.bench.reasoning import TESTBED
from cotserve.common.sampling import EarlyExitParams, ReasoningParams
from cotserve.demo import arithmetic
from cotserve.demo.arithmetic import Problem, parse_answer
from cotserve.worker.engine import Engine
from cotserve.worker.engine_config import EngineConfig
from cotserve.worker.outputs import RequestOutput
from cotserve.worker.models.loader import load_model
from cotserve.worker.reasoning import ReasoningFormat
from cotserve.worker.sequence import SamplingParams

BLOCKS = 512


@pytest.fixture(scope="module")
def testbed():
    return load_model(TESTBED, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def fmt(testbed):
    return ReasoningFormat.for_tokenizer(testbed.tokenizer, step=".")


def run_all(testbed, fmt, prompts: list[str], rp: ReasoningParams) -> list[list[RequestOutput]]:
    engine = Engine(testbed, EngineConfig(num_blocks=BLOCKS, block_size=16, max_num_seqs=128, max_num_batched_tokens=1024,
                                          max_model_len=testbed.config.max_context), fmt)
    outs: list[list[RequestOutput]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        engine.submit(str(i), testbed.tokenizer.encode(p).ids, SamplingParams(max_new_tokens=160), outs[i].append, budget=rp)
    engine.drain_inbox(block=False)
    while engine.scheduler.has_work():
        engine.step()
    assert engine.block_manager.num_free_blocks == BLOCKS
    return outs


def text(outs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outs)


def test_the_testbed_checks_its_answer_backwards_before_closing_its_thinking(testbed, fmt):
    p = Problem((37, 48, 12), ("+", "-"))
    [outs] = run_all(testbed, fmt, [p.prompt], ReasoningParams())
    assert text(outs) == arithmetic.testbed_completion(p) == "<think>37+48=85. 85-12=73. check 73+12=85. 85-48=37.</think> 73"


def test_early_exit_returns_the_full_samples_answer_where_it_converges(testbed, fmt):
    problems = arithmetic.testbed_problems(7, 48)
    prompts = [p.prompt for p in problems]
    full = run_all(testbed, fmt, prompts, ReasoningParams())
    # the bench's setting: a probe after every step, the first confident one ends the thinking (the testbed
    # guesses, unsure, when asked before its forward chain has reached the result)
    early = run_all(testbed, fmt, prompts, ReasoningParams(early_exit=EarlyExitParams(probe_every_steps=1, agree=1,
                                                                                      min_confidence=0.95)))
    exited = 0
    for f, e in zip(full, early):
        if e[-1].completion_tokens < f[-1].completion_tokens:  # it exited early
            exited += 1
            assert e[-1].answer_text == f[-1].answer_text, (text(f), text(e))
            assert "check" in text(f) and e[-1].reasoning_tokens < f[-1].reasoning_tokens
        else:
            assert text(e) == text(f)
        assert e[-1].probe_tokens > 0
    assert exited >= len(problems) * 3 // 4  # the backward check is where the answer has settled


@pytest.mark.parametrize("budget", [0, 3, 8, 20])
def test_a_forced_end_of_thinking_is_followed_by_an_answer(testbed, fmt, budget):
    problems = arithmetic.testbed_problems(11, 8)
    for p, outs in zip(problems, run_all(testbed, fmt, [p.prompt for p in problems], ReasoningParams(max_thinking_tokens=budget))):
        t = text(outs)
        assert outs[-1].finish_reason == "stop" and parse_answer(t) is not None, t
        thinking = [o.token_id for o in outs]
        thinking = thinking[thinking.index(fmt.start_ids[0]) + 1: thinking.index(fmt.end_ids[0])]
        assert len(thinking) <= budget
