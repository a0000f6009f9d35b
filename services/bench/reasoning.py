"""`cotserve bench reasoning`: cost per correct answer of the reasoning controls.

One worker (the reasoning testbed, `--reasoning-step .`) and one gateway; every method answers the
same seeded problems through the SDK at a fixed concurrency:

- greedy;
- maj@8: eight samples per problem (n=8) at the bench's temperature, majority vote: the baseline;
- budgets at 25 / 50 / 75% of greedy's median thinking length (max_thinking_tokens);
- early exit alone: a probe after every reasoning step, the first confident one (mean token
  probability >= 0.95) ends the thinking; and with two probes in a row agreeing instead;
- adaptive self-consistency alone: up to 8 samples in rounds of 2, stopped by two identical answers
  in a row (ESC's window rule); and in rounds of 3 with the posterior rule (threshold 0.95);
- adaptive self-consistency + early exit.

For each: accuracy, generated tokens per problem (completion + probe tokens), thinking tokens per
problem, tokens per correct answer, correct answers per second, samples per problem.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from cotserve.sdk import AsyncClient, EarlyExit, GenerateResult, Reasoning, SelfConsistency
from cotserve.demo.arithmetic import Problem, testbed_problems

TESTBED = Path(__file__).resolve().parents[1] / "worker" / "demo" / "testbed"
PROBLEM_SEED = 20_261_203
# a probe after every reasoning step; the first probe that answers with a mean token probability of at
# least 0.95 ends the thinking (a model made to answer before it has worked the answer out guesses,
# unsure). 0.95, not 0.9: at 0.9 the testbed sometimes believed itself done one step early (2 of 300
# problems of a development set, seed 99, answered differently from the full chain; none at 0.95)
EE = EarlyExit(probe_every_steps=1, agree=1, min_confidence=0.95)
EE_AGREE = EarlyExit(probe_every_steps=1, agree=2)  # Dynasor's consistency rule alone: two probes in a row agree


@dataclass(slots=True, frozen=True)
class Method:
    name: str
    temperature: float = 0.0
    n: int = 1
    reasoning: Reasoning | None = None
    budget_fraction: float | None = None  # of greedy's median thinking length, set once greedy ran


@dataclass(slots=True)
class MethodResult:
    name: str
    problems: int = 0
    correct: int = 0
    tokens: int = 0  # completion + probe tokens
    probe_tokens: int = 0
    thinking_tokens: int = 0  # reasoning tokens
    samples: int = 0  # samples that produced tokens
    samples_correct: int = 0  # of those, samples whose own answer was right (maj@8's per-sample accuracy)
    seconds: float = 0.0
    thinking_lengths: list[int] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.problems if self.problems else 0.0

    @property
    def tokens_per_problem(self) -> float:
        return self.tokens / self.problems if self.problems else 0.0

    @property
    def tokens_per_correct(self) -> float:
        return self.tokens / self.correct if self.correct else float("inf")

    @property
    def correct_per_s(self) -> float:
        return self.correct / self.seconds if self.seconds else 0.0


def methods(max_samples: int, temperature: float) -> list[Method]:
    sc = SelfConsistency(max_samples, min_samples=2, rule="window", window=2)  # ESC: two identical answers in a row
    post = SelfConsistency(max_samples, min_samples=3, rule="posterior", threshold=0.95)  # 3-0 of 8 settles it (0.96)
    return [
        Method("greedy"),
        Method(f"maj@{max_samples} (baseline)", temperature, n=max_samples),
        *[Method(f"budget {int(f * 100)}% of median", budget_fraction=f) for f in (0.25, 0.5, 0.75)],
        Method("early exit", reasoning=Reasoning(early_exit=EE)),
        Method("early exit (2 probes agree)", reasoning=Reasoning(early_exit=EE_AGREE)),
        Method("adaptive SC (window)", temperature, reasoning=Reasoning(self_consistency=sc)),
        Method("adaptive SC (posterior)", temperature, reasoning=Reasoning(self_consistency=post)),
        Method("adaptive SC + early exit", temperature, reasoning=Reasoning(self_consistency=sc, early_exit=EE)),
    ]


def _int(text: str | None) -> int | None:
    try:
        return int((text or "").strip())
    except ValueError:
        return None


def _majority(answers: list[str]) -> str:
    counts = Counter(a for a in answers if a)
    return counts.most_common(1)[0][0] if counts else ""


def score(result: GenerateResult, problem: Problem, out: MethodResult) -> None:
    u = result.usage
    out.problems += 1
    out.tokens += u.completion_tokens + u.probe_tokens
    out.probe_tokens += u.probe_tokens
    out.thinking_tokens += u.reasoning_tokens
    answers = [c.answer_text or "" for c in result.choices if c.finish_reason != "cancelled"]
    out.samples += len(result.choices)
    out.samples_correct += sum(_int(a) == problem.answer for a in answers)
    if len(result.choices) == 1:
        out.thinking_lengths.append(u.reasoning_tokens)
    if result.self_consistency is not None:
        answer = result.self_consistency.answer
    elif len(result.choices) > 1:
        answer = _majority(answers)
    else:
        answer = result.answer_text or ""
    out.correct += _int(answer) == problem.answer


async def run_method(client: AsyncClient, method: Method, problems: list[Problem], concurrency: int, seed: int,
                     median_thinking: float | None, log: Callable[[str], None]) -> MethodResult:
    reasoning = method.reasoning
    if method.budget_fraction is not None:
        reasoning = Reasoning(max_thinking_tokens=max(0, round(method.budget_fraction * (median_thinking or 0))))
    out = MethodResult(method.name)
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(i: int, p: Problem) -> None:
        nonlocal done
        async with sem:
            result = await client.generate(p.prompt, max_new_tokens=160, temperature=method.temperature,
                                           seed=seed + 1000 * i if method.temperature else None, n=method.n,
                                           reasoning=reasoning, timeout_s=600)
        score(result, p, out)
        done += 1
        if done % 100 == 0:
            log(f"  {method.name}: {done}/{len(problems)}")

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(problems)))
    out.seconds = time.perf_counter() - start
    return out


async def run_all(gateway: str, problems: list[Problem], max_samples: int, temperature: float, concurrency: int,
                  seed: int, log: Callable[[str], None]) -> list[MethodResult]:
    results: list[MethodResult] = []
    median_thinking: float | None = None
    async with AsyncClient(gateway) as client:
        await client.generate(problems[0].prompt, max_new_tokens=4)  # warm-up
        for method in methods(max_samples, temperature):
            log(f"{method.name} ...")
            r = await run_method(client, method, problems, concurrency, seed, median_thinking, log)
            if method.name == "greedy":
                median_thinking = statistics.median(r.thinking_lengths) - 2  # the two markers are not thinking
            results.append(r)
            log(f"  {r.name}: accuracy {r.accuracy:.1%}, {r.tokens_per_problem:.1f} tokens/problem, {r.seconds:.1f}s")
    return results


def problem_set(count: int, seed: int = PROBLEM_SEED) -> list[Problem]:
    return testbed_problems(seed, count)
