"""The demo task: multi-step integer arithmetic written as a chain of thought.

Prompt `37+48-12=`, answer `<think>37+48=85. 85-12=73.</think> 73`. Operands 0-99, 2 to 6
operands, `+` and `-`. Shared by the training script, the accuracy evaluation and the tests.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

MIN_OPERANDS, MAX_OPERANDS = 2, 6
MAX_OPERAND = 99


@dataclass(slots=True, frozen=True)
class Problem:
    operands: tuple[int, ...]
    ops: tuple[str, ...]  # len(operands) - 1 items, each "+" or "-"

    @property
    def prompt(self) -> str:
        text = str(self.operands[0])
        for op, x in zip(self.ops, self.operands[1:]):
            text += f"{op}{x}"
        return text + "="

    @property
    def answer(self) -> int:
        acc = self.operands[0]
        for op, x in zip(self.ops, self.operands[1:]):
            acc = acc + x if op == "+" else acc - x
        return acc

    @property
    def completion(self) -> str:
        """The chain of thought and the answer, exactly as the model is trained to write them."""
        steps = []
        acc = self.operands[0]
        for op, x in zip(self.ops, self.operands[1:]):
            nxt = acc + x if op == "+" else acc - x
            steps.append(f"{acc}{op}{x}={nxt}.")
            acc = nxt
        return f"<think>{' '.join(steps)}</think> {acc}"


def random_problem(rng: random.Random) -> Problem:
    n = rng.randint(MIN_OPERANDS, MAX_OPERANDS)
    operands = tuple(rng.randint(0, MAX_OPERAND) for _ in range(n))
    ops = tuple(rng.choice("+-") for _ in range(n - 1))
    return Problem(operands, ops)


def problems(seed: int, count: int) -> list[Problem]:
    rng = random.Random(seed)
    return [random_problem(rng) for _ in range(count)]


_FINAL = re.compile(r"</think>\s*(-?\d+)\s*$")


def parse_answer(text: str) -> int | None:
    """The final integer after `</think>`, or None when the text has no well-formed answer."""
    m = _FINAL.search(text)
    return int(m.group(1)) if m else None


# ---- the reasoning testbed ------------------------------------------------------------------
# A second bundled model (services/worker/demo/testbed/) trained to show the two redundancies the
# reasoning controls exist for, as real reasoning models do:
#  - it verifies its answer another way before closing its thinking (it recomputes the chain
#    backwards from the answer), so the answer is settled well before the end marker;
#  - sampling makes mistakes: its training chains slip (a step's result off by a little, the rest
#    of the chain carried on from the slip) at SLIP_RATE per step, so its sampling distribution puts
#    that much mass on wrong continuations while the most likely one stays right;
# and it answers from wherever its thinking is cut short (a budget's forced end marker, an early-exit
# probe): with its result, sure of it, once the forward chain has reached it; before that with a guess
# (the last value it reached, give or take GUESS_SPREAD), which it is unsure of, as a reasoning model
# made to answer before it has worked the answer out.
# `37+48-12=` -> `<think>37+48=85. 85-12=73. check 73+12=85. 85-48=37.</think> 73`.

TESTBED_MIN_OPERANDS, TESTBED_MAX_OPERANDS = 3, 7
TESTBED_MAX_VALUE = 560  # every partial result stays a single token (±599) with room for a slip
SLIP_RATE = 0.04  # per step of a training chain
SLIPS = (-10, -2, -1, 1, 2, 10)
FORCED_RATE = 0.25  # training chains cut short by a forced end marker
GUESS_SPREAD = 20  # a guess is the last value reached plus a uniform offset in [-GUESS_SPREAD, GUESS_SPREAD]
CHECK = "check"


def testbed_problem(rng: random.Random, operands: int | None = None) -> Problem:
    """A problem of 3 to 7 operands (or exactly `operands`) whose partial results stay in range."""
    n = operands if operands is not None else rng.randint(TESTBED_MIN_OPERANDS, TESTBED_MAX_OPERANDS)
    while True:
        p = random_problem_of(rng, n)
        if all(abs(v) <= TESTBED_MAX_VALUE for v in partial_results(p)):
            return p


def testbed_problems(seed: int, count: int, operands: int | None = None) -> list[Problem]:
    rng = random.Random(seed)
    return [testbed_problem(rng, operands) for _ in range(count)]


def random_problem_of(rng: random.Random, n: int) -> Problem:
    operands = tuple(rng.randint(0, MAX_OPERAND) for _ in range(n))
    ops = tuple(rng.choice("+-") for _ in range(n - 1))
    return Problem(operands, ops)


def partial_results(p: Problem) -> list[int]:
    acc, out = p.operands[0], [p.operands[0]]
    for op, x in zip(p.ops, p.operands[1:]):
        acc = acc + x if op == "+" else acc - x
        out.append(acc)
    return out


def _slip(rng: random.Random | None, value: int) -> int:
    if rng is None or rng.random() >= SLIP_RATE:
        return value
    return value + rng.choice(SLIPS)


def testbed_thinking(p: Problem, rng: random.Random | None = None) -> tuple[list[str], int]:
    """The thinking as steps (each ending with ". "), forward then the backward check, and the chain's
    result; `rng` makes steps slip at SLIP_RATE, None gives the clean chain greedy decoding should write."""
    steps, acc = [], p.operands[0]
    for op, x in zip(p.ops, p.operands[1:]):
        nxt = _slip(rng, acc + x if op == "+" else acc - x)
        steps.append(f"{acc}{op}{x}={nxt}. ")
        acc = nxt
    result, back = acc, acc
    check = []
    for op, x in reversed(list(zip(p.ops, p.operands[1:]))):
        inv = "-" if op == "+" else "+"
        prev = _slip(rng, back - x if op == "+" else back + x)
        check.append(f"{back}{inv}{x}={prev}. ")
        back = prev
    check[0] = f"{CHECK} {check[0]}"
    return steps + check, result


def testbed_completion(p: Problem, rng: random.Random | None = None, cut: float | None = None,
                       cut_after_step: int | None = None) -> str:
    """What the testbed is trained to write. `cut` in [0, 1] ends the thinking that far through
    (by pieces a token may end at), as a forced end marker would, and answers with the result once the
    forward chain is complete, else with a guess around the last value reached (`rng` draws it).
    `cut_after_step` k ends it right after the k-th step's ".", where early-exit probes look."""
    steps, result = testbed_thinking(p, rng)
    if cut is None and cut_after_step is None:
        return f"<think>{''.join(steps).rstrip()}</think> {result}"
    forward = len(p.ops)
    pieces = [piece for step in steps for piece in _pieces(step)]
    if cut_after_step is not None:
        ends = [i + 1 for i, piece in enumerate(pieces) if piece == "."]
        keep = ends[min(cut_after_step, len(ends)) - 1] if cut_after_step > 0 else 0
    else:
        keep = int(round(cut * len(pieces)))
    text = "".join(pieces[:keep])
    done = pieces[:keep].count(".")  # completed steps
    if done >= forward:
        answer = result
    else:
        guess = _value_after(p, steps, done) + (rng.randint(-GUESS_SPREAD, GUESS_SPREAD) if rng is not None else 0)
        answer = max(-TESTBED_MAX_VALUE, min(TESTBED_MAX_VALUE, guess))
    return f"<think>{text}</think> {answer}"


def _pieces(step: str) -> list[str]:
    """A step cut where a token may end: `85-12=73. ` -> `85`, `-12`, `=`, `73`, `.`, ` `."""
    return re.findall(r"-?\d+|[a-z]|[+=. ]", step)


def _value_after(p: Problem, steps: list[str], done: int) -> int:
    if done == 0:
        return p.operands[0]
    return int(steps[done - 1].rsplit("=", 1)[1].rstrip(". "))
