"""gpt-oss's parts that the oracle tests (test_oracle.py) do not reach alone: MXFP4 experts dequantized at load, and
the attention path that serves sinks and sliding windows against the kernels that serve everything else."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from cotserve.worker.engine import Engine  # noqa: E402
from cotserve.worker.engine_config import EngineConfig  # noqa: E402
from cotserve.worker.models.attention import DenseCausalAttention  # noqa: E402
from cotserve.worker.models.loader import load_model, mxfp4_dequantized  # noqa: E402
from cotserve.worker.sequence import SamplingParams  # noqa: E402
from tests.worker.engine_helpers import run_engine, save_tiny_checkpoint  # noqa: E402

TINY = dict(vocab_size=1464, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            max_position_embeddings=128, tie_word_embeddings=False)
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}


def random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [..., rows, groups, 16] and scales [..., rows, groups] (exponents near 2^-4)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    return blocks, torch.randint(120, 126, shape, generator=g, dtype=torch.uint8)


def test_mxfp4_dequantization_is_transformers_to_the_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((3, 48, 2), seed=1)
    got = mxfp4_dequantized("x.gate_up_proj", blocks, scales)
    assert got.shape == (3, 64, 48)
    assert torch.equal(got, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


def test_an_mxfp4_checkpoint_serves_what_its_dequantized_original_does(tmp_path, caplog):
    """The experts stored as MXFP4 (as the published gpt-oss checkpoints store them) load to the same weights as a
    plain checkpoint of their dequantized values: the same logits, to the bit, and transformers' on that original; the
    startup log says the experts were dequantized."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    plain, packed = tmp_path / "plain", tmp_path / "mxfp4"
    hf = save_tiny_checkpoint(transformers.GptOssConfig(**TINY), plain, seed=2)
    quantized = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for j, (proj, rows, cols) in enumerate((("gate_up_proj", 64, 64), ("down_proj", 64, 32))):
                blocks, scales = random_mxfp4((4, rows, cols // 32), seed=10 * i + j)
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                quantized[f"model.layers.{i}.mlp.experts.{proj}"] = (blocks, scales)
    hf.save_pretrained(plain)
    shutil.copytree(plain, packed)
    tensors = load_file(packed / "model.safetensors")
    for name, (blocks, scales) in quantized.items():
        del tensors[name]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, packed / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    (packed / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4}))

    ids = torch.randint(3, 1464, (24,), generator=torch.Generator().manual_seed(3))

    def logits(folder):
        lm = load_model(folder)
        with torch.no_grad():
            return lm.model.compute_logits(lm.model(ids, torch.arange(24), DenseCausalAttention(1, 24)))

    with caplog.at_level("WARNING", logger="cotserve.worker"):
        from_packed = logits(packed)
    assert "MXFP4 expert weights dequantized at load" in caplog.text
    assert torch.equal(from_packed, logits(plain))
    with torch.no_grad():
        torch.testing.assert_close(from_packed, hf(ids[None]).logits[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype, topk", [("auto", 0), ("fp8_e4m3", 0), ("auto", 2), ("fp8_e4m3", 2)])
def test_the_sink_and_window_path_is_the_kernels_where_sinks_and_windows_change_nothing(tmp_path, kv_dtype, topk):
    """Sinks of -inf take no share of any softmax: a model served through the path that serves sinks and windows (a
    reference; no kernel has them yet) then computes what the kernels do for it, with FP8 pages and with top-k page
    selection in the second layer (each decode row reading 2 of its pages): the same logits every step."""
    save_tiny_checkpoint(transformers.Qwen3Config(**{k: v for k, v in TINY.items() if "expert" not in k
                                                     and k != "sliding_window"}), tmp_path, seed=4)
    ids = torch.randint(3, 1464, (30,), generator=torch.Generator().manual_seed(5)).tolist()

    def run(sinks: bool):
        lm = load_model(tmp_path)
        if sinks:
            for layer in lm.model.model.layers:
                layer.self_attn.sinks = torch.full((4,), float("-inf"))
        engine = Engine(lm, EngineConfig(num_blocks=64, block_size=4, max_model_len=128, kv_cache_dtype=kv_dtype,
                                         kv_topk_pages=topk, kv_topk_dense_layers=(0,)))
        seen = []
        execute = engine.runner.execute
        engine.runner.execute = lambda batch: seen.append(execute(batch)) or seen[-1]
        (out,) = run_engine(engine, [ids], SamplingParams(max_new_tokens=6, ignore_eos=True))
        return out.token_ids, [x for x in seen if x.shape[0]]

    (kernel_tokens, kernel_logits), (path_tokens, path_logits) = run(False), run(True)
    assert path_tokens == kernel_tokens
    for a, b in zip(kernel_logits, path_logits, strict=True):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


def test_a_sliding_layer_reads_only_the_pages_its_window_reaches():
    """A decode row 70 tokens in, with a window of 8 and pages of 4: its oldest visible key is at 62, on page 15, so
    it reads pages 15-17 (context counted from page 15's first token); a row 9 tokens in reads from its first page.
    (That attention over the cut pages is the model's: the gpt-oss oracle tests run past the window.)"""
    from types import SimpleNamespace

    from cotserve.worker.models.attention import PagedAttention

    attn = PagedAttention(caches=[], spec=SimpleNamespace(block_size=4), batch=None, kernels=None, scale=1.0)
    tables, ctx = attn._window_pages(torch.arange(40).view(2, 20), torch.tensor([70, 9]), qlen=1, window=8)
    assert tables.tolist() == [[15, 16, 17], [20, 21, 22]] and ctx.tolist() == [10, 9]
    tables, ctx = attn._window_pages(torch.arange(40).view(2, 20), torch.tensor([70, 9]), qlen=6, window=8)
    assert tables[0].tolist() == [14, 15, 16, 17] and ctx.tolist() == [14, 9]  # the first query sees back to key 57


def test_a_sliding_layer_frees_the_pages_that_leave_its_window(tmp_path):
    """gpt-oss's sliding layer keeps a block table of its own (a KV group): a pool block is one layer's page, and the
    sliding layer holds, after each step, only the pages its next query's window reaches (the rest given back to the
    pool), while the full-attention layer holds every page; the tokens are transformers' greedy ones throughout."""
    from cotserve.worker.block_manager import RELEASED
    from cotserve.worker.kv_spec import KvGroup

    hf = save_tiny_checkpoint(transformers.GptOssConfig(**TINY), tmp_path, seed=6)
    lm = load_model(tmp_path)
    engine = Engine(lm, EngineConfig(num_blocks=40, block_size=4, max_num_batched_tokens=8, max_model_len=128))
    assert engine.kv_spec.kv_groups == (KvGroup(None, (1,)), KvGroup(8, (0,)))
    assert engine.kv_spec.bytes_per_block == 4 * engine.kv_spec.layer_bytes_per_token()[0]  # one layer's page
    assert engine.runner.caches[0] is engine.runner.caches[1]  # the two layers' pages share the pool's one slot
    ids = torch.randint(3, 1464, (26,), generator=torch.Generator().manual_seed(7)).tolist()
    engine.submit("r", ids, SamplingParams(max_new_tokens=20, ignore_eos=True), lambda out: tokens.append(out.token_id))
    tokens: list[int] = []
    engine.drain_inbox(block=False)
    held = []
    while engine.scheduler.has_work():
        engine.step()
        for seq in engine.scheduler.running:
            full, sliding = engine.block_manager.tables(seq)
            computed = seq.num_computed_tokens
            first = max(0, computed - 8 + 1) // 4  # the page of the oldest key the next query sees
            assert len(full) == len(sliding) and RELEASED not in full
            assert sliding[:first] == [RELEASED] * first and RELEASED not in sliding[first:]
            assert engine.block_manager.num_used_blocks == len(full) + len(sliding) - first
            held.append((computed, len(full) + len(sliding) - first))
    # the last step before the end: 44 tokens in 11 pages in the full layer; the next query (at 44) sees back to key 37,
    # so the sliding layer keeps pages 9 and 10 of its 11
    assert held[-1] == (44, 11 + 2)
    assert engine.block_manager.num_free_blocks == 40  # and every page back at the end
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, 26:].tolist()
    assert tokens == expected


def test_layers_fall_into_kv_groups_of_one_size_and_share_the_pools_slots():
    """Full-attention layers first, then each window's, cut to the gcd of the kinds' counts (five sliding layers and
    one full: six groups of one); layers that would share a slot but store different formats (an FP8 cache with a
    layer kept at full precision) make one group of every layer: windows then only bound what attention reads."""
    from cotserve.kernels.kv_fp8 import FP8
    from cotserve.worker.kv_spec import KvGroup, LayerKvSpec, kv_groups

    fp8, f32 = LayerKvSpec(FP8), LayerKvSpec(torch.float32)
    assert kv_groups([8, None, 8, None], (fp8,) * 4) == (KvGroup(None, (1, 3)), KvGroup(8, (0, 2)))
    assert kv_groups([8] * 5 + [None], (fp8,) * 6) == (KvGroup(None, (5,)),) + tuple(KvGroup(8, (i,)) for i in range(5))
    assert kv_groups([None, 4, 8, None, 4, 8], (fp8,) * 6) == (
        KvGroup(None, (0, 3)), KvGroup(4, (1, 4)), KvGroup(8, (2, 5)))
    assert kv_groups([8, None, 8, None], (f32, fp8, fp8, fp8)) == (KvGroup(None, (0, 1, 2, 3)),)
    assert kv_groups([None] * 3, (fp8,) * 3) == (KvGroup(None, (0, 1, 2)),)


def test_the_pool_is_sized_and_requests_checked_by_the_kv_groups(tmp_path):
    """A byte budget buys pages of one layer (not of both), and the longest request the engine takes is what the pool
    holds with the sliding layer keeping only a window and a chunk of pages: refused above it, before any compute."""
    from cotserve.worker.config import WorkerConfig
    from cotserve.worker.engine_config import check_submit
    from cotserve.common.sampling import ReasoningParams
    from cotserve.worker.sizing import engine_config

    save_tiny_checkpoint(transformers.GptOssConfig(**TINY), tmp_path, seed=6)
    lm = load_model(tmp_path)
    page = 4 * 2 * 2 * 16 * 4  # 4 tokens, keys and values, 2 KV heads of 16, fp32: one layer's page
    cfg = engine_config(WorkerConfig(model=str(tmp_path), block_size=4, max_num_batched_tokens=8,
                                     kv_cache_bytes=30 * page), lm)
    assert (cfg.num_blocks, cfg.kv_group_windows) == (30, (None, 8))
    # 100 tokens: 25 pages of the full layer, (8 + 8) / 4 + 1 = 5 of the sliding one
    check_submit(cfg, False, 90, SamplingParams(max_new_tokens=10), ReasoningParams())
    with pytest.raises(ValueError, match=r"= 101 exceeds the KV cache \(100 tokens\)"):
        check_submit(cfg, False, 91, SamplingParams(max_new_tokens=10), ReasoningParams())
    engine = Engine(lm, cfg)
    (out,) = run_engine(engine, [list(range(3, 93))], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert len(out.token_ids) == 10 and engine.block_manager.num_free_blocks == 30
