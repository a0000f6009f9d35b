"""RoPE's cos/sin table: what served positions read equals, to the bit, what computing them gives."""

from __future__ import annotations

import pytest
import torch

from cotserve.worker.models.config import RopeConfig
from cotserve.worker.models.llama import RotaryEmbedding

LLAMA3 = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)


@pytest.mark.parametrize("rope", [RopeConfig(theta=10000.0), LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_table_gives_what_computing_gives_to_the_bit(rope, head_dim, dtype):
    table = RotaryEmbedding(rope, head_dim, max_positions=32768)
    computed = RotaryEmbedding(rope, head_dim)  # no table: computed per call (as training does)
    g = torch.Generator().manual_seed(head_dim)
    for positions in (torch.tensor([0]), torch.arange(300), torch.randint(0, 32768, (97,), generator=g),
                      torch.tensor([32767, 1, 32767, 0])):
        got, want = table.cos_sin(positions, dtype), computed.cos_sin(positions, dtype)
        assert got[0].dtype == dtype and got[0].shape == (len(positions), head_dim)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert set(table._tables) == {dtype}  # made once per dtype, on first use


def test_a_position_past_the_table_is_an_error_not_a_wrong_angle():
    table = RotaryEmbedding(RopeConfig(theta=10000.0), 64, max_positions=256)
    with pytest.raises(IndexError):
        table.cos_sin(torch.tensor([255, 256]), torch.float32)


def test_the_loader_sizes_the_table_to_the_longest_context_served():
    from cotserve.worker.config import DEMO_MODEL
    from cotserve.worker.models.loader import load_model

    loaded = load_model(DEMO_MODEL)
    assert loaded.model.model.rotary.max_positions == loaded.config.max_context == 256


@pytest.mark.parametrize("params", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's long-context setting: truncated range
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
     "original_max_position_embeddings": 4096},  # DeepSeek-V3's: the two mscales cancel
    {"factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
], ids=["gpt-oss", "qwen3-long", "deepseek-v3", "mscales"])
def test_yarn_frequencies_and_attention_factor_are_transformers(params):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from cotserve.worker.models.config import ModelConfig
    from cotserve.worker.models.llama import rope_inv_freq

    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 256, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 131072,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, **params}}
    ours = ModelConfig.from_dict(raw)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**raw))
    assert ours.max_context == 131072  # one set of frequencies serves every length
    assert ours.rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    assert torch.equal(rope_inv_freq(ours.rope, ours.rotary_dim), inv_freq)
