"""Engine behaviour on real model code: batch invariance, seeds, stops, preemption, cancel, errors."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from cotserve.demo.arithmetic import problems
from cotserve.worker.engine import Engine
from cotserve.worker.engine_config import EngineConfig
from cotserve.worker.outputs import RequestOutput
from cotserve.worker.models.loader import load_model
from cotserve.worker.sampler import Sampler
from cotserve.worker.sequence import SamplingParams
from cotserve.worker.config import DEMO_MODEL
from tests.worker.engine_helpers import run_engine


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_MODEL)


def make_engine(loaded, num_blocks=256, block_size=16, max_num_seqs=32, budget=512) -> Engine:
    return Engine(loaded, EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=budget, max_model_len=loaded.config.max_context))


def encode(loaded, text):
    return loaded.tokenizer.encode(text).ids


def test_batch_invariance_8_prompts_together_equal_each_alone(demo):
    prompts = [encode(demo, p.prompt) for p in problems(7, 8)]
    params = SamplingParams(max_new_tokens=48)
    together = run_engine(make_engine(demo), prompts, params)
    alone = [run_engine(make_engine(demo), [p], params)[0] for p in prompts]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert len({tuple(r.token_ids) for r in together}) == 8  # 8 different answers, not one repeated


def test_demo_answers_and_stops_at_eos(demo):
    p = problems(11, 1)[0]
    (out,) = run_engine(make_engine(demo), [encode(demo, "37+48-12=")], SamplingParams(max_new_tokens=64))
    assert out.text == "<think>37+48=85. 85-12=73.</think> 73"
    assert out.finish_reason == "stop" and out.token_ids[-1] in demo.eos_token_ids
    assert out.last.prompt_tokens == len(encode(demo, "37+48-12=")) and out.last.completion_tokens == len(out.token_ids)
    assert out.last.timing.ttft_ms <= out.last.timing.total_ms
    del p


def test_same_seed_same_output_whatever_else_is_in_the_batch(demo):
    seeded = SamplingParams(max_new_tokens=24, temperature=1.5, seed=1234, ignore_eos=True)
    other = SamplingParams(max_new_tokens=24, temperature=1.5, ignore_eos=True)
    prompt = encode(demo, "5+5+5=")
    alone = run_engine(make_engine(demo), [prompt], seeded)[0].token_ids
    crowd = run_engine(make_engine(demo), [encode(demo, "9-3="), prompt, encode(demo, "1+1+1+1=")],
                       [other, seeded, other])[1].token_ids
    assert alone == crowd
    different = run_engine(make_engine(demo), [prompt], SamplingParams(max_new_tokens=24, temperature=1.5, seed=99,
                                                                       ignore_eos=True))[0].token_ids
    assert different != alone


def test_stop_string_is_not_in_the_text(demo):
    (out,) = run_engine(make_engine(demo), [encode(demo, "37+48-12=")], SamplingParams(max_new_tokens=64, stop=("</think>",)))
    assert out.text == "<think>37+48=85. 85-12=73."
    assert out.finish_reason == "stop"


def test_stop_token_id_and_max_new_tokens(demo):
    dot = demo.tokenizer.token_to_id(".")
    (out,) = run_engine(make_engine(demo), [encode(demo, "37+48-12=")], SamplingParams(max_new_tokens=64, stop_token_ids=(dot,)))
    assert out.text == "<think>37+48=85" and out.finish_reason == "stop" and out.token_ids[-1] == dot
    (out,) = run_engine(make_engine(demo), [encode(demo, "37+48-12=")], SamplingParams(max_new_tokens=3))
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_logprobs_are_log_softmax_of_the_chosen_token(demo):
    (out,) = run_engine(make_engine(demo), [encode(demo, "37+48-12=")], SamplingParams(max_new_tokens=4, logprobs=True))
    assert all(lp is not None and lp <= 0.0 for lp in out.logprobs)
    assert out.logprobs[0] > -0.1  # a trained model is sure of `<think>`


def test_preemption_under_a_tiny_kv_pool_gives_the_same_outputs(demo):
    prompts = [encode(demo, p.prompt) for p in problems(21, 6)]
    params = SamplingParams(max_new_tokens=40)
    roomy = run_engine(make_engine(demo), prompts, params)
    tight = make_engine(demo, num_blocks=16, block_size=4)  # 64 token slots for 6 sequences of up to 53 tokens
    squeezed = run_engine(tight, prompts, params)
    assert tight.scheduler.num_preemptions_total > 0
    assert [r.token_ids for r in squeezed] == [r.token_ids for r in roomy]
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


def test_cancel_frees_blocks_at_the_next_step(demo):
    engine = make_engine(demo)
    got: list[RequestOutput] = []
    engine.submit("a", encode(demo, "1+2+3="), SamplingParams(max_new_tokens=200, ignore_eos=True), got.append)
    engine.drain_inbox(block=False)
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort("a")
    engine.drain_inbox(block=False)
    assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.has_work()
    assert len(got) == 5


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(demo):
    engine = make_engine(demo)
    real = engine.runner.execute
    engine.runner.execute = lambda batch: (_ for _ in ()).throw(RuntimeError("boom"))
    (failed,) = run_engine(engine, [encode(demo, "1+1=")], SamplingParams(max_new_tokens=8))
    assert failed.error == "engine step failed: boom"
    assert engine.block_manager.num_used_blocks == 0
    engine.runner.execute = real
    (ok,) = run_engine(engine, [encode(demo, "1+1=")], SamplingParams(max_new_tokens=16))
    assert ok.text.endswith("</think> 2")


def test_engine_thread_serves_concurrent_submitters(demo):
    engine = make_engine(demo)
    engine.start()
    try:
        done = {i: threading.Event() for i in range(4)}
        texts = {i: "" for i in range(4)}

        def sink_for(i):
            def sink(out):
                texts[i] += out.text
                if out.finish_reason or out.error:
                    done[i].set()
            return sink

        for i, p in enumerate(problems(5, 4)):
            engine.submit(f"t{i}", encode(demo, p.prompt), SamplingParams(max_new_tokens=64), sink_for(i))
        assert all(e.wait(30) for e in done.values())
        assert all(t.startswith("<think>") for t in texts.values())
        assert engine.stats().num_requests_finished_total == 4
    finally:
        engine.stop()


def test_prompt_that_can_never_fit_is_refused_at_submit(demo):
    engine = make_engine(demo, num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"prompt_tokens \+ max_new_tokens = 21 exceeds the KV cache \(8 tokens\)"):
        engine.submit("x", [0] * 5, SamplingParams(max_new_tokens=16), lambda out: None)


def test_top_k_and_top_p_only_sample_allowed_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    s = Sampler(torch.device("cpu"))
    picks_k = {s.sample(logits, [1], [SamplingParams(temperature=1.0, top_k=2)]).token_ids[0] for _ in range(200)}
    assert picks_k == {0, 1}
    probs = torch.softmax(logits[0], 0)  # [0.57, 0.21, 0.13, 0.08, 0.03]: top_p=0.7 keeps tokens 0 and 1
    assert probs[0] < 0.7 < probs[0] + probs[1]
    picks_p = {s.sample(logits, [1], [SamplingParams(temperature=1.0, top_p=0.7)]).token_ids[0] for _ in range(200)}
    assert picks_p == {0, 1}


def _one_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    """The sampler's rule for one row, spelled out: greedy, or temperature then top-k (ties with the k-th
    kept) then top-p (the smallest prefix reaching the mass), a draw from the row's generator; the logprob
    under the distribution it drew from."""
    if p.is_greedy:
        token = int(logits.argmax())
        return token, float(torch.log_softmax(logits, -1)[token])
    x = logits / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        s, order = torch.sort(x, descending=True)
        probs = torch.softmax(s, -1)
        s = s.masked_fill(probs.cumsum(-1) - probs >= p.top_p, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, s)
    token = int(torch.multinomial(torch.softmax(x, -1), 1, generator=gen))
    return token, float(torch.log_softmax(x, -1)[token])


def test_the_batch_sampler_gives_each_seeded_row_what_it_would_draw_alone():
    """Rows of every kind in one batch (greedy, seeded with top-k / top-p / both, one banned token): each
    seeded row's tokens and logprobs are those of the one-row rule with its own generator, step after step."""
    torch.manual_seed(0)
    vocab = 50
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=1, logprobs=True),
              SamplingParams(temperature=1.3, top_k=5, seed=2, logprobs=True),
              SamplingParams(temperature=1.0, top_p=0.8, seed=3, logprobs=True),
              SamplingParams(temperature=0.9, top_k=7, top_p=0.6, seed=4, logprobs=True),
              SamplingParams(temperature=1.0, logprobs=True),  # unseeded: the shared generator
              SamplingParams(logprobs=True)]
    s = Sampler(torch.device("cpu"))
    gens = {r: torch.Generator().manual_seed(p.seed) for r, p in enumerate(params) if p.seed is not None}
    for _ in range(20):
        logits = torch.randn(len(params), vocab) * 3
        banned = [None, 4, None, None, None, None, int(logits[6].argmax())]
        got = s.sample(logits, list(range(len(params))), params, banned)
        for r, p in enumerate(params):
            row = logits[r].clone()
            if banned[r] is not None:
                row[banned[r]] = float("-inf")
            if r in gens:
                assert (got.token_ids[r], pytest.approx(got.logprobs[r], abs=1e-5)) == _one_row(row, p, gens[r])
            elif p.is_greedy:
                assert got.token_ids[r] == int(row.argmax())  # the banned best token is never taken
                assert got.logprobs[r] == (pytest.approx(float(torch.log_softmax(row, -1)[got.token_ids[r]]), abs=1e-5)
                                           if p.logprobs else None)
            else:
                assert got.logprobs[r] == pytest.approx(float(torch.log_softmax(row / p.temperature, -1)[got.token_ids[r]]), abs=1e-5)


def test_the_engine_takes_its_settings_from_the_worker_config(demo):
    """WorkerConfig is the one definition of the engine's settings: EngineConfig's defaults are its defaults, and
    the worker's values reach the engine unchanged (only the pool's size, the context and the KV groups' windows are
    resolved)."""
    import dataclasses

    from cotserve.worker.config import WorkerConfig
    from cotserve.worker.sizing import engine_config

    worker = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}
    for f in dataclasses.fields(EngineConfig):
        if f.name not in ("num_blocks", "max_model_len", "kv_group_windows"):
            assert f.default == worker[f.name], f.name
    cfg = WorkerConfig(block_size=32, max_num_seqs=5, scheduling="fifo", kv_cache_dtype="fp8_e4m3", kv_skip_layers=(0,),
                       enable_prefix_caching=False, kv_cache_bytes=1 << 20, max_model_len=64)
    got = engine_config(cfg, demo)
    assert (got.block_size, got.max_num_seqs, got.scheduling, got.kv_cache_dtype, got.kv_skip_layers,
            got.enable_prefix_caching, got.max_model_len, got.kv_group_windows) == (32, 5, "fifo", "fp8_e4m3", (0,), False,
                                                                                    64, (None,))
    assert got.num_blocks >= 1


def _step_of(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams):
    """Submit `prompts` (a, b and c of one length, d of another, and more) and plan the step that computes them:
    (runner, batch, prepared inputs)."""
    assert len(prompts["a"]) == len(prompts["b"]) == len(prompts["c"]) != len(prompts["d"])
    for rid, ids in prompts.items():
        engine.submit(rid, ids, params, lambda out: None)
    engine.drain_inbox(block=False)
    batch = engine.scheduler.schedule()
    return engine.runner, batch, engine.runner.prepare_inputs(batch)


def _one_row_groups(prepared):
    """The step's prefill groups split into groups of one row each (what attending row by row computed)."""
    from cotserve.worker.models.attention import PrefillGroup

    singles = []
    for g in prepared.paged.prefill_groups:
        for r in range(g.block_tables.shape[0]):
            idx = g.token_idx[r * g.query_len:(r + 1) * g.query_len]
            singles.append(PrefillGroup(g.query_len, g.context_len, idx, g.block_tables[r:r + 1], g.context_lens[r:r + 1],
                                        g.query_lens[r:r + 1]))
    prepared.paged.prefill_groups = singles
    return prepared


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_prompts_continuing_from_cached_pages_attend_together_to_the_bit_of_one_row_at_a_time(demo, monkeypatch,
                                                                                             kv_cache_dtype):
    """Prefill rows of the same length over the same context (prompts that share a cached prefix and are as long as
    each other) attend in one call per (length, context) group; the step's logits equal, bit for bit, those of
    every row attended on its own. With an FP8 cache (whose rows are attended one by one), whole prompts take this
    path too."""
    from cotserve.worker.model_runner import ModelRunner
    from cotserve.worker.sizing import engine_config
    from cotserve.worker.config import WorkerConfig

    monkeypatch.setenv("COTSERVE_DECODE_LAYERS", "per-op")  # the path under test (short prompts run in one C call)
    cfg = engine_config(WorkerConfig(model=DEMO_MODEL, max_num_seqs=16, kv_cache_dtype=kv_cache_dtype), demo)
    engine = Engine(demo, dataclasses.replace(cfg, block_size=4, max_num_batched_tokens=512))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    shared = encode(demo, "12+34=46.") * 2
    engine.submit("first", shared, params, lambda out: None)  # computes the shared pages
    engine.drain_inbox(block=False)
    for _ in range(2):
        engine.step()
    prompts = {"a": shared + encode(demo, "5+5="), "b": shared + encode(demo, "6+1="), "c": shared + encode(demo, "2+3="),
               "d": shared + encode(demo, "21+13=34. 8+8="), "e": encode(demo, "1+2=3."), "f": encode(demo, "4+5=9.")}
    runner, batch, inputs = _step_of(engine, prompts, params)
    sizes = sorted(g.block_tables.shape[0] for g in inputs.paged.prefill_groups)
    assert sizes == [1, 2, 3], sizes  # a, b, c together; d alone; e and f (whole prompts of one length) together
    together = runner.execute(batch)
    prepare = ModelRunner.prepare_inputs
    monkeypatch.setattr(ModelRunner, "prepare_inputs", lambda self, b: _one_row_groups(prepare(self, b)))
    assert torch.equal(runner.execute(batch), together)


def test_whole_prompts_attend_together_to_the_bit_of_the_paged_path(demo, monkeypatch):
    """Prompts computed whole in a step (no cached prefix) attend together by length over their own keys and values;
    beside them a decode row and a prompt continuing from cached pages take the paged path. The step's logits equal,
    bit for bit, those of every prefill row read back from its pages."""
    from cotserve.worker.model_runner import ModelRunner
    from cotserve.worker.models.attention import PagedAttention

    monkeypatch.setenv("COTSERVE_DECODE_LAYERS", "per-op")  # the path under test (short prompts run in one C call)
    engine = make_engine(demo, block_size=4)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    shared = encode(demo, "12+34=46.") * 2  # full pages of 4, cached once its first request has computed them
    engine.submit("decoding", shared, params, lambda out: None)
    engine.drain_inbox(block=False)
    for _ in range(3):
        engine.step()
    prompts = {"a": encode(demo, "1+2=3."), "b": encode(demo, "4+5=9."), "c": encode(demo, "7+1=8."),
               "d": encode(demo, "11+22=33. 4+4=8."), "cached": shared + encode(demo, "5+5=")}
    runner, batch, inputs = _step_of(engine, prompts, params)
    n, m = len(prompts["a"]), len(prompts["d"])
    groups = inputs.paged.prefill_groups
    assert sorted((g.query_len, g.token_idx.numel()) for g in groups if g.whole) == sorted([(n, 3 * n), (m, m)])
    assert any(g.context_len > g.query_len for g in groups)  # the cached prompt's rest
    assert inputs.paged.decode_token_idx.numel() == 1
    together = runner.execute(batch)
    prepare = ModelRunner.prepare_inputs  # the reference: every prefill row read back from its pages on its own
    monkeypatch.setattr(ModelRunner, "prepare_inputs", lambda self, b: _one_row_groups(prepare(self, b)))
    monkeypatch.setattr(PagedAttention, "_whole_from_step", staticmethod(lambda cache, k: False))
    assert torch.equal(runner.execute(batch), together)


def test_a_tenant_fair_engine_starts_a_newcomer_ahead_of_another_tenants_backlog(demo):
    """`--scheduling tenant-fair` through the engine's API: the tenant given to `submit` reaches the scheduler, and
    with one seat tenant b's one request starts right after a's first, not after a's whole backlog."""
    engine = Engine(demo, EngineConfig(num_blocks=256, block_size=16, max_num_seqs=1, max_num_batched_tokens=512,
                                       max_model_len=demo.config.max_context, scheduling="tenant-fair"))
    order: list[str] = []

    def sink(out: RequestOutput) -> None:
        if out.request_id not in order:
            order.append(out.request_id)

    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for i in range(4):
        engine.submit(f"a{i}", encode(demo, "1+1="), params, sink, tenant="a")
    engine.submit("b0", encode(demo, "2+2="), params, sink, tenant="b")
    engine.drain_inbox(block=False)
    assert {s.tenant for s in engine.scheduler.waiting} == {"a", "b"}
    while engine.scheduler.has_work():
        engine.step()
    assert order == ["a0", "b0", "a1", "a2", "a3"]
