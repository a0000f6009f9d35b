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
