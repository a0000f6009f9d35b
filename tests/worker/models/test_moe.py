"""The MoE block's routing policy: bias for choice only, disabled experts, load counts."""

from __future__ import annotations

import pytest
import torch

from cotserve.worker.models.config import ModelConfig
from cotserve.worker.models.moe import LayerRouting, RoutingPolicy, SparseMoeBlock


def make_block(num_experts=4, top_k=2, seed=0) -> SparseMoeBlock:
    cfg = ModelConfig.from_dict({
        "architectures": ["MixtralForCausalLM"], "vocab_size": 16, "hidden_size": 8, "intermediate_size": 12,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_local_experts": num_experts,
        "num_experts_per_tok": top_k,
    })
    torch.manual_seed(seed)
    block = SparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return block


def reference(block: SparseMoeBlock, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Weights from the unbiased softmax, renormalized over the given experts per token."""
    probs = torch.softmax(block.gate(x), dim=-1)
    w = probs.gather(-1, chosen)
    w = w / w.sum(-1, keepdim=True)
    return torch.stack([sum(w[t, j] * block.experts[int(chosen[t, j])](x[t]) for j in range(chosen.shape[1]))
                        for t in range(x.shape[0])])


def test_empty_policy_is_plain_mixtral_routing():
    block = make_block()
    x = torch.randn(10, 8)
    with torch.no_grad():
        top = torch.topk(torch.softmax(block.gate(x), -1), 2).indices
        torch.testing.assert_close(block(x), reference(block, x, top))
    assert block.load.sum() == 20


def test_bias_steers_the_choice_but_not_the_weights():
    block = make_block()
    x = torch.randn(12, 8)
    block.set_routing(LayerRouting(bias=(0.0, 0.0, 100.0, 100.0)), top_k=0)
    with torch.no_grad():
        out = block(x)
        expected = reference(block, x, torch.tensor([[2, 3]] * 12))
    torch.testing.assert_close(out, expected)
    assert block.load.tolist() == [0, 0, 12, 12]


def test_disabled_experts_are_never_chosen_and_top_k_can_change():
    block = make_block()
    block.set_routing(LayerRouting(disabled=frozenset({0, 1})), top_k=1)
    with torch.no_grad():
        block(torch.randn(50, 8))
    assert block.load[0] == 0 and block.load[1] == 0 and block.load.sum() == 50


MOE_FAMILIES = {  # each MoE family's tiny config: its MoE layers, as the policy and the load name them
    "mixtral": (lambda t: t.MixtralConfig(vocab_size=1464, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                          num_experts_per_tok=2, max_position_embeddings=64, sliding_window=None), (0, 1)),
    "qwen3-moe": (lambda t: t.Qwen3MoeConfig(vocab_size=1464, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1],
                                             max_position_embeddings=64), (0, 2)),
    "deepseek-v3": (lambda t: t.DeepseekV3Config(vocab_size=1464, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                                                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, head_dim=4,
                                                 n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                                 moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
                                                 max_position_embeddings=64), (1, 2)),
    "gpt-oss": (lambda t: t.GptOssConfig(vocab_size=1464, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                         num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64), (0, 1)),
}


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_model_applies_a_policy_to_all_layers_and_reports_load(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    from cotserve.worker.models.attention import DenseCausalAttention
    from cotserve.worker.models.loader import load_model
    from tests.worker.engine_helpers import save_tiny_checkpoint

    make, (first, second) = MOE_FAMILIES[family]
    save_tiny_checkpoint(make(transformers), tmp_path)
    lm = load_model(tmp_path)
    ids = torch.arange(3, 19)

    def run():
        with torch.no_grad():
            return lm.model(ids, torch.arange(16), DenseCausalAttention(1, 16))

    base = run()
    assert {k: sum(v) for k, v in lm.model.take_expert_load().items()} == {first: 32, second: 32}
    lm.model.set_routing_policy(RoutingPolicy(version=3, layers={first: LayerRouting(disabled=frozenset({0, 1, 2})),
                                                                 second: LayerRouting(disabled=frozenset({3}))}, top_k=1))
    steered = run()
    load = lm.model.take_expert_load()
    assert load[first] == [0, 0, 0, 16] and load[second][3] == 0 and sum(load[second]) == 16
    assert not torch.allclose(base, steered)
    lm.model.set_routing_policy(RoutingPolicy())
    torch.testing.assert_close(run(), base)


def test_engine_applies_newer_policies_between_steps_only(tmp_path):
    transformers = pytest.importorskip("transformers")
    from cotserve.worker.engine import Engine
    from cotserve.worker.engine_config import EngineConfig
    from cotserve.worker.models.loader import load_model
    from cotserve.worker.sequence import SamplingParams
    from tests.worker.engine_helpers import run_engine, save_tiny_checkpoint

    cfg = transformers.MixtralConfig(vocab_size=1464, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, sliding_window=None)
    save_tiny_checkpoint(cfg, tmp_path)
    engine = Engine(load_model(tmp_path), EngineConfig(num_blocks=32, block_size=8, max_model_len=64))
    prompt = list(range(3, 11))
    base = run_engine(engine, [prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    take_load = engine.loaded.model.take_expert_load
    take_load()
    only_three = RoutingPolicy(version=2, layers={i: LayerRouting(disabled=frozenset({0, 1, 2})) for i in (0, 1)}, top_k=1)
    engine.set_routing_policy(only_three)
    engine.set_routing_policy(RoutingPolicy(version=1))  # older: ignored
    assert engine.policy_version == 0  # nothing applied until the engine thread drains its inbox
    steered = run_engine(engine, [prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    assert engine.policy_version == 2 and engine.stats().moe_policy_version == 2
    assert all(load[:3] == [0, 0, 0] for load in take_load().values())
    assert steered != base


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_a_live_policy_computes_what_transformers_does_with_the_same_bias(tmp_path, family):
    """A policy's per-expert bias (choosing only: the weights stay the unbiased softmax's) and a narrower top-k,
    applied by the model, against transformers with each MoE layer's router choosing the same way: the same logits."""
    transformers = pytest.importorskip("transformers")
    from cotserve.worker.models.attention import DenseCausalAttention
    from cotserve.worker.models.loader import load_model
    from tests.worker.engine_helpers import save_tiny_checkpoint

    make, layers = MOE_FAMILIES[family]
    hf = save_tiny_checkpoint(make(transformers), tmp_path, seed=3)
    lm = load_model(tmp_path)
    biases = {layers[0]: [2.0, -1.0, 0.5, 0.0], layers[1]: [0.0, 0.0, -3.0, 1.5]}
    lm.model.set_routing_policy(RoutingPolicy(version=1, layers={i: LayerRouting(bias=b) for i, b in biases.items()},
                                              top_k=1))
    renormalize = getattr(hf.config, "norm_topk_prob", True)
    routers = [m for m in hf.modules() if type(m).__name__.lower().endswith("topkrouter")]
    assert len(routers) == len(layers)
    for router, layer in zip(routers, layers):
        bias = torch.tensor(biases[layer])

        def choose(hidden, router=router, bias=bias):  # what the policy does, in transformers' router
            logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight,
                                                getattr(router, "bias", None))
            if family == "deepseek-v3":  # sigmoid scores; the checkpoint's choice bias and the policy's add up
                scores = logits.float().sigmoid()
                choice = (scores + router.e_score_correction_bias + bias).view(-1, 2, 2)
                best = choice.topk(2, dim=-1).values.sum(-1).argmax(-1)  # topk_group 1 of n_group 2
                choice = choice.masked_fill(torch.arange(2)[None, :, None] != best[:, None, None], float("-inf"))
                chosen = choice.view(-1, 4).topk(1, dim=-1).indices
                weights = scores.gather(1, chosen)
                return logits, weights / (weights.sum(-1, keepdim=True) + 1e-20) * router.routed_scaling_factor, chosen
            chosen = torch.topk(logits.float() + bias, 1, dim=-1).indices
            if family == "gpt-oss":  # its router: a softmax over the chosen experts' own logits
                return logits, torch.softmax(logits.gather(-1, chosen), dim=-1), chosen
            weights = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
            if renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen

        router.forward = choose
    ids = torch.arange(3, 19)
    with torch.no_grad():
        ours = lm.model.compute_logits(lm.model(ids, torch.arange(16), DenseCausalAttention(1, 16)))
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
