"""The bundled demo model answers arithmetic through the worker, as shipped."""

from __future__ import annotations

import asyncio

from cotserve.demo.arithmetic import Problem, parse_answer, problems
from cotserve.demo.evaluate import evaluate

FIXED_SAMPLE_SEED = 2024  # a fixed sample of 50, distinct from training's and the 500-problem report's


def test_problem_format():
    p = Problem((37, 48, 12), ("+", "-"))
    assert (p.prompt, p.completion, p.answer) == ("37+48-12=", "<think>37+48=85. 85-12=73.</think> 73", 73)
    assert parse_answer(p.completion) == 73 and parse_answer("<think>1+1=2.") is None
    ps = problems(1, 200)
    assert {len(p.operands) for p in ps} == {2, 3, 4, 5, 6}
    assert all(0 <= x <= 99 for p in ps for x in p.operands)


def test_fixed_sample_of_50_through_the_worker_is_at_least_90_percent(demo_worker):
    result = asyncio.run(evaluate(demo_worker, sample=problems(FIXED_SAMPLE_SEED, 50), concurrency=16))
    assert result.total == 50
    assert result.correct >= 45, f"{result.correct}/50; misses: {result.wrong[:5]}"
