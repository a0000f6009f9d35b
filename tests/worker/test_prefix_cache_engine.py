"""Prefix cache and parallel samples on real model code: logits with and without the cache,
n samples against n separate requests, the prompt computed once, cancel and preemption."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from cotserve.worker.block_manager import cache_root
from cotserve.worker.engine import Engine
from cotserve.worker.engine_config import EngineConfig
from cotserve.worker.outputs import RequestOutput
from cotserve.worker.models.loader import load_model
from cotserve.worker.sequence import SamplingParams, Sequence
from cotserve.worker.config import DEMO_MODEL

BS = 16


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_MODEL, device=torch.device("cpu"))


def make_engine(loaded, caching=True, kv_cache_dtype="fp32", num_blocks=128, max_num_seqs=32, budget=512,
                topk_pages=0) -> Engine:
    return Engine(loaded, EngineConfig(num_blocks=num_blocks, block_size=BS, max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=budget, max_model_len=loaded.config.max_context,
                                       kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=caching, kv_topk_pages=topk_pages))


def teacher_forced(engine: Engine, prompt: list[int], forced: list[int]) -> tuple[torch.Tensor, Sequence]:
    """Logits after the prompt and after each forced token, through the engine's own scheduler
    and runner (the prompt's cached blocks are taken as the engine would take them)."""
    seq = Sequence(f"tf{random.random()}", list(prompt), SamplingParams(max_new_tokens=len(forced) + 1))
    seq.cache_root = cache_root("test")
    engine.scheduler.add(seq)
    rows = []
    while len(rows) <= len(forced):
        batch = engine.scheduler.schedule()
        logits = engine.runner.execute(batch)
        samples = batch.items[-1].samples  # (read before advance moves num_computed_tokens)
        engine.scheduler.advance(batch)
        if samples:
            rows.append(logits[-1])
            if len(rows) <= len(forced):
                seq.output_ids.append(forced[len(rows) - 1])
    engine.scheduler.finish(seq, seq.status.FINISHED_LENGTH)
    return torch.stack(rows), seq


rng = random.Random(5)
WARM = [rng.randrange(3, 1400) for _ in range(40)]  # blocks: 2 full (32 tokens) + 8 tokens
FRESH = [rng.randrange(3, 1400) for _ in range(40)]
FORCED = [rng.randrange(3, 1400) for _ in range(6)]
CASES = {  # prompt, tokens expected from the cache
    "no block": (FRESH, 0),
    "one block": (WARM[:16] + FRESH[:20], 16),
    "a partial block": (WARM[:24] + FRESH[:12], 16),  # the shared part ends inside block 2: only block 1 is reused
    "all blocks": (WARM, 32),
    "all blocks, exact multiple": (WARM[:32], 16),  # the block holding the last token is always computed
}


@pytest.mark.parametrize("kv,topk", [("fp32", 0), ("fp8_e4m3", 0), ("fp8_e4m3", 2)], ids=["fp32", "fp8", "fp8-top2"])
@pytest.mark.parametrize("case", list(CASES))
def test_teacher_forced_logits_equal_with_and_without_the_cache(demo, kv, topk, case):
    """Cached blocks carry everything a page is (payload, FP8 scales, top-k page bounds): the
    logits match a run that computes every token (bit-identical on this machine)."""
    prompt, cached = CASES[case]
    with_cache = make_engine(demo, caching=True, kv_cache_dtype=kv, topk_pages=topk)
    teacher_forced(with_cache, WARM, FORCED)  # leaves WARM's full blocks in the cache
    got, seq = teacher_forced(with_cache, prompt, FORCED)
    want, plain_seq = teacher_forced(make_engine(demo, caching=False, kv_cache_dtype=kv, topk_pages=topk), prompt, FORCED)
    assert seq.num_cached_tokens == cached and plain_seq.num_cached_tokens == 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    bm = with_cache.block_manager
    assert bm.num_free_blocks == bm.num_blocks


class Collector:
    """Outputs per (request, sample index), from a synchronously driven engine."""

    def __init__(self) -> None:
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.finish: dict[tuple[str, int], str] = {}
        self.last: dict[str, RequestOutput] = {}

    def sink(self, out: RequestOutput) -> None:
        assert out.error is None, out.error
        key = (out.request_id, out.index)
        self.tokens.setdefault(key, []).append(out.token_id)
        if out.finish_reason:
            self.finish[key] = out.finish_reason
        if out.is_last:
            self.last[out.request_id] = out


def drive(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]], abort_after: int | None = None) -> Collector:
    got = Collector()
    for rid, prompt, params in requests:
        engine.submit(rid, prompt, params, got.sink)
    engine.drain_inbox(block=False)
    steps = 0
    while engine.scheduler.has_work():
        engine.step()
        steps += 1
        if abort_after is not None and steps == abort_after:
            for rid, _, _ in requests:
                engine.abort(rid)
        engine.drain_inbox(block=False)
        assert steps < 5000
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    return got


PROMPT = [rng.randrange(3, 1400) for _ in range(37)]  # 2 full blocks + 5 tokens: the partial block is shared by the samples
SAMPLED = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7, ignore_eos=True)


def test_n_seeded_samples_equal_n_separate_requests_and_the_prompt_is_computed_once(demo):
    n = 4
    group_engine = make_engine(demo)
    group = drive(group_engine, [("g", PROMPT, dataclasses.replace(SAMPLED, n=n))])
    alone = [drive(make_engine(demo), [("s", PROMPT, dataclasses.replace(SAMPLED, seed=7 + i))]).tokens[("s", 0)]
             for i in range(n)]
    assert [group.tokens[("g", i)] for i in range(n)] == alone
    assert len({tuple(t) for t in alone}) == n  # four different samples, not one repeated
    stats = group_engine.stats()
    assert stats.num_prompt_tokens_computed_total == len(PROMPT)  # prefilled once for all four
    last = group.last["g"]
    assert last.prompt_tokens == len(PROMPT) and last.completion_tokens == n * 24
    assert sorted(group.finish) == [("g", i) for i in range(n)] and set(group.finish.values()) == {"length"}
    # peak KV: the prompt's blocks once, each sample's own blocks, at most one copied block each
    generated_blocks = -(-(len(PROMPT) + 24) // BS) - len(PROMPT) // BS
    assert stats.kv_blocks_used_peak <= len(PROMPT) // BS + n * generated_blocks + n


def test_n_1_is_unchanged_and_greedy_samples_agree(demo):
    one = drive(make_engine(demo), [("r", PROMPT, dataclasses.replace(SAMPLED, n=1))])
    assert one.tokens[("r", 0)] == drive(make_engine(demo), [("r", PROMPT, SAMPLED)]).tokens[("r", 0)]
    greedy = drive(make_engine(demo), [("g", PROMPT, SamplingParams(max_new_tokens=8, n=3))])
    assert greedy.tokens[("g", 0)] == greedy.tokens[("g", 1)] == greedy.tokens[("g", 2)]


def test_cancelling_a_group_ends_every_sample_and_frees_its_blocks(demo):
    engine = make_engine(demo)
    got = drive(engine, [("g", PROMPT, dataclasses.replace(SAMPLED, n=5, max_new_tokens=200))], abort_after=4)
    assert {i for (_, i) in got.tokens} == {0, 1, 2, 3, 4}  # all five had started
    assert not got.finish and "g" not in got.last and not engine.requests


def test_samples_preempted_by_a_small_pool_still_equal_separate_requests(demo):
    n = 4
    params = dataclasses.replace(SAMPLED, n=n, max_new_tokens=40)
    engine = make_engine(demo, num_blocks=12)  # 4 samples x 5 blocks do not fit: some are preempted and recomputed
    group = drive(engine, [("g", PROMPT, params)])
    assert engine.stats().num_preemptions_total > 0
    alone = [drive(make_engine(demo), [("s", PROMPT, dataclasses.replace(params, n=1, seed=7 + i))]).tokens[("s", 0)]
             for i in range(n)]
    assert [group.tokens[("g", i)] for i in range(n)] == alone


def test_a_repeated_prompt_reports_its_cached_tokens(demo):
    engine = make_engine(demo)
    first = drive(engine, [("a", PROMPT, SamplingParams(max_new_tokens=4))])
    second = drive(engine, [("b", PROMPT, SamplingParams(max_new_tokens=4))])
    assert first.last["a"].cached_prompt_tokens == 0 and second.last["b"].cached_prompt_tokens == 32
    assert first.tokens[("a", 0)] == second.tokens[("b", 0)]
    s = engine.stats()
    assert s.num_prompt_tokens_computed_total == len(PROMPT) + len(PROMPT) - 32
    assert s.prefix_cache_hit_tokens == 32 and s.prefix_cache_queried_tokens == 2 * len(PROMPT)


def test_n_above_the_batch_is_rejected(demo):
    engine = make_engine(demo, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"sampling.n: 5 samples, this worker batches at most 4"):
        engine.submit("x", PROMPT, SamplingParams(n=5), lambda out: None)
