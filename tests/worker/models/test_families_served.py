"""The new families served end to end: a worker per family (tiny random checkpoints, the demo tokenizer) behind one
gateway; through the gRPC API (the SDK) and the OpenAI HTTP API (the official client), each model's greedy tokens
are transformers' greedy tokens for the same prompt."""

from __future__ import annotations

import openai
import pytest
import torch

transformers = pytest.importorskip("transformers")

from cotserve.common.procs import free_port  # noqa: E402
from cotserve.sdk import Client  # noqa: E402
from tests.conftest import start_gateway, start_worker, stop_process  # noqa: E402
from tests.worker.engine_helpers import save_tiny_checkpoint  # noqa: E402
from tests.worker.models.test_oracle import BASE, greedy  # noqa: E402

FAMILIES = {
    "tiny-qwen3": transformers.Qwen3Config(**dict(BASE, tie_word_embeddings=True)),
    "tiny-qwen3-moe": transformers.Qwen3MoeConfig(**dict(BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                                         norm_topk_prob=True, tie_word_embeddings=False)),
    "tiny-phi3": transformers.Phi3Config(**dict(BASE, partial_rotary_factor=0.5, tie_word_embeddings=False,
                                                bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # latent attention in the paged pool, MoE with a shared expert and the grouped router
    "tiny-deepseek-v3": transformers.DeepseekV3Config(**dict(
        BASE, num_hidden_layers=2, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, head_dim=8, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        tie_word_embeddings=False)),
    # sinks, a sliding window of 8 (its own KV group: its pages freed as they leave it), MoE with clamped experts
    "tiny-gpt-oss": transformers.GptOssConfig(**dict(BASE, num_hidden_layers=2, num_local_experts=4,
                                                     num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(gateway address, HTTP base URL, {model name: transformers model}) with a worker per family."""
    models, procs, workers = {}, [], []
    try:
        for name, config in FAMILIES.items():
            folder = tmp_path_factory.mktemp("families") / name
            models[name] = save_tiny_checkpoint(config, folder, seed=len(name))
            proc, address = start_worker("--model", str(folder), "--max-num-seqs", "4")
            procs.append(proc)
            workers.append(address)
        port = free_port()
        gateway, address = start_gateway(*workers, extra=("--http-port", str(port)))
        procs.append(gateway)
        yield address, f"http://127.0.0.1:{port}/v1", models
    finally:
        for proc in reversed(procs):
            stop_process(proc)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_serves_transformers_greedy_tokens_over_grpc_and_http(served, name):
    address, base, models = served
    with Client(address) as client:
        ids = client.tokenize("12+30-7+5=", model=name)
        got = client.generate(prompt="12+30-7+5=", model=name, max_new_tokens=12, ignore_eos=True)
    expected = greedy(models[name], ids, 12)
    assert got.token_ids == expected
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60) as http:
        r = http.completions.create(model=name, prompt="12+30-7+5=", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.choices[0].text == got.text and r.usage.completion_tokens == 12
