"""A tiny random Mixtral checkpoint for the router tests."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def mixtral(tmp_path_factory):
    from tests.worker.engine_helpers import save_tiny_checkpoint

    folder = tmp_path_factory.mktemp("mixtral") / "tiny-moe"
    folder.mkdir()
    cfg = transformers.MixtralConfig(vocab_size=1464, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=128, sliding_window=None)
    save_tiny_checkpoint(cfg, folder)
    return folder
