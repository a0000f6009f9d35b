"""Reasoning output and thinking budgets through a real gateway and worker, via the SDK and the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cotserve.sdk import Client, FailedPrecondition, InvalidArgument, Reasoning


@pytest.fixture
def client(demo_gateway):
    with Client(demo_gateway, timeout_s=60) as c:
        yield c


def test_reasoning_and_answer_come_apart(client):
    r = client.generate("37+48-12=", max_new_tokens=64)
    assert r.text == "<think>37+48=85. 85-12=73.</think> 73"
    assert (r.reasoning_text, r.answer_text) == ("37+48=85. 85-12=73.", "73")
    assert (r.choices[0].reasoning_text, r.choices[0].answer_text) == ("37+48=85. 85-12=73.", "73")
    assert r.usage.reasoning_tokens == 14 == r.token_ids.index(1450) + 1  # <think>, 12 thinking tokens, </think>
    chunks = list(client.stream("37+48-12=", max_new_tokens=64))
    parts = [c.part for c in chunks]
    assert parts == ["reasoning"] * 14 + ["answer"] * (len(chunks) - 14)
    assert "".join(c.text for c in chunks if c.part == "reasoning") == "<think>37+48=85. 85-12=73.</think>"
    assert (chunks[-1].reasoning_text, chunks[-1].answer_text) == ("37+48=85. 85-12=73.", "73")


def test_a_thinking_budget_through_the_gateway(client):
    r = client.generate("12+30-7+5+61-20=", max_new_tokens=64, reasoning=Reasoning(max_thinking_tokens=5))
    assert (r.text, r.reasoning_text, r.answer_text) == ("<think>12+30=42</think> 42", "12+30=42", "42")
    assert r.usage.reasoning_tokens == 7


@pytest.mark.parametrize("budget,message", [
    (Reasoning(max_thinking_tokens=-1), "reasoning.max_thinking_tokens: -1 is out of range (>= 0)"),
    (Reasoning(min_thinking_tokens=9, max_thinking_tokens=4), "reasoning.min_thinking_tokens: 9 is above max_thinking_tokens (4)"),
    (Reasoning(forcing_text=""), "reasoning.forcing_text: 0 characters, allowed 1..256"),
])
def test_bad_budgets_name_the_field(client, budget, message):
    with pytest.raises(InvalidArgument) as err:
        client.generate("1+1=", reasoning=budget)
    assert err.value.message == message


def test_a_step_budget_on_a_worker_that_counts_no_steps_names_the_flag(client):
    with pytest.raises(FailedPrecondition, match="reasoning.max_thinking_steps: the worker counts no steps; start it with --reasoning-step"):
        client.generate("1+1=", reasoning=Reasoning(max_thinking_steps=2))


def test_cli_budget(demo_gateway):
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "generate", "12+30-7+5+61-20=", "--address", demo_gateway,
                          "--max-thinking-tokens", "5"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text, timing = out.stdout.strip().splitlines()
    assert text == "<think>12+30=42</think> 42" and "(7 reasoning)" in timing
