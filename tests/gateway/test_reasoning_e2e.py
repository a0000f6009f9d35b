"""Reasoning output and thinking budgets through a real gateway and worker, via the SDK and the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cotserve.sdk import Client, EarlyExit, FailedPrecondition, InvalidArgument, Reasoning, SelfConsistency


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
    parts = [c.part for c in chunks for _ in c.token_ids]  # per token (a chunk holds one or more of one part)
    assert parts == ["reasoning"] * 14 + ["answer"] * (len(parts) - 14)
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


def test_early_exit_through_the_gateway(client):
    r = client.generate("12+30-7+5+61-20=", max_new_tokens=64,
                        reasoning=Reasoning(early_exit=EarlyExit(probe_every_tokens=2, agree=2)))
    # the demo model's probes agree inside the third step (see tests/worker/test_early_exit_and_votes.py)
    assert (r.text, r.answer_text, r.finish_reason) == ("<think>12+30=42. 42-7=35. 35+5=40</think> 35", "35", "stop")
    assert r.usage.reasoning_tokens == 20 and r.usage.completion_tokens == len(r.token_ids) == 22
    assert r.usage.probe_tokens > 0


def test_adaptive_self_consistency_through_the_gateway(client):
    vote_opts = Reasoning(self_consistency=SelfConsistency(16, min_samples=3, rule="posterior"))
    r = client.generate("12+30-7+5+61-20=", max_new_tokens=64, temperature=1.5, seed=4, reasoning=vote_opts)
    v = r.self_consistency
    assert (v.answer, v.samples_used, v.samples_cancelled, v.stop_reason) == ("81", 4, 2, "posterior")
    assert [(e.answer, e.count, e.weight) for e in v.votes] == [("81", 4, 4.0)]
    assert r.answer_text == "81" and len(r.choices) == 6
    assert [c.finish_reason for c in r.choices] == ["stop"] * 4 + ["cancelled"] * 2
    assert all(c.answer_text == "81" for c in r.choices[:4])
    assert list(v.sample_tokens) == [len(c.token_ids) for c in r.choices[:4]] + list(v.sample_tokens[4:])
    assert r.usage.completion_tokens == sum(v.sample_tokens)
    chunks = list(client.stream("12+30-7+5+61-20=", max_new_tokens=64, temperature=1.5, seed=4, reasoning=vote_opts))
    assert chunks[-1].self_consistency == v and chunks[-1].usage is not None
    assert sorted(c.index for c in chunks if c.finish_reason == "cancelled") == [4, 5]


@pytest.mark.parametrize("kwargs,message", [
    (dict(reasoning=Reasoning(self_consistency=SelfConsistency(8))),
     "sampling.temperature: reasoning.self_consistency needs temperature > 0 (greedy samples would all be the same)"),
    (dict(temperature=1.0, n=2, reasoning=Reasoning(self_consistency=SelfConsistency(8))),
     "sampling.n: 2 with reasoning.self_consistency, which draws its own samples; leave n unset (or 1)"),
    (dict(temperature=1.0, reasoning=Reasoning(self_consistency=SelfConsistency(65))),
     "reasoning.self_consistency.max_samples: 65 is out of range (1..64)"),
    (dict(temperature=1.0, reasoning=Reasoning(self_consistency=SelfConsistency(4, min_samples=5))),
     "reasoning.self_consistency.min_samples: 5 is out of range (1..max_samples = 4)"),
    (dict(reasoning=Reasoning(early_exit=EarlyExit(probe_every_tokens=0))),
     "reasoning.early_exit.probe_every_tokens: 0 is out of range (>= 1)"),
    (dict(reasoning=Reasoning(early_exit=EarlyExit(probe_every_tokens=4, agree=0))),
     "reasoning.early_exit.agree: 0 is out of range (1..16)"),
])
def test_bad_reasoning_options_name_the_field(client, kwargs, message):
    with pytest.raises(InvalidArgument) as err:
        client.generate("1+1=", **kwargs)
    assert err.value.message == message


def test_step_probes_on_a_worker_that_counts_no_steps_name_the_flag(client):
    with pytest.raises(FailedPrecondition, match="reasoning.early_exit.probe_every_steps: the worker counts no steps"):
        client.generate("1+1=", reasoning=Reasoning(early_exit=EarlyExit(probe_every_steps=1)))


def test_cli_early_exit_and_self_consistency(demo_gateway):
    cli = [sys.executable, "-m", "cotserve.cli", "generate", "12+30-7+5+61-20=", "--address", demo_gateway]
    out = subprocess.run([*cli, "--early-exit", "--probe-every-tokens", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text, timing = out.stdout.strip().splitlines()
    assert text == "<think>12+30=42. 42-7=35. 35+5=40</think> 35" and "(20 reasoning) + " in timing and " probe tokens |" in timing
    out = subprocess.run([*cli, "--self-consistency", "16", "--vote-rule", "posterior", "--temperature", "1.5", "--seed", "4"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[:4] == [f"[{i}] <think>12+30=42. 42-7=35. 35+5=40. 40+61=101. 101-20=81.</think> 81 (stop)" for i in range(4)]
    # the cancelled samples show what they had written (their last token never came)
    assert [line.split(" ", 1)[0] for line in lines[4:6]] == ["[4]", "[5]"]
    assert all(line.startswith(f"{line[:3]} <think>12+30=42.") and line.endswith(" (cancelled)") for line in lines[4:6])
    assert lines[6] == "vote: 81 (81 x4; 4 samples used, 2 cancelled, stopped by posterior)"
    bad = subprocess.run([*cli, "--agree", "2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "need --early-exit" in bad.stderr
