"""The sampler alone, on hand-made logits: greedy, bans, top-k and top-p bounds, per-request seeds independent of the
batch, logprobs of the distribution actually sampled from."""

from __future__ import annotations

import math

import pytest
import torch

from cotserve.common.sampling import SamplingParams
from cotserve.worker.sampler import Sampler

CPU = torch.device("cpu")


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_takes_the_argmax_and_a_banned_token_is_never_sampled():
    s = Sampler(CPU)
    x = logits([0.0, 3.0, 1.0], [2.0, 0.0, 1.0])
    assert s.sample(x, [1, 2], [SamplingParams()] * 2).token_ids == [1, 0]
    got = s.sample(x, [1, 2], [SamplingParams()] * 2, banned=[1, None])
    assert got.token_ids == [2, 0]  # row 0's best is banned: the next best; row 1 untouched
    hot = SamplingParams(temperature=1.5, seed=3)
    assert all(s.sample(logits([0.0, 5.0, 0.0]), [9], [hot], banned=[1]).token_ids[0] != 1 for _ in range(50))


def test_top_k_and_top_p_keep_only_their_tokens():
    s = Sampler(CPU, seed=1)
    x = logits([4.0, 3.0, 2.0, 1.0, 0.0])
    k2 = SamplingParams(temperature=2.0, top_k=2)
    assert {s.sample(x, [1], [k2]).token_ids[0] for _ in range(200)} == {0, 1}
    # softmax of x: 0.64, 0.24, 0.09, ...: p = 0.7 keeps the first two (0.64 < 0.7 <= 0.88)
    p7 = SamplingParams(temperature=1.0, top_p=0.7)
    assert {s.sample(x, [1], [p7]).token_ids[0] for _ in range(200)} == {0, 1}
    tiny = SamplingParams(temperature=1.0, top_p=0.01)  # the first token always stays
    assert {s.sample(x, [1], [tiny]).token_ids[0] for _ in range(20)} == {0}


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch():
    seeded = SamplingParams(temperature=1.0, seed=42)
    x = logits([1.0, 1.0, 1.0, 1.0])
    alone = Sampler(CPU)
    a = [alone.sample(x, [7], [seeded]).token_ids[0] for _ in range(20)]
    crowded = Sampler(CPU, seed=5)
    batch = logits([0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0], [3.0, 2.0, 1.0, 0.0])
    others = SamplingParams(temperature=1.0)
    b = [crowded.sample(batch, [3, 7, 4], [others, seeded, SamplingParams(temperature=1.0, seed=1)]).token_ids[1]
         for _ in range(20)]
    assert a == b and len(set(a)) > 1  # the same draws, and they are draws
    alone.forget(7)  # forgotten: the next draw starts the seed's sequence again
    assert alone.sample(x, [7], [seeded]).token_ids[0] == a[0]


def test_logprobs_are_of_the_sampled_distribution_and_top_logprobs_come_most_likely_first():
    s = Sampler(CPU)
    x = logits([2.0, 1.0, 0.0])
    greedy = s.sample(x, [1], [SamplingParams(logprobs=True, top_logprobs=2)])
    want = 2.0 - math.log(math.exp(2) + math.exp(1) + 1)
    assert greedy.token_ids == [0] and greedy.logprobs[0] == pytest.approx(want, abs=1e-6)
    (ids, lps), = greedy.top
    assert ids == (0, 1) and lps[0] == pytest.approx(want, abs=1e-6) and lps[0] > lps[1]
    hot = s.sample(x, [1], [SamplingParams(temperature=2.0, top_k=1, logprobs=True, seed=0)])
    assert hot.token_ids == [0] and hot.logprobs[0] == pytest.approx(0.0, abs=1e-6)  # top-1: certain once filtered
    none = s.sample(x, [1], [SamplingParams()])
    assert none.logprobs == [None] and none.top is None
    asked = s.sample(x, [1], [SamplingParams()], want_logprobs=[True])  # a probe or a vote asks without the client
    assert asked.logprobs[0] == pytest.approx(want, abs=1e-6)


def reference_penalized(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Penalties and bias one token at a time, as OpenAI and vLLM define them (the sampler does the rows together)."""
    from collections import Counter

    row = row.clone()
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t, count in Counter(output).items():
        row[t] -= p.frequency_penalty * count + p.presence_penalty
    for t, bias in p.logit_bias:
        row[t] += bias
    return row


def test_penalties_and_logit_bias_match_a_reference_computation_row_by_row():
    torch.manual_seed(0)
    x = torch.randn(4, 40) * 3
    history = [([1, 2, 3], [5, 5, 7, 9]), ([4], [4, 4, 4, 10]), ([0, 11], [11, 12]), ([], [])]
    params = [SamplingParams(logprobs=True, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3),
              SamplingParams(logprobs=True, frequency_penalty=-2.0, logit_bias=((3, 5.0), (4, -100.0))),
              SamplingParams(logprobs=True, repetition_penalty=0.7, presence_penalty=-1.0),
              SamplingParams(logprobs=True)]
    got = Sampler(CPU).sample(x, [1, 2, 3, 4], params, history=history)
    for r, (p, (prompt, output)) in enumerate(zip(params, history)):
        expected = reference_penalized(x[r], p, prompt if p.repetition_penalty != 1.0 else [], output)
        assert got.token_ids[r] == int(expected.argmax())
        assert got.logprobs[r] == pytest.approx(float(torch.log_softmax(expected, -1)[got.token_ids[r]]), abs=1e-5)
    assert got.token_ids[1] != 4  # -100: as good as banned
    assert got.token_ids[3] == int(x[3].argmax())  # a row without any: untouched


def test_min_p_keeps_only_tokens_near_the_likeliest():
    s = Sampler(CPU)
    x = logits([2.0, 2.0 - math.log(2), 2.0 - math.log(4), 0.0])  # probabilities 1 : 1/2 : 1/4 : small
    p = SamplingParams(temperature=1.0, seed=1, min_p=0.4, logprobs=True)
    drawn = {s.sample(x, [7], [p]).token_ids[0] for _ in range(200)}
    assert drawn == {0, 1}  # 1/4 and less are below 0.4 x the likeliest
    got = s.sample(x, [8], [SamplingParams(temperature=1.0, seed=2, min_p=0.4, logprobs=True)])
    assert got.logprobs[0] == pytest.approx(math.log((1 if got.token_ids[0] == 0 else 0.5) / 1.5), abs=1e-5)
