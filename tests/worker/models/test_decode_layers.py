"""A step's layers in one C call (`cpu_native.DecodeLayers`) against the per-operation path it replaces: for decode
rows the same hidden states and cache contents to the bit; with prompt chunks (attended a token at a time) logits
within 1e-5; the same tokens through the engine."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cotserve.kernels import cpu_native  # noqa: E402
from cotserve.worker.engine import Engine  # noqa: E402
from cotserve.worker.engine_config import EngineConfig  # noqa: E402
from cotserve.worker.kv_spec import KvCacheSpec  # noqa: E402
from cotserve.worker.model_runner import ModelRunner  # noqa: E402
from cotserve.worker.models.attention import PagedAttention, PagedBatch  # noqa: E402
from cotserve.worker.models.loader import load_model  # noqa: E402
from cotserve.worker.sequence import SamplingParams  # noqa: E402
from tests.worker.engine_helpers import run_engine, save_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler here")

VOCAB = 1464
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
BLOCK, BLOCKS = 4, 64


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2-bias"])
def loaded(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llama-gqa":
        save_tiny_checkpoint(transformers.LlamaConfig(**BASE), folder, seed=3)
    else:  # biases on q/k/v: the C multiplies' bias path
        save_tiny_checkpoint(transformers.Qwen2Config(**dict(BASE, num_key_value_heads=4)), folder, seed=4)
    return load_model(folder)


def _spec(loaded, kv_dtype: str, topk: int = 0, dense=()) -> KvCacheSpec:
    return KvCacheSpec.resolve(loaded.config, loaded.dtype, kv_dtype, BLOCK, topk_pages=topk, topk_dense_layers=dense)


def _runner(loaded, spec: KvCacheSpec) -> ModelRunner:
    """A runner whose kernels are warmed up: its compile thread done (one still compiling when the test process
    exits aborts it)."""
    runner = ModelRunner(loaded, BLOCKS, spec)
    assert runner.warmed.wait(300)
    return runner


def _filled(runner: ModelRunner, seed: int) -> None:
    """Every cache tensor filled with values a real cache could hold (FP8: finite E4M3 codes, positive scales)."""
    g = torch.Generator().manual_seed(seed)
    for cache in runner.caches:
        for t in (cache.k, cache.v):
            if t.dtype == torch.float32:
                t.copy_(torch.randn(t.shape, generator=g))
            else:  # finite E4M3 codes (0x7f / 0xff are NaN)
                codes = torch.randint(0, 0x7f, t.shape, generator=g, dtype=torch.uint8)
                signs = torch.randint(0, 2, t.shape, generator=g, dtype=torch.uint8) << 7
                t.view(torch.uint8).copy_(codes | signs)
        for s in (cache.k_scale, cache.v_scale):
            if s is not None:
                s.copy_((torch.rand(s.shape, generator=g) * 0.02 + 1e-3).half())
        for bound, sign in ((cache.k_min, -1), (cache.k_max, 1)):
            if bound is not None:
                bound.copy_(sign * torch.rand(bound.shape, generator=g) * 3)


def _decode_batch(contexts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, PagedBatch]:
    """One decode row per context length: the new token at position ctx - 1, its pages spread over the pool."""
    g = torch.Generator().manual_seed(seed)
    width = max((c + BLOCK - 1) // BLOCK for c in contexts)
    perm = torch.randperm(BLOCKS, generator=g)
    tables, slots, used = [], [], 0
    for c in contexts:
        pages = (c + BLOCK - 1) // BLOCK
        table = perm[used:used + pages].tolist()
        used += pages
        tables.append(table + [0] * (width - pages))
        slots.append(table[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK)
    n = len(contexts)
    ids = torch.randint(3, VOCAB, (n,), generator=g)
    positions = torch.tensor([c - 1 for c in contexts])
    paged = PagedBatch(slot_mapping=torch.tensor(slots), decode_token_idx=torch.arange(n),
                       decode_block_tables=torch.tensor(tables), decode_context_lens=torch.tensor(contexts),
                       fresh_page=torch.tensor([(c - 1) % BLOCK == 0 for c in contexts]))
    return ids, positions, paged


def _one_call(loaded, runner: ModelRunner, ids, positions, paged: PagedBatch) -> torch.Tensor:
    return loaded.model.forward_natively(runner.decode_layers, ids, positions, paged.slot_mapping, paged.fresh_page,
                                         paged.decode_block_tables, paged.decode_context_lens)


def _state(runner: ModelRunner) -> list[torch.Tensor]:
    return [t.clone() for t in runner.cache_tensors()]


@pytest.mark.parametrize("kv_dtype, topk, threads", [("auto", 0, 1), ("auto", 0, 2), ("fp8_e4m3", 0, 1),
                                                      ("fp8_e4m3", 0, 2), ("fp8_e4m3", 2, 1), ("auto", 2, 2)])
@torch.inference_mode()
def test_a_decode_step_is_the_per_operation_path_to_the_bit(loaded, kv_dtype, topk, threads):
    """Hidden states and every cache tensor (payloads, FP8 scales, page bounds reset on a fresh page) after a decode
    step of ragged rows, one and two threads; with page bounds kept (every layer dense: the bounds are still
    written)."""
    dense = tuple(range(loaded.config.num_layers)) if topk else ()
    runner = _runner(loaded, _spec(loaded, kv_dtype, topk, dense))
    assert runner.decode_layers is not None
    _filled(runner, seed=7)
    before = _state(runner)
    ids, positions, paged = _decode_batch([1, 5, 8, 9, 17, 33, 40, 13, 4], seed=11)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = loaded.model(ids, positions, PagedAttention(runner.caches, runner.spec, paged, runner.kernels,
                                                           runner.scale))
        want_state = _state(runner)
        for t, b in zip(runner.cache_tensors(), before):
            t.copy_(b)
        got = _one_call(loaded, runner, ids, positions, paged)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(got, want)
    changed = 0
    for t, w, b in zip(runner.cache_tensors(), want_state, before):
        assert torch.equal(t.view(torch.uint8), w.view(torch.uint8))
        changed += not torch.equal(t.view(torch.uint8), b.view(torch.uint8))
    assert changed == len(before)  # every tensor was written (the comparison is not of untouched caches)


@torch.inference_mode()
def test_a_slot_outside_the_cache_raises_and_writes_nothing(loaded):
    runner = _runner(loaded, _spec(loaded, "fp8_e4m3"))
    _filled(runner, seed=1)
    before = _state(runner)
    ids, positions, paged = _decode_batch([3, 6], seed=2)
    paged.slot_mapping[1] = BLOCKS * BLOCK
    with pytest.raises(IndexError, match=r"token 1's slot 256 is outside the cache \(64 blocks of 4\)"):
        _one_call(loaded, runner, ids, positions, paged)
    assert all(torch.equal(t.view(torch.uint8), b.view(torch.uint8)) for t, b in zip(runner.cache_tensors(), before))
    ids, positions, paged = _decode_batch([3, 6], seed=2)
    paged.decode_context_lens[0] = 40  # more pages than its table has
    with pytest.raises(IndexError, match="decode attention: row 0 reads outside its block table"):
        _one_call(loaded, runner, ids, positions, paged)


def test_where_it_does_not_apply_the_per_operation_path_runs(loaded, monkeypatch):
    assert _runner(loaded, _spec(loaded, "auto", 2)).decode_layers is None  # top-k page selection
    assert _runner(loaded, _spec(loaded, "auto", 2, (0,))).decode_layers is None  # some layers select
    assert _runner(loaded, _spec(loaded, "bf16")).decode_layers is None  # a cache the C does not read
    monkeypatch.setenv("COTSERVE_DECODE_LAYERS", "per-op")
    assert _runner(loaded, _spec(loaded, "auto")).decode_layers is None
    monkeypatch.setenv("COTSERVE_DECODE_LAYERS", "fused")
    with pytest.raises(ValueError, match="COTSERVE_DECODE_LAYERS: 'fused', allowed auto, per-op"):
        _runner(loaded, _spec(loaded, "auto"))


def test_a_mixture_of_experts_and_the_torch_layer_operations_keep_the_per_operation_path(tmp_path, monkeypatch):
    moe = tmp_path / "moe"
    save_tiny_checkpoint(transformers.MixtralConfig(**dict(BASE, num_local_experts=4, num_experts_per_tok=2,
                                                           sliding_window=None)), moe, seed=5)
    mixtral = load_model(moe)
    assert _runner(mixtral, _spec(mixtral, "auto")).decode_layers is None
    dense = tmp_path / "dense"
    save_tiny_checkpoint(transformers.LlamaConfig(**BASE), dense, seed=6)
    monkeypatch.setenv("COTSERVE_LAYER_OPS", "reference")
    torch_ops = load_model(dense)
    assert _runner(torch_ops, _spec(torch_ops, "auto")).decode_layers is None


def _mixed_step(loaded, kv_dtype: str):
    """An engine whose next step holds decode rows, a prompt continuing from cached pages and a whole prompt (its
    runner warmed up), and that step planned: (engine, batch)."""
    engine = Engine(loaded, EngineConfig(num_blocks=BLOCKS, block_size=BLOCK, max_model_len=256, kv_cache_dtype=kv_dtype))
    assert engine.runner.warmed.wait(300)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    shared = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    for rid in ("d1", "d2"):
        engine.submit(rid, shared + [10 + len(rid)], params, lambda out: None)
    engine.drain_inbox(block=False)
    for _ in range(3):
        engine.step()
    engine.submit("cached", shared + [20, 21, 22, 23, 24], params, lambda out: None)  # continues from 2 cached pages
    engine.submit("whole", [30, 31, 32, 33, 34, 35, 36], params, lambda out: None)
    engine.drain_inbox(block=False)
    batch = engine.scheduler.schedule()
    assert sorted(item.num_tokens for item in batch.items) == [1, 1, 6, 7]
    return engine, batch


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
@torch.inference_mode()
def test_a_step_with_prompt_chunks_runs_in_one_call_close_to_the_per_operation_path(loaded, kv_dtype):
    """Prompt chunks' tokens attend a token at a time over their pages in the one call: the step's logits within 1e-5
    of the per-operation path's batched prompt attention, the first layer's cache writes (before any attention) the
    same to the bit."""
    engine, batch = _mixed_step(loaded, kv_dtype)
    runner = engine.runner
    assert runner._in_one_call(batch)
    before = _state(runner)
    got = runner.execute(batch)
    one_call_state = _state(runner)
    for t, b in zip(runner.cache_tensors(), before):
        t.copy_(b)
    layers, runner.decode_layers = runner.decode_layers, None  # the per-operation path
    try:
        want = runner.execute(batch)
    finally:
        runner.decode_layers = layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    first = runner.caches[0].tensors()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(one_call_state[:len(first)], _state(runner)[:len(first)]))
    assert not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, _state(runner)))


def test_a_prompt_chunk_longer_than_the_bound_keeps_the_per_operation_path(loaded):
    from cotserve.worker.model_runner import ONE_CALL_MAX_QUERY

    engine = Engine(loaded, EngineConfig(num_blocks=BLOCKS, block_size=BLOCK, max_model_len=256))
    assert engine.runner.warmed.wait(300)
    for rid, n in (("short", ONE_CALL_MAX_QUERY), ("long", ONE_CALL_MAX_QUERY + 1)):
        engine.submit(rid, list(range(3, 3 + n)), SamplingParams(max_new_tokens=2), lambda out: None)
        engine.drain_inbox(block=False)
        batch = engine.scheduler.schedule()
        assert [item.num_tokens for item in batch.items] == [n]
        assert engine.runner._in_one_call(batch) == (rid == "short")
        engine.abort(rid)
        engine.drain_inbox(block=False)
        engine.scheduler.advance(batch)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_the_engine_generates_the_same_tokens_either_way(loaded, kv_dtype, monkeypatch):
    """Ragged prompts decoded in one batch (rows joining and leaving, pages filling) with sampling: every token as
    the per-operation path gives it, the logprobs within 1e-4 (the prompts' attention rounds differently)."""
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (3, 9, 14, 22, 5)]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True, temperature=0.8, seed=m, logprobs=True)
              for m in (30, 12, 25, 7, 40)]
    runs = {}
    for mode in ("auto", "per-op"):
        monkeypatch.setenv("COTSERVE_DECODE_LAYERS", mode)
        engine = Engine(loaded, EngineConfig(num_blocks=BLOCKS, block_size=BLOCK, max_model_len=256,
                                             kv_cache_dtype=kv_dtype))
        assert (engine.runner.decode_layers is not None) == (mode == "auto")
        assert engine.runner.warmed.wait(300)
        runs[mode] = run_engine(engine, prompts, params)
    assert [r.token_ids for r in runs["auto"]] == [r.token_ids for r in runs["per-op"]]
    assert [len(r.token_ids) for r in runs["auto"]] == [30, 12, 25, 7, 40]
    for got, want in zip(runs["auto"], runs["per-op"]):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
