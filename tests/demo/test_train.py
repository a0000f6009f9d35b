"""The demo training script is seeded and reproducible and writes a loadable checkpoint."""

from __future__ import annotations

from cotserve.demo.train import main as train
from cotserve.worker.models.loader import load_model


def test_same_seed_same_weights_and_the_output_loads(tmp_path):
    args = ["--steps", "3", "--batch-size", "4", "--eval-every", "1000", "--eval-problems", "1", "--threads", "1"]
    train(["--out", str(tmp_path / "a"), *args])
    train(["--out", str(tmp_path / "b"), *args])
    train(["--out", str(tmp_path / "c"), *args, "--seed", "1"])
    a, b, c = ((tmp_path / x / "model.safetensors").read_bytes() for x in "abc")
    assert a == b and a != c
    loaded = load_model(tmp_path / "a")
    assert loaded.config.architecture == "LlamaForCausalLM" and loaded.eos_token_ids == frozenset({1})
