"""DeepSeek-V3's multi-head latent attention in the KV cache: what a token costs, what the cache holds, what is
refused; and a published checkpoint's extra multi-token-prediction layer left out at load. (Its outputs against
transformers, FP8 cache included, are in test_oracle.py; its router under a live policy in test_moe.py.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from cotserve.worker.kv_spec import KvCacheSpec  # noqa: E402
from cotserve.worker.models.config import ModelConfig  # noqa: E402
from cotserve.worker.models.loader import load_model  # noqa: E402
from tests.worker.engine_helpers import save_tiny_checkpoint  # noqa: E402

V3 = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
      "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
      "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
      "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
      "n_shared_experts": 1, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "max_position_embeddings": 163840,
      "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                       "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}, "rope_theta": 10000}


def test_the_cache_holds_a_latent_and_a_rope_key_per_token_71x_smaller_than_keys_and_values():
    """DeepSeek-V3's own config: a token costs 576 numbers per layer (latent 512 + RoPE key 64) where its expanded
    keys and values are 128 heads x (192 + 128); in FP8, one scale for each of the two."""
    cfg = ModelConfig.from_dict(V3)
    assert cfg.mla.scale == pytest.approx(192 ** -0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    assert cfg.moe_layers == tuple(range(3, 61)) and cfg.moe_shared_intermediate == 2048
    bf16 = KvCacheSpec.resolve(cfg, torch.bfloat16, "auto", 16)
    assert (bf16.num_kv_heads, bf16.head_dim, bf16.value_dim) == (1, 512, 64)
    assert bf16.bytes_per_token == 61 * 576 * 2
    expanded = 61 * 128 * (192 + 128) * 2
    assert expanded // bf16.bytes_per_token == 71
    assert KvCacheSpec.resolve(cfg, torch.bfloat16, "fp8_e4m3", 16).bytes_per_token == 61 * (576 + 2 * 2)
    caches = bf16.allocate(3, torch.device("meta"))
    assert caches[0].k.shape == (3, 16, 1, 512) and caches[0].v.shape == (3, 16, 1, 64)
    with pytest.raises(ValueError, match="kv_topk_pages: not for multi-head latent attention"):
        KvCacheSpec.resolve(cfg, torch.bfloat16, "auto", 16, topk_pages=4)


def test_a_multi_token_prediction_layer_past_num_hidden_layers_is_left_out(tmp_path, caplog):
    """The published checkpoints carry one more layer than the config counts (multi-token prediction): loading
    leaves it out, says so, and serves the same model as without it (transformers' logits: this variant has a plain
    q_proj and RoPE over halves, not interleaved pairs)."""
    cfg = transformers.DeepseekV3Config(vocab_size=1464, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, head_dim=4,
                                        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                        moe_intermediate_size=16, first_k_dense_replace=1, max_position_embeddings=64,
                                        rope_interleave=False)
    hf = save_tiny_checkpoint(cfg, tmp_path, seed=2)
    ids = torch.arange(3, 19)
    before = load_model(tmp_path).model
    tensors = load_file(tmp_path / "model.safetensors")
    tensors |= {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if ".layers.1." in k}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="cotserve.worker"):
        after = load_model(tmp_path).model
    assert "layer(s) 2 past num_hidden_layers are not served" in caplog.text
    from cotserve.worker.models.attention import DenseCausalAttention

    with torch.no_grad():
        run = [m.compute_logits(m(ids, torch.arange(16), DenseCausalAttention(1, 16))) for m in (before, after)]
    assert torch.equal(*run)
    with torch.no_grad():
        torch.testing.assert_close(run[0], hf(ids[None]).logits[0], atol=2e-5, rtol=1e-4)
