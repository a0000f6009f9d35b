"""Early exit on answer convergence and adaptive self-consistency: the rules alone, then in the engine
on the demo model (greedy and seeded runs, so every expected token comes from a run of its own)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from cotserve.common.errors import FailedPrecondition, InvalidArgument
from cotserve.common.sampling import (
    EarlyExitParams, ReasoningParams, SelfConsistencyParams, check_self_consistency, reasoning_from_pb,
)
from cotserve.common.v1 import common_pb2
from cotserve.worker.engine import Engine
from cotserve.worker.engine_config import EngineConfig
from cotserve.worker.outputs import RequestOutput
from cotserve.worker.models.loader import load_model
from cotserve.worker.reasoning import Ballot, ReasoningFormat, ThinkingTracker, VoteState, leader_stays_probability, tally
from cotserve.worker.convert import check_budget
from cotserve.worker.sequence import SamplingParams
from cotserve.worker.config import DEMO_MODEL

PROMPT = "12+30-7+5+61-20="
BLOCKS = 128


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_MODEL, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def fmt(demo):
    return ReasoningFormat.for_tokenizer(demo.tokenizer, step=".")


def make_engine(demo, fmt) -> Engine:
    return Engine(demo, EngineConfig(num_blocks=BLOCKS, block_size=16, max_num_seqs=16, max_num_batched_tokens=256,
                                     max_model_len=demo.config.max_context), fmt)


def drain(engine: Engine) -> None:
    engine.drain_inbox(block=False)
    while engine.scheduler.has_work():
        engine.step()
    assert engine.block_manager.num_free_blocks == BLOCKS  # samples, probes and cancelled samples all freed their pages


def run(demo, fmt, rp: ReasoningParams = ReasoningParams(), sp: SamplingParams = SamplingParams(max_new_tokens=64),
        prompt: str = PROMPT) -> list[RequestOutput]:
    engine = make_engine(demo, fmt)
    outs: list[RequestOutput] = []
    engine.submit("r", demo.tokenizer.encode(prompt).ids, sp, outs.append, budget=rp)
    drain(engine)
    assert outs[-1].error is None and outs[-1].is_last
    return outs


def text_of(outs: list[RequestOutput], index: int = 0) -> str:
    return "".join(o.text for o in outs if o.index == index)


# ---- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("build,message", [
    (lambda r: r.early_exit.SetInParent(), "reasoning.early_exit: give exactly one of probe_every_tokens and probe_every_steps"),
    (lambda r: r.early_exit.MergeFrom(common_pb2.EarlyExit(probe_every_tokens=4, probe_every_steps=1)), "give exactly one"),
    (lambda r: r.early_exit.MergeFrom(common_pb2.EarlyExit(probe_every_tokens=0)), "reasoning.early_exit.probe_every_tokens: 0 is out of range (>= 1)"),
    (lambda r: r.early_exit.MergeFrom(common_pb2.EarlyExit(probe_every_steps=0)), "reasoning.early_exit.probe_every_steps: 0 is out of range (>= 1)"),
    (lambda r: r.early_exit.MergeFrom(common_pb2.EarlyExit(probe_every_steps=1, agree=0)), "reasoning.early_exit.agree: 0 is out of range (1..16)"),
    (lambda r: r.early_exit.MergeFrom(common_pb2.EarlyExit(probe_every_steps=1, min_confidence=1.5)), "reasoning.early_exit.min_confidence: 1.5 is out of range"),
    (lambda r: r.early_exit.MergeFrom(common_pb2.EarlyExit(probe_every_steps=1, probe_max_tokens=65)), "reasoning.early_exit.probe_max_tokens: 65 is out of range (1..64)"),
    (lambda r: r.self_consistency.MergeFrom(common_pb2.SelfConsistency(max_samples=65)), "reasoning.self_consistency.max_samples: 65 is out of range (1..64)"),
    (lambda r: r.self_consistency.SetInParent(), "reasoning.self_consistency.max_samples: 0 is out of range (1..64)"),
    (lambda r: r.self_consistency.MergeFrom(common_pb2.SelfConsistency(max_samples=4, min_samples=5)), "reasoning.self_consistency.min_samples: 5 is out of range (1..max_samples = 4)"),
    (lambda r: r.self_consistency.MergeFrom(common_pb2.SelfConsistency(max_samples=4, window=9)), "reasoning.self_consistency.window: 9 is out of range (1..max_samples = 4)"),
    (lambda r: r.self_consistency.MergeFrom(common_pb2.SelfConsistency(max_samples=4, threshold=1.0)), "reasoning.self_consistency.threshold: 1 is out of range ([0.5, 1))"),
    (lambda r: r.self_consistency.MergeFrom(common_pb2.SelfConsistency(max_samples=4, drop_fraction=0.95)), "reasoning.self_consistency.drop_fraction: 0.95 is out of range ([0, 0.9])"),
    (lambda r: setattr(r, "max_thinking_tokens", -1), "reasoning.max_thinking_tokens: -1 is out of range (>= 0)"),
])
def test_bad_options_are_invalid_argument_naming_the_field(build, message):
    ro = common_pb2.ReasoningOptions()
    build(ro)
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        reasoning_from_pb(ro)


def test_defaults_and_self_consistency_preconditions(demo):
    ro = common_pb2.ReasoningOptions(early_exit=common_pb2.EarlyExit(probe_every_steps=1),
                                     self_consistency=common_pb2.SelfConsistency(max_samples=8))
    rp = reasoning_from_pb(ro)
    assert rp.early_exit == EarlyExitParams(probe_every_steps=1, agree=2, probe_max_tokens=16)
    assert rp.self_consistency == SelfConsistencyParams(8, min_samples=3, rule="window", window=3, threshold=0.95)
    with pytest.raises(InvalidArgument, match=re.escape("sampling.temperature: reasoning.self_consistency needs temperature > 0")):
        check_self_consistency(rp, SamplingParams())
    with pytest.raises(InvalidArgument, match=re.escape("sampling.n: 2 with reasoning.self_consistency")):
        check_self_consistency(rp, SamplingParams(temperature=1.0, n=2))
    check_self_consistency(rp, SamplingParams(temperature=1.0))
    with pytest.raises(FailedPrecondition, match="start the worker with --reasoning-start and --reasoning-end"):
        check_budget(rp, None)
    no_steps = ReasoningFormat.for_tokenizer(demo.tokenizer)
    with pytest.raises(FailedPrecondition, match=re.escape("reasoning.early_exit.probe_every_steps: the worker counts no steps; "
                                                           "start it with --reasoning-step")):
        check_budget(rp, no_steps)
    check_budget(ReasoningParams(early_exit=EarlyExitParams(probe_every_tokens=8)), no_steps)


# ---- the rules ----------------------------------------------------------------------------------
def test_probe_points_every_steps_and_every_tokens(demo, fmt):
    ids = demo.tokenizer.encode("<think>1+2=3. 3+4=7. 7+1=8.</think> 8", add_special_tokens=False).ids
    for options, expected in ((EarlyExitParams(probe_every_steps=2), ["1+2=3. 3+4=7."]),
                              (EarlyExitParams(probe_every_steps=1), ["1+2=3.", "1+2=3. 3+4=7.", "1+2=3. 3+4=7. 7+1=8."]),
                              (EarlyExitParams(probe_every_tokens=5), ["1+2=3", "1+2=3. 3+4", "1+2=3. 3+4=7. 7",
                                                                      "1+2=3. 3+4=7. 7+1=8."])):
        tracker = ThinkingTracker(fmt, ReasoningParams(early_exit=options), [0])
        text, points = "", []
        for t in ids:
            piece = demo.tokenizer.decode([t])
            tracker.observe(t, piece)
            text += piece
            if tracker.take_probe_due():
                points.append(text.removeprefix("<think>"))
        assert points == expected, options


def test_convergence_needs_agree_answers_in_a_row_and_the_confidence():
    tracker = ThinkingTracker.__new__(ThinkingTracker)
    tracker.options = ReasoningParams(early_exit=EarlyExitParams(probe_every_steps=1, agree=2, min_confidence=0.8))
    tracker.probe_answers = [("5", 0.99)]
    assert tracker.converged() is None
    tracker.probe_answers += [("6", 0.99), ("6", 0.5)]
    assert tracker.converged() is None  # agree, but mean probability 0.745 < 0.8
    tracker.probe_answers += [("6", 0.99)]
    assert tracker.converged() is None  # ("6", 0.5), ("6", 0.99): mean 0.745 still
    tracker.probe_answers += [("6", 0.9)]
    assert tracker.converged() == "6"
    tracker.probe_answers += [("", 1.0), ("", 1.0)]
    assert tracker.converged() is None  # no answer is never an answer


def test_tally_weights_drops_and_orders():
    ballots = [Ballot("7", 0.9), Ballot("8", 0.2), Ballot("8", 0.3), Ballot("", 1.0), Ballot("7", 0.95), Ballot("9", 0.1)]
    plain = SelfConsistencyParams(8)
    assert [(e.answer, e.count, e.weight) for e in tally(ballots, plain)] == [("7", 2, 2.0), ("8", 2, 2.0), ("9", 1, 1.0), ("", 1, 1.0)]
    weighted = SelfConsistencyParams(8, confidence_weighted=True)
    assert [(e.answer, e.count) for e in tally(ballots, weighted)] == [("7", 2), ("8", 2), ("9", 1), ("", 1)]
    assert tally(ballots, weighted)[0].weight == pytest.approx(1.85)
    dropped = SelfConsistencyParams(8, drop_fraction=0.5)  # the three least confident (0.1, 0.2, 0.3) go
    assert [(e.answer, e.count) for e in tally(ballots, dropped)] == [("7", 2), ("", 1)]


def _leader_stays_numerically(a: int, b: int, remaining: int) -> float:
    """The same probability by integrating over the leader's share p ~ Beta(a + 1, b + 1)."""
    steps, total, norm = 20000, 0.0, 0.0
    for i in range(steps):
        p = (i + 0.5) / steps
        density = p ** a * (1 - p) ** b
        norm += density
        tail = sum(math.comb(remaining, x) * p ** x * (1 - p) ** (remaining - x)
                   for x in range(remaining + 1) if a + x > b + remaining - x)
        total += density * tail
    return total / norm


@pytest.mark.parametrize("a,b,remaining", [(3, 0, 5), (2, 0, 6), (4, 1, 3), (3, 0, 13), (1, 1, 4)])
def test_posterior_rule_is_the_beta_binomial_tail(a, b, remaining):
    assert leader_stays_probability(a, b, remaining) == pytest.approx(_leader_stays_numerically(a, b, remaining), abs=1e-4)


def test_vote_rules_settle_when_they_should():
    window = VoteState(SelfConsistencyParams(8, min_samples=3, window=3))
    for answer, settled in (("7", None), ("7", None), ("8", None), ("7", None), ("7", None), ("7", "window")):
        window.ballots.append(Ballot(answer, 1.0))
        assert window.settled() == settled
    post = VoteState(SelfConsistencyParams(8, min_samples=3, rule="posterior", threshold=0.95))
    for answer, settled in (("7", None), ("7", None), ("7", "posterior")):  # 3-0 with 5 to go: 0.960
        post.ballots.append(Ballot(answer, 1.0))
        assert post.settled() == settled
    capped = VoteState(SelfConsistencyParams(2, min_samples=2))
    capped.ballots += [Ballot("1", 1.0), Ballot("2", 1.0)]
    assert capped.settled() == "max_samples" and capped.answer() == "1"


# ---- early exit in the engine -----------------------------------------------------------------------
def test_probes_never_reach_the_output_and_are_counted(demo, fmt):
    """The demo model's probes at each step answer that step's value, so two in a row never agree: the
    sample runs to its end, token for token the same as without probes, and the probes' tokens are counted."""
    free = run(demo, fmt)
    probed = run(demo, fmt, ReasoningParams(early_exit=EarlyExitParams(probe_every_steps=1, agree=2)))
    assert [o.token_id for o in probed] == [o.token_id for o in free]
    assert text_of(probed) == "<think>12+30=42. 42-7=35. 35+5=40. 40+61=101. 101-20=81.</think> 81"
    assert probed[-1].completion_tokens == free[-1].completion_tokens and free[-1].probe_tokens == 0
    # a probe per step; each forks once its point's token is computed and computes the end marker, " " and a
    # number (then samples end-of-sequence): 3 tokens. The fifth point is the sample's last thinking token,
    # followed by its own end marker: no probe is needed there.
    assert probed[-1].probe_tokens == 4 * 3


def test_probes_share_batches_without_touching_other_requests(demo, fmt):
    engine = make_engine(demo, fmt)
    outs: dict[str, list[RequestOutput]] = {"a": [], "b": []}
    ids = demo.tokenizer.encode(PROMPT).ids
    engine.submit("a", ids, SamplingParams(max_new_tokens=64), outs["a"].append,
                  budget=ReasoningParams(early_exit=EarlyExitParams(probe_every_steps=1)))
    engine.submit("b", ids, SamplingParams(max_new_tokens=64, temperature=1.0, seed=7, n=2), outs["b"].append)
    drain(engine)
    alone = run(demo, fmt, sp=SamplingParams(max_new_tokens=64, temperature=1.0, seed=7, n=2))
    assert [(o.index, o.token_id) for o in outs["b"]] == [(o.index, o.token_id) for o in alone]
    assert text_of(outs["a"]) == text_of(run(demo, fmt))


def test_converged_probes_end_the_thinking_with_their_answer(demo, fmt):
    """Probing every 2 thinking tokens, two probes inside one step agree (the demo model answers the last
    value it wrote): the sample stops thinking there and answers what its probe decoded, which is what a
    thinking budget at that probe point gives."""
    outs = run(demo, fmt, ReasoningParams(early_exit=EarlyExitParams(probe_every_tokens=2, agree=2)))
    last = outs[-1]
    full = text_of(run(demo, fmt))
    reasoning, answer = last.reasoning_text, last.answer_text
    assert full.startswith("<think>" + reasoning) and len(reasoning) < len(full) // 2
    ids = [o.token_id for o in outs]
    thinking = len(ids[ids.index(fmt.start_ids[0]) + 1: ids.index(fmt.end_ids[0])])
    # the probes that agreed forked at two consecutive probe points shortly before the exit (a probe takes
    # a few steps to answer, while the sample goes on thinking): a budget at those points gives that answer
    points = [p for p in range(2, thinking) if p % 2 == 0][-3:]
    forced = {p: run(demo, fmt, ReasoningParams(max_thinking_tokens=p))[-1].answer_text for p in points}
    assert any(forced[p] == forced[p + 2] == answer for p in points[:-1]), forced
    assert text_of(outs).endswith(f"</think> {answer}") and last.finish_reason == "stop"
    assert last.probe_tokens > 0 and last.reasoning_tokens == thinking + 2


# ---- adaptive self-consistency in the engine -----------------------------------------------------------
def answers_of(outs: list[RequestOutput]) -> dict[int, str]:
    return {o.index: o.answer_text for o in outs if o.answer_text is not None}


def test_agreeing_samples_settle_the_window_vote_after_one_round(demo, fmt):
    sp = SamplingParams(max_new_tokens=64, temperature=1.5, seed=4)
    outs = run(demo, fmt, ReasoningParams(self_consistency=SelfConsistencyParams(8, min_samples=3, window=3)), sp)
    vote = outs[-1].vote
    maj8 = answers_of(run(demo, fmt, sp=SamplingParams(max_new_tokens=64, temperature=1.5, seed=4, n=8)))
    assert sorted(maj8.values()) == ["81"] * 8  # this seed's samples all agree
    assert (vote.answer, vote.samples_used, vote.samples_cancelled, vote.stop_reason) == ("81", 3, 0, "window")
    # sample i draws from seed + i, as sample i of n=8 does: the same three samples
    assert answers_of(outs) == {i: maj8[i] for i in range(3)}
    assert outs[-1].completion_tokens == sum(vote.sample_tokens) == 3 * 37


def test_a_split_round_starts_another_and_the_majority_wins(demo, fmt):
    sp = SamplingParams(max_new_tokens=64, temperature=1.5, seed=1)
    outs = run(demo, fmt, ReasoningParams(self_consistency=SelfConsistencyParams(8, min_samples=3, window=3)), sp)
    vote = outs[-1].vote
    n8 = run(demo, fmt, sp=SamplingParams(max_new_tokens=64, temperature=1.5, seed=1, n=8))
    maj8 = answers_of(n8)
    assert [maj8[i] for i in range(6)] == ["81", "81", "39", "81", "81", "81"]
    for i in range(6):  # the second round's samples too draw from seed + i, as sample i of n=8 does
        assert [o.token_id for o in outs if o.index == i] == [o.token_id for o in n8 if o.index == i]
    engine = make_engine(demo, fmt)
    engine.submit("r", demo.tokenizer.encode(PROMPT).ids, sp, lambda o: None,
                  budget=ReasoningParams(self_consistency=SelfConsistencyParams(8, min_samples=3, window=3)))
    engine.drain_inbox(block=False)
    seeds = []
    while engine.scheduler.has_work():
        engine.step()
        if "r" in engine.requests:
            seeds = [s.params.seed for s in engine.requests["r"].samples]
    assert seeds == [1, 2, 3, 4, 5, 6]
    assert (vote.answer, vote.samples_used, vote.stop_reason) == ("81", 6, "window")
    assert [(e.answer, e.count) for e in vote.votes] == [("81", 5), ("39", 1)]


def test_a_settled_vote_cancels_the_unfinished_samples_and_frees_their_pages(demo, fmt):
    """Posterior rule, up to 16: 3-0 after the first round is not enough (0.947), the next round's first
    finished sample settles it (4-0, 0.956) and the round's other two samples are cancelled."""
    sp = SamplingParams(max_new_tokens=64, temperature=1.5, seed=4)
    outs = run(demo, fmt, ReasoningParams(self_consistency=SelfConsistencyParams(16, min_samples=3, rule="posterior")), sp)
    vote = outs[-1].vote
    assert (vote.answer, vote.samples_used, vote.samples_cancelled, vote.stop_reason) == ("81", 4, 2, "posterior")
    cancelled = [o for o in outs if o.finish_reason == "cancelled"]
    assert sorted(o.index for o in cancelled) == [4, 5] and all(o.token_id == -1 for o in cancelled)
    assert outs[-1].is_last and outs[-1].finish_reason == "cancelled"
    assert vote.sample_tokens[:4] == (37, 37, 37, 37) and all(t < 37 for t in vote.sample_tokens[4:])
    # drain() checked it: every page of the cancelled samples is back in the pool


def test_early_exit_inside_a_vote(demo, fmt):
    sp = SamplingParams(max_new_tokens=64, temperature=1.5, seed=4)
    rp = ReasoningParams(self_consistency=SelfConsistencyParams(8, min_samples=3, window=3),
                         early_exit=EarlyExitParams(probe_every_tokens=2, agree=2))
    outs = run(demo, fmt, rp, sp)
    vote = outs[-1].vote
    assert vote.samples_used >= 3 and outs[-1].probe_tokens > 0
    assert all(t < 37 for t in vote.sample_tokens)  # every sample exited early


def test_stats_and_prometheus_count_reasoning_probes_exits_and_votes(demo, fmt):
    from prometheus_client import generate_latest

    from cotserve.worker.metrics import worker_registry

    engine = make_engine(demo, fmt)
    outs: dict[str, list[RequestOutput]] = {"free": [], "exit": [], "vote": []}
    ids = demo.tokenizer.encode(PROMPT).ids
    engine.submit("free", ids, SamplingParams(max_new_tokens=64), outs["free"].append, budget=ReasoningParams())
    drain(engine)  # one sample that ends its thinking on its own: the yardstick for tokens saved
    engine.submit("exit", ids, SamplingParams(max_new_tokens=64), outs["exit"].append,
                  budget=ReasoningParams(early_exit=EarlyExitParams(probe_every_tokens=2)))
    engine.submit("vote", ids, SamplingParams(max_new_tokens=64, temperature=1.5, seed=4), outs["vote"].append,
                  budget=ReasoningParams(self_consistency=SelfConsistencyParams(16, rule="posterior")))
    drain(engine)
    s = engine.stats()
    exited = outs["exit"][-1].reasoning_tokens
    assert exited < 34
    assert s.num_reasoning_tokens_total == sum(o[-1].reasoning_tokens for o in outs.values()) == 34 + exited + 6 * 34  # the cancelled two had thought through
    assert s.num_probe_tokens_total == outs["exit"][-1].probe_tokens > 0
    # free thinks 32 tokens (34 with its markers): the exit saved the difference
    assert s.num_early_exits_total == 1 and s.num_thinking_tokens_saved_total == 32 - (exited - 2)
    assert (s.num_vote_samples_used_total, s.num_vote_samples_saved_total) == (4, 12)
    # per request, as the worker's span reports them
    assert (outs["exit"][-1].early_exits, outs["free"][-1].early_exits, outs["vote"][-1].vote.samples_saved) == (1, 0, 12)
    text = generate_latest(worker_registry(engine.stats, "demo", BLOCKS)).decode()
    for line in ('cotserve_worker_early_exits_total{model="demo"} 1.0', 'cotserve_worker_vote_samples_used_total{model="demo"} 4.0',
                 'cotserve_worker_vote_samples_saved_total{model="demo"} 12.0',
                 f'cotserve_worker_probe_tokens_total{{model="demo"}} {float(s.num_probe_tokens_total)}',
                 f'cotserve_worker_thinking_tokens_saved_total{{model="demo"}} {float(32 - (exited - 2))}'):
        assert line in text


def test_probes_under_memory_pressure_are_dropped_not_recomputed(demo, fmt):
    """A pool too small for every sample and its probes: samples get preempted and recomputed, probes
    get skipped or dropped, and every output is still the one it is without probes."""
    engine = Engine(demo, EngineConfig(num_blocks=5, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                                       max_model_len=demo.config.max_context), fmt)
    prompts = ["12+30-7+5+61-20=", "37+48-12=", "5+5+5+5+5+5=", "99-98+97-96="]
    outs: dict[str, list[RequestOutput]] = {p: [] for p in prompts}
    for p in prompts:
        engine.submit(p, demo.tokenizer.encode(p).ids, SamplingParams(max_new_tokens=64), outs[p].append,
                      budget=ReasoningParams(early_exit=EarlyExitParams(probe_every_steps=1)))
    engine.drain_inbox(block=False)
    while engine.scheduler.has_work():
        engine.step()
    assert engine.block_manager.num_free_blocks == 5 and engine.scheduler.num_preemptions_total > 0
    for p in prompts:
        assert text_of(outs[p]) == text_of(run(demo, fmt, prompt=p)), p
    assert any(outs[p][-1].probe_tokens for p in prompts)  # probes did run where there was room
