"""Checkpoint loading: sharded files, and clear errors naming the file for every broken input."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cotserve.common.errors import ModelLoadError  # noqa: E402
from cotserve.worker.models.loader import load_model  # noqa: E402
from tests.worker.engine_helpers import save_tiny_checkpoint  # noqa: E402

SMALL = dict(vocab_size=1464, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    save_tiny_checkpoint(transformers.LlamaConfig(**SMALL), folder)
    return folder


def broken(good, tmp_path, edit):
    folder = tmp_path / "model"
    shutil.copytree(good, folder)
    edit(folder)
    return folder


def test_sharded_checkpoint_loads_same_weights(good, tmp_path):
    sharded = tmp_path / "sharded"
    save_tiny_checkpoint(transformers.LlamaConfig(**SMALL), sharded, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    a, b = load_model(good), load_model(sharded)
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert a.eos_token_ids == frozenset({1})
    assert a.revision == b.revision or len(a.revision) == 12


def test_dtype_defaults_to_float32_on_cpu_and_can_be_overridden(good):
    assert load_model(good).model.lm_head.weight.dtype == torch.float32
    assert load_model(good, dtype=torch.bfloat16).model.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("edit,message", [
    (lambda f: (f / "config.json").unlink(), r"config.json: file not found"),
    (lambda f: (f / "config.json").write_text("{not json"), r"config.json: not valid JSON"),
    (lambda f: (f / "config.json").write_text(json.dumps({**json.loads((f / "config.json").read_text()),
                                                          "architectures": ["GPT2LMHeadModel"]})),
     r"architecture 'GPT2LMHeadModel' is not supported \(supported: DeepseekV3ForCausalLM, GptOssForCausalLM, "
     r"LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
     r"Qwen3MoeForCausalLM\)"),
    (lambda f: (f / "model.safetensors").unlink(), r"no model.safetensors or model.safetensors.index.json"),
    (lambda f: (f / "model.safetensors").write_bytes(b"garbage"), r"model.safetensors: cannot read safetensors file"),
    (lambda f: (f / "tokenizer.json").unlink(), r"tokenizer.json: file not found"),
    (lambda f: (f / "config.json").write_text(json.dumps({**json.loads((f / "config.json").read_text()),
                                                          "hidden_size": 48})),
     r"weight model.embed_tokens.weight has shape \(1464, 32\), config.json implies \(1464, 48\)"),
    (lambda f: (f / "config.json").write_text(json.dumps({**json.loads((f / "config.json").read_text()),
                                                          "num_hidden_layers": 3})),
     r"weights missing from the checkpoint: model.layers.2"),
])
def test_broken_checkpoints_fail_with_a_clear_message(good, tmp_path, edit, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(broken(good, tmp_path, edit))


def test_missing_shard_is_named(tmp_path):
    folder = tmp_path / "sharded"
    save_tiny_checkpoint(transformers.LlamaConfig(**SMALL), folder, max_shard_size="50KB")
    victim = sorted(folder.glob("model-*-of-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"lists shard {victim.name}, which is missing"):
        load_model(folder)


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="model folder not found"):
        load_model(tmp_path / "nope")


def test_a_hugging_face_cache_snapshot_loads_by_repo_id_and_is_named_after_it(good, tmp_path, monkeypatch):
    """`--model org/name` finds the snapshot `refs/main` names in the cache (HF_HUB_CACHE), and the snapshot folder
    given as a path is named after its repo id too, not its 40-hex revision."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    old, new = "a" * 40, "b" * 40
    for age, rev in ((100, old), (0, new)):
        shutil.copytree(good, repo / "snapshots" / rev)
        os.utime(repo / "snapshots" / rev, (time.time() - age, time.time() - age))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(old + "\n")  # main names the older snapshot: taken, not the newest
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    loaded = load_model("acme/tiny-llama")
    assert loaded.name == "acme/tiny-llama" and loaded.aliases == ()
    assert load_model(repo / "snapshots" / new).name == "acme/tiny-llama"
    assert load_model("acme/tiny-llama", name="tiny", aliases=("t",)).name == "tiny"
    from cotserve.worker.models.loader import resolve_checkpoint

    assert resolve_checkpoint("acme/tiny-llama")[0] == repo / "snapshots" / old
    (repo / "refs" / "main").unlink()  # no ref: the newest snapshot
    assert resolve_checkpoint("acme/tiny-llama")[0] == repo / "snapshots" / new
    with pytest.raises(ModelLoadError, match=f"acme/other: model folder not found, nor a Hugging Face repo id with a snapshot in {cache}"):
        load_model("acme/other")


def test_projections_are_fused_without_a_second_copy_and_compute_the_same(good):
    """After loading, each layer's q/k/v and gate/up run as one matrix multiply each: the checkpoint's parameters
    are slices of the fused weight (same storage, nothing held twice), hold the checkpoint's values, and the
    fused forward gives what the separate projections give."""
    from safetensors.torch import load_file

    from cotserve.worker.models.attention import DenseCausalAttention

    loaded = load_model(good)
    model = loaded.model
    saved = load_file(str(good / "model.safetensors"))
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, _ = attn.qkv
        gate_up, _ = mlp.gate_up
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert lin.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
        for lin in (mlp.gate_proj, mlp.up_proj):
            assert lin.weight.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            key = f"model.layers.{i}.{name}.weight"
            assert torch.equal(model.state_dict()[key], saved[key]), key
    assert set(model.state_dict()) >= {k for k in saved if "rotary" not in k}
    ids = torch.tensor([5, 9, 13, 200, 7, 42, 3, 11])
    positions = torch.arange(8)
    fused = model.compute_logits(model(ids, positions, DenseCausalAttention(1, 8)))
    for layer in model.model.layers:
        layer.self_attn.qkv, layer.mlp.gate_up = None, None  # back to one multiply per projection
    separate = model.compute_logits(model(ids, positions, DenseCausalAttention(1, 8)))
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)


def _fp8_copy(good, folder, block: tuple[int, int]) -> tuple:
    """`good` with every projection block-quantized to E4M3 (a float32 scale per block, `weight_scale_inv`, as
    Qwen3-FP8 and DeepSeek-V3 ship them; embeddings, LM head and norms left as they are) in `folder`, and the
    projections' dequantized values."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(good, folder)
    state, dequantized = load_file(folder / "model.safetensors"), {}
    for name in [k for k in state if k.endswith("_proj.weight")]:
        w = state[name].float()
        rows, cols = w.shape
        blocks = w.reshape(rows // block[0], block[0], cols // block[1], block[1])
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        state[name], state[name.removesuffix("weight") + "weight_scale_inv"] = q.reshape(rows, cols), scale
        dequantized[name] = (q.float() * scale[:, None, :, None]).reshape(rows, cols)
    save_file(state, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


def test_a_block_quantized_fp8_checkpoint_loads_dequantized_to_its_originals_outputs(good, tmp_path, caplog):
    """Each projection's FP8 blocks times their scales, exactly (against dequantizing by hand), and the model's
    logits close to the float32 original's (E4M3 keeps 3 mantissa bits); the startup log says the weights were
    dequantized; a scale of the wrong shape, or per-tensor FP8, is refused naming it."""
    from cotserve.worker.models.attention import DenseCausalAttention

    dequantized = _fp8_copy(good, tmp_path / "fp8", (4, 8))
    with caplog.at_level("WARNING", logger="cotserve.worker"):
        fp8 = load_model(tmp_path / "fp8")
    original = load_model(good)
    state = fp8.model.state_dict()
    for name, value in dequantized.items():
        assert torch.equal(state[name], value), name
    ids = torch.arange(3, 19)
    with torch.no_grad():
        got, want = (m.model.compute_logits(m.model(ids, torch.arange(16), DenseCausalAttention(1, 16)))
                     for m in (fp8, original))
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    assert "block-quantized FP8 weights dequantized at load" in caplog.text
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(json.dumps({**config, "quantization_config": {
        **config["quantization_config"], "weight_block_size": [8, 8]}}))
    with pytest.raises(ModelLoadError, match=r"weight_scale_inv: shape \(\d+, \d+\), expected \(\d+, \d+\) for "):
        load_model(tmp_path / "fp8")
    (tmp_path / "fp8" / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ModelLoadError, match=r"weight_block_size: None, expected \[rows, columns\]"):
        load_model(tmp_path / "fp8")


def test_weights_stream_through_one_tensor_at_a_time(good, monkeypatch):
    """Loaded in another dtype, the checkpoint's tensors are read one at a time: each is converted before the next is
    read, so memory never holds the checkpoint and the model side by side."""
    import weakref

    from cotserve.worker.models import loader
    from cotserve.worker.models.registry import architecture

    read, alive = [], []
    stream = loader.checkpoint_tensors

    def tracked(files):
        for key, tensor in stream(files):
            read.append(weakref.ref(tensor))
            yield key, tensor

    def convert(t: torch.Tensor) -> torch.Tensor:
        alive.append(sum(ref() is not None for ref in read))
        return t.to(torch.bfloat16)

    monkeypatch.setattr(loader, "checkpoint_tensors", tracked)
    cfg = loader.ModelConfig.from_file(good / "config.json")
    tensors = loader.model_tensors(good, loader.weight_files(good), architecture(cfg.architecture), cfg, convert)
    assert len(read) == len(tensors) > 10 and all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert max(alive) <= 1
