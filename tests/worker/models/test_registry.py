"""The architecture registry: a family is a module that registers its name, its config fields, its model and its
checkpoint's weight names; the loader asks the registry and nothing else. A toy family, registered here, whose
checkpoint names its weights its own way loads and computes what the Llama checkpoint it was renamed from does."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from cotserve.common.errors import ModelLoadError  # noqa: E402
from cotserve.worker.models import registry  # noqa: E402
from cotserve.worker.models.architectures.llama import biases, build  # noqa: E402
from cotserve.worker.models.loader import load_model  # noqa: E402
from tests.worker.engine_helpers import save_tiny_checkpoint  # noqa: E402

SMALL = dict(vocab_size=1464, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


def test_every_served_family_is_registered_and_an_unknown_one_is_named():
    assert set(registry.supported()) >= {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                         "MixtralForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                         "Phi3ForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM"}
    with pytest.raises(ModelLoadError, match=r"x.json: architecture 'Nope' is not supported \(supported: DeepseekV3"):
        registry.architecture("Nope", "x.json")
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.architecture("LlamaForCausalLM"))


def test_a_family_with_its_own_weight_names_loads_through_the_registry(tmp_path):
    llama_dir, toy_dir = tmp_path / "llama", tmp_path / "toy"
    save_tiny_checkpoint(transformers.LlamaConfig(**SMALL), llama_dir)
    toy_dir.mkdir()
    for f in llama_dir.iterdir():
        if f.name == "model.safetensors":  # the toy's checkpoint: "transformer." where Llama says "model."
            save_file({k.replace("model.", "transformer.", 1): v for k, v in load_file(f).items()}, toy_dir / f.name)
        elif f.name == "config.json":
            (toy_dir / f.name).write_text(json.dumps({**json.loads(f.read_text()), "architectures": ["ToyForCausalLM"]}))
        else:
            (toy_dir / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ModelLoadError, match="'ToyForCausalLM' is not supported"):
        load_model(toy_dir)
    toy = registry.Architecture("ToyForCausalLM", biases(False, False, False), build,
                                weight_name=lambda name: name.replace("transformer.", "model.", 1))
    registry.register(toy)
    try:
        ours, theirs = load_model(toy_dir), load_model(llama_dir)
        assert ours.config.architecture == "ToyForCausalLM"
        ids = torch.tensor([[0, 5, 9, 12, 7]])
        with torch.no_grad():
            a = theirs.model.compute_logits(theirs.model.model.embed_tokens(ids[0]))
            b = ours.model.compute_logits(ours.model.model.embed_tokens(ids[0]))
        assert torch.equal(a, b)
        assert all(torch.equal(p, q) for p, q in zip(ours.model.state_dict().values(), theirs.model.state_dict().values()))
    finally:
        registry._REGISTRY.pop("ToyForCausalLM")
