"""Our model code against transformers (test-only oracle) on tiny random checkpoints."""

from __future__ import annotations

import contextlib
import json
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cotserve.kernels.kv_fp8 import dequantize_ref, quantize_ref  # noqa: E402
from cotserve.worker.engine import Engine  # noqa: E402
from cotserve.worker.engine_config import EngineConfig  # noqa: E402
from cotserve.worker.kv_spec import FP8_SCALE_DTYPE  # noqa: E402
from cotserve.worker.models.attention import DenseCausalAttention  # noqa: E402
from cotserve.worker.models.loader import load_model  # noqa: E402
from cotserve.worker.sequence import SamplingParams  # noqa: E402
from tests.worker.engine_helpers import run_engine, save_tiny_checkpoint  # noqa: E402
from transformers.masking_utils import eager_mask  # noqa: E402

VOCAB = 1464  # the demo tokenizer's size, reused as the tokenizer of every tiny checkpoint
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
CASES = {
    "llama-gqa-untied-theta": (transformers.LlamaConfig, dict(BASE, rope_theta=50000.0, tie_word_embeddings=False)),
    "llama-tied-llama3-rope": (transformers.LlamaConfig, dict(
        BASE, tie_word_embeddings=True, num_key_value_heads=8,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32, "rope_theta": 500000.0})),
    "mistral-gqa": (transformers.MistralConfig, dict(BASE, rope_theta=1e6, sliding_window=None, tie_word_embeddings=False)),
    "qwen2-bias": (transformers.Qwen2Config, dict(BASE, rope_theta=1e6, num_key_value_heads=4, tie_word_embeddings=False)),
    "mixtral-moe": (transformers.MixtralConfig, dict(BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                                     tie_word_embeddings=False)),
    "qwen3-qk-norm": (transformers.Qwen3Config, dict(BASE, rope_theta=1e6, tie_word_embeddings=True)),
    # two MoE layers of experts smaller than the dense layer's, weights not renormalized; one dense layer between
    "qwen3-moe": (transformers.Qwen3MoeConfig, dict(BASE, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
                                                    rope_theta=1e6, tie_word_embeddings=False)),
    # fused q/k/v and gate/up in the checkpoint, RoPE over half of each head
    "phi3-partial-rotary": (transformers.Phi3Config, dict(BASE, rope_theta=250000.0, tie_word_embeddings=False,
                                                          partial_rotary_factor=0.5, bos_token_id=1, eos_token_id=2,
                                                          pad_token_id=0)),
    "qwen3-moe-renormalized": (transformers.Qwen3MoeConfig, dict(BASE, num_experts=4, num_experts_per_tok=2,
                                                                 moe_intermediate_size=48, norm_topk_prob=True,
                                                                 tie_word_embeddings=False)),
    # multi-head latent attention (a query bottleneck, YaRN with DeepSeek's mscales) with interleaved RoPE; one dense
    # layer, then MoE with a shared expert, 8 experts in 4 groups (2 kept), sigmoid scores and a choice bias
    "deepseek-v3-mla": (transformers.DeepseekV3Config, dict(
        BASE, num_hidden_layers=3, num_key_value_heads=8, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, head_dim=8, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0,
            "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1})),
    # attention sinks, windows of 8 tokens in layers 0 and 2 (prompts and outputs run past them), YaRN RoPE, biased
    # router and clamped experts
    "gpt-oss": (transformers.GptOssConfig, dict(BASE, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
                                                sliding_window=8, tie_word_embeddings=False, rope_parameters={
                                                    "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                    "original_max_position_embeddings": 64})),
}
TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    cfg_cls, kwargs = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_checkpoint(cfg_cls(**kwargs), folder, seed=sum(map(ord, request.param)))
    return folder, hf


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy `n` tokens after `ids`, none of them ending the sequence: what `ignore_eos` asks of ours
    (generate's `min_new_tokens` would instead forbid the EOS token, which ours may still pick). A forward pass over
    the whole sequence per token: the tiny models make it cheap, and no cache of transformers' is involved."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_logits_match_transformers(checkpoint):
    folder, hf = checkpoint
    ours = load_model(folder)
    ids = torch.tensor([prompt_ids(40, 1), prompt_ids(40, 2)])
    with torch.no_grad():
        expected = hf(ids).logits
        hidden = ours.model(ids.reshape(-1), torch.arange(40).repeat(2), DenseCausalAttention(2, 40))
        got = ours.model.compute_logits(hidden).view(2, 40, -1)
    torch.testing.assert_close(got, expected, **TOL)


def test_paged_engine_logits_match_transformers(checkpoint):
    """Prefill in uneven chunks and decode through the paged cache; each step's logits match."""
    folder, hf = checkpoint
    ours = load_model(folder)
    engine = Engine(ours, EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=7, max_model_len=256))
    ids = prompt_ids(23, 3)
    seen = []
    orig = engine.runner.execute

    def capture(batch):
        logits = orig(batch)
        seen.append(logits)
        return logits

    engine.runner.execute = capture
    out = run_engine(engine, [ids], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    full = ids + out.token_ids
    with torch.no_grad():
        expected = hf(torch.tensor([full])).logits[0]
    sampled = [x for x in seen if x.shape[0]]
    assert len(sampled) == 5  # 23-token prompt in chunks of 7: only the last chunk samples
    for step, logits in enumerate(sampled):
        torch.testing.assert_close(logits[0], expected[len(ids) - 1 + step], **TOL)


def test_greedy_32_tokens_identical_to_transformers(checkpoint):
    folder, hf = checkpoint
    ours = load_model(folder)
    prompts = [prompt_ids(n, 10 + n) for n in (5, 17, 33)]
    engine = Engine(ours, EngineConfig(num_blocks=64, block_size=16, max_model_len=256))
    outs = run_engine(engine, prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == greedy(hf, ids, 32)


def test_a_prefix_cache_hit_and_four_forks_keep_greedy_identical_to_transformers(checkpoint):
    """The same prompt again (its pages from the prefix cache: a hit) and as n=4 greedy samples sharing its pages
    (forks): every sample's tokens are transformers' greedy ones, and the second request found its prompt cached."""
    folder, hf = checkpoint
    ours = load_model(folder)
    engine = Engine(ours, EngineConfig(num_blocks=64, block_size=4, max_model_len=256, enable_prefix_caching=True))
    ids = prompt_ids(21, 7)
    ref = greedy(hf, ids, 12)
    (first,) = run_engine(engine, [ids], SamplingParams(max_new_tokens=12, ignore_eos=True))
    samples: dict[int, list[int]] = {}
    cached = []

    def sink(out) -> None:
        assert out.error is None, out.error
        samples.setdefault(out.index, []).append(out.token_id)
        if out.is_last:
            cached.append(out.cached_prompt_tokens)

    engine.submit("forks", ids, SamplingParams(max_new_tokens=12, ignore_eos=True, n=4), sink)
    engine.drain_inbox(block=False)
    while engine.scheduler.has_work():
        engine.step()
    assert first.token_ids == ref
    assert samples == {i: ref for i in range(4)}
    assert cached == [20]  # the prompt's five full pages of four (its last token is computed again)


def fp8_rounded(x: torch.Tensor) -> torch.Tensor:
    """`x` as our FP8 cache stores it: E4M3, one scale per vector (per token and head)."""
    return dequantize_ref(*quantize_ref(x, FP8_SCALE_DTYPE), x.dtype)


def fp8_kv_attention(module, query, key, value, *args, **kwargs):
    """transformers' own eager attention of the module's family over keys and values rounded as our FP8 cache stores
    them: the reference for a worker serving with `kv_cache_dtype=fp8_e4m3`."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, fp8_rounded(key), fp8_rounded(value), *args, **kwargs)


@contextlib.contextmanager
def fp8_cache_reference(hf, monkeypatch):
    """transformers' `hf` computing over an FP8-rounded cache: keys and values rounded before attention, or, for
    latent attention (DeepSeek), what its cache holds, the normalized latent and the rotated RoPE key, rounded where
    they are made (before they expand into keys and values)."""
    if not hasattr(hf.config, "kv_lora_rank"):
        transformers.AttentionInterface.register("cotserve-fp8-kv", fp8_kv_attention)
        transformers.AttentionMaskInterface.register("cotserve-fp8-kv", eager_mask)  # the additive mask eager takes
        hf.set_attn_implementation("cotserve-fp8-kv")
        try:
            yield
        finally:
            hf.set_attn_implementation("eager")
        return
    module = sys.modules[type(hf).__module__]
    rope = module.apply_rotary_pos_emb_interleave if hf.config.rope_interleave else module.apply_rotary_pos_emb

    def rounded_rope(q, k, *args, **kwargs):
        q, k = rope(q, k, *args, **kwargs)
        return q, fp8_rounded(k)

    monkeypatch.setattr(module, rope.__name__, rounded_rope)
    hooks = [m.kv_a_layernorm.register_forward_hook(lambda mod, inputs, out: fp8_rounded(out))
             for m in hf.modules() if hasattr(m, "kv_a_layernorm")]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def test_fp8_kv_matches_transformers_over_the_same_rounded_keys_and_values(checkpoint, monkeypatch):
    """The KV cache in FP8: prefill in chunks and decode; every sampled step's logits are transformers' with what its
    cache holds rounded the same way (`fp8_cache_reference`), and the greedy tokens are that model's."""
    folder, hf = checkpoint
    with fp8_cache_reference(hf, monkeypatch):
        ours = load_model(folder)
        engine = Engine(ours, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=13, max_model_len=256,
                                           kv_cache_dtype="fp8_e4m3"))
        assert engine.runner.caches[0].k.dtype == torch.float8_e4m3fn
        ids = prompt_ids(30, 4)
        seen = []
        execute = engine.runner.execute
        engine.runner.execute = lambda batch: seen.append(execute(batch)) or seen[-1]
        (out,) = run_engine(engine, [ids], SamplingParams(max_new_tokens=8, ignore_eos=True))
        with torch.no_grad():
            expected = hf(torch.tensor([ids + out.token_ids])).logits[0]
        sampled = [x for x in seen if x.shape[0]]
        assert len(sampled) == 8
        for step, logits in enumerate(sampled):
            torch.testing.assert_close(logits[0], expected[len(ids) - 1 + step], atol=1e-3, rtol=1e-3)
        assert out.token_ids == greedy(hf, ids, 8)


def greedy_uncached(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens with each step a forward over the whole sequence so far (no cache): what LongRoPE
    means at every length (transformers picks the short or the long factors for a whole forward by its length)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out]), use_cache=False).logits[0, -1].argmax()))
    return out[len(ids):]


def test_phi3_longrope_takes_the_long_factors_past_its_original_length(tmp_path, caplog):
    """LongRoPE (Phi-3/Phi-4-mini): up to the original length (64 here) the short factors, past it the long ones at
    every position, cos and sin scaled by the attention factor, as transformers' forward over the whole sequence. A
    prompt past it is long from the start; a sequence that grows past it is recomputed once with the long factors,
    under a prefix-cache root of its own: a later short request hits its short pages, a later long one its long
    pages, and every token is transformers'."""
    # heads of 16 (transformers' Phi3 checks the factors against hidden_size / heads), 0.75 of each rotated: 6 factors
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.1 * i for i in range(6)], "long_factor": [2.0 + 0.5 * i for i in range(6)],
            "partial_rotary_factor": 0.75}
    cfg = transformers.Phi3Config(**dict(BASE, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         original_max_position_embeddings=64,
                                         rope_scaling=rope, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                         pad_token_id=0))
    hf = save_tiny_checkpoint(cfg, tmp_path, seed=5)
    ours = load_model(tmp_path)
    assert ours.config.max_context == 256 and ours.config.rope.attention_factor > 1.0
    engine = Engine(ours, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=40, max_model_len=256,
                                       enable_prefix_caching=True))
    seen = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch: seen.append(execute(batch)) or seen[-1]
    long_prompt = prompt_ids(100, 12)
    (out,) = run_engine(engine, [long_prompt], SamplingParams(max_new_tokens=3, ignore_eos=True))
    with torch.no_grad():
        expected = hf(torch.tensor([long_prompt + out.token_ids[:2]])).logits[0]
    sampled = [x for x in seen if x.shape[0]]
    for step, logits in enumerate(sampled):  # the prompt in chunks of 40 tokens, then decode: the long factors
        torch.testing.assert_close(logits[0], expected[99 + step], **TOL)
    assert engine.scheduler.num_preemptions_total == 0

    ids = prompt_ids(50, 11)  # crosses 64 at its 15th token
    (grown,) = run_engine(engine, [ids], SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert grown.token_ids == greedy_uncached(hf, ids, 30)
    assert engine.scheduler.num_preemptions_total == 1  # recomputed once, as it grew past the original length
    (short,) = run_engine(engine, [ids], SamplingParams(max_new_tokens=10, ignore_eos=True))
    (longer,) = run_engine(engine, [ids + grown.token_ids], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert short.token_ids == greedy_uncached(hf, ids, 10) and short.last.cached_prompt_tokens == 48
    assert longer.token_ids == greedy_uncached(hf, ids + grown.token_ids, 5)
    assert longer.last.cached_prompt_tokens == 64  # the grown sequence's pages, rotated by the long factors


def test_longrope_without_long_factors_serves_up_to_its_original_length(tmp_path, caplog):
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}
    cfg = transformers.Phi3Config(**dict(BASE, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         original_max_position_embeddings=64, rope_scaling=rope,
                                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    save_tiny_checkpoint(cfg, tmp_path, seed=5)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(key), dict):
            config[key].pop("long_factor", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="cotserve.worker"):
        ours = load_model(tmp_path)
    assert ours.config.max_context == 64 and ours.config.rope_long_after is None
    assert "LongRoPE without long factors: contexts are served up to its original length, 64 tokens (of 256)" in caplog.text
