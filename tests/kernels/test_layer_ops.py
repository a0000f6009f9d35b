"""The decoder layer's operations in C (`cpu_native`: RMSNorm with the residual add, RoPE while splitting q/k/v, SiLU
times up, the linear layers over weights stored transposed) against their torch references (`layer_ops`), the choice
`dispatch.layer_ops_for` makes, and a served model with them against the same model with the references."""

from __future__ import annotations

import pytest
import torch

from cotserve.kernels import cpu_native, layer_ops
from cotserve.kernels.dispatch import layer_ops_for
from cotserve.worker.config import DEMO_MODEL
from cotserve.worker.models.loader import load_model


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,hidden", [(1, 192), (7, 64), (33, 100), (300, 256)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_with_and_without_the_residual_matches_the_reference(rows, hidden, threads):
    """Normalized rows within float32 rounding of the reference's; the residual stream is x + residual bit for bit,
    written into the caller's residual (300 x 256 rows take the OpenMP path with two threads)."""
    g = _gen(rows + hidden)
    x, residual, weight = torch.randn(rows, hidden, generator=g) * 4, torch.randn(rows, hidden, generator=g), torch.randn(hidden, generator=g)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want, _ = layer_ops.rms_norm_ref(x, weight, 1e-5)
        got, stream = cpu_native.rms_norm(x, weight, 1e-5)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        assert stream is x
        want, want_stream = layer_ops.rms_norm_ref(x, weight, 1e-5, residual)
        mine = residual.clone()
        got, stream = cpu_native.rms_norm(x, weight, 1e-5, mine)
    finally:
        torch.set_num_threads(saved)
    assert stream is mine and torch.equal(stream, want_stream) and torch.equal(want_stream, x + residual)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def test_rms_norm_of_zeros_is_zeros_and_eps_counts():
    x, w = torch.zeros(2, 64), torch.ones(64)
    assert torch.equal(cpu_native.rms_norm(x, w, 1e-5)[0], x)
    tiny = torch.full((1, 64), 1e-4)  # mean square 1e-8, far below eps: eps decides the scale
    torch.testing.assert_close(cpu_native.rms_norm(tiny, w, 1e-2)[0], layer_ops.rms_norm_ref(tiny, w, 1e-2)[0],
                               rtol=2e-6, atol=0)


@pytest.mark.parametrize("heads,kv_heads,dim", [(3, 3, 64), (8, 2, 16), (4, 1, 128), (6, 3, 2)])
def test_rope_split_is_the_reference_bit_for_bit(heads, kv_heads, dim):
    """q, k and v from the fused projection's output, RoPE on q and k at positions up to 100k: every float the
    reference's (products rounded before they are summed, as its separate torch operations round)."""
    from cotserve.worker.models.config import RopeConfig
    from cotserve.worker.models.llama import RotaryEmbedding

    g = _gen(heads * dim)
    n = 37
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g) * 3
    positions = torch.cat([torch.arange(30), torch.tensor([255, 4096, 65535, 99999, 7, 0, 1])])
    cos, sin = RotaryEmbedding(RopeConfig(theta=10000.0), dim).cos_sin(positions, torch.float32)
    want = layer_ops.rope_split_ref(qkv, cos, sin, heads, kv_heads, dim)
    got = cpu_native.rope_split(qkv, cos, sin, heads, kv_heads, dim)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.is_contiguous() and torch.equal(a, b)


def test_silu_mul_matches_the_reference_over_the_exponentials_range():
    """Gates from -120 to 120 (where exp(-gate) underflows and overflows), zeros and NaN: within two ulp of torch's,
    NaN where torch gives NaN."""
    gate = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 87.5, -87.5])])
    gate = torch.cat([gate, torch.randn(3000, generator=_gen(5)) * 3])
    up = torch.randn(gate.numel(), generator=_gen(6))
    gate_up = torch.cat([gate, up]).view(1, -1)
    want, got = layer_ops.silu_mul_ref(gate_up), cpu_native.silu_mul(gate_up)
    torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-30)
    nan = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]])
    assert torch.isnan(cpu_native.silu_mul(nan)).tolist() == [[True, False]]
    rows = torch.randn(5, 2 * 448, generator=_gen(7)) * 4  # several rows: each row's own gate and up
    torch.testing.assert_close(cpu_native.silu_mul(rows), layer_ops.silu_mul_ref(rows), rtol=3e-7, atol=1e-30)


def test_inputs_the_c_does_not_take_run_the_references():
    """float64, bfloat16, a transposed (non-contiguous) input, mismatched shapes: the reference's result, exactly."""
    g = _gen(9)
    x64, w64 = torch.randn(4, 64, dtype=torch.float64, generator=g), torch.randn(64, dtype=torch.float64, generator=g)
    assert torch.equal(cpu_native.rms_norm(x64, w64, 1e-5)[0], layer_ops.rms_norm_ref(x64, w64, 1e-5)[0])
    xt = torch.randn(64, 4, generator=g).t()
    assert torch.equal(cpu_native.rms_norm(xt, torch.ones(64), 1e-5)[0], layer_ops.rms_norm_ref(xt, torch.ones(64), 1e-5)[0])
    gu = torch.randn(3, 8, generator=g).bfloat16()
    assert torch.equal(cpu_native.silu_mul(gu), layer_ops.silu_mul_ref(gu))
    qkv, cos = torch.randn(2, 6 * 4, generator=g), torch.randn(2, 4, generator=g)
    wide_cos = torch.randn(2, 8, generator=g)  # not [tokens, dim]: the reference's broadcasting decides (and fails)
    for a, b in zip(cpu_native.rope_split(qkv, cos, cos, 2, 2, 4), layer_ops.rope_split_ref(qkv, cos, cos, 2, 2, 4)):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError):
        cpu_native.rope_split(qkv, wide_cos, wide_cos, 2, 2, 4)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32, 64, 256, 1031])
@pytest.mark.parametrize("out_features,in_features", [(192, 192), (1464, 192), (7, 33), (80, 448)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_over_a_transposed_weight_matches_f_linear(rows, out_features, in_features, threads):
    """Every tile shape (rows 6, 4, 2, 1 and their mixes; 1-4 vectors of 16 columns, a tail of single columns: 1464 is
    22 spans of 64 and 56 columns, 7 is a tail alone), with a bias and without, one and two threads (192 columns are 3
    spans: two threads split the rows too), up to 1031 rows (a prefill chunk): F.linear's result within float32
    rounding (the sums go in another order)."""
    g = _gen(rows * 7 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=g)
    weight, bias = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    stored = layer_ops.store_transposed(weight)
    assert torch.equal(stored, weight) and cpu_native.transposed(stored) and not cpu_native.transposed(weight)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (bias, None):
            got = cpu_native.linear(x, stored, b)
            assert got.shape == (rows, out_features) and got.is_contiguous()
            # sums of up to 448 unit-sized products in another order: float32 rounding of ~1e-5 relative to the sum
            torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(saved)
    assert cpu_native.linear(x[:0], stored, bias).shape == (0, out_features)


def test_linear_runs_f_linear_where_the_c_does_not_apply(monkeypatch):
    """A weight stored as loaded (not transposed), float64, a non-contiguous input, more rows than LINEAR_MAX_ROWS, a
    batch of rows in 3 dimensions (C: the rows flattened): F.linear's result, exactly where F.linear runs."""
    g = _gen(5)
    x, weight = torch.randn(9, 48, generator=g), torch.randn(20, 48, generator=g)
    calls = []
    real = cpu_native.library().cotserve_linear
    monkeypatch.setattr(cpu_native.library(), "cotserve_linear", lambda *a: calls.append(a) or real(*a))
    assert torch.equal(cpu_native.linear(x, weight), torch.nn.functional.linear(x, weight)) and not calls
    w64 = layer_ops.store_transposed(weight.double())
    assert torch.equal(cpu_native.linear(x.double(), w64), torch.nn.functional.linear(x.double(), w64)) and not calls
    stored = layer_ops.store_transposed(weight)
    xt = torch.randn(48, 9, generator=g).t()
    assert torch.equal(cpu_native.linear(xt, stored), torch.nn.functional.linear(xt, stored)) and not calls
    monkeypatch.setattr(cpu_native, "LINEAR_MAX_ROWS", 8)
    assert torch.equal(cpu_native.linear(x, stored), torch.nn.functional.linear(x, stored)) and not calls
    monkeypatch.setattr(cpu_native, "LINEAR_MAX_ROWS", 4096)
    x3 = torch.randn(2, 3, 48, generator=g)
    got = cpu_native.linear(x3, stored)
    assert len(calls) == 1 and got.shape == (2, 3, 20)
    torch.testing.assert_close(got, torch.nn.functional.linear(x3, weight), rtol=1e-5, atol=2e-5)


def test_the_choice_is_c_on_the_cpu_in_float32_and_the_references_otherwise(monkeypatch):
    cpu = torch.device("cpu")
    native = layer_ops_for(cpu, torch.float32)
    assert native.rms_norm is cpu_native.rms_norm and native.linear is cpu_native.linear and native.transposed_weights
    assert layer_ops.REFERENCE_OPS.linear is torch.nn.functional.linear and not layer_ops.REFERENCE_OPS.transposed_weights
    assert layer_ops_for(cpu, torch.bfloat16) is layer_ops.REFERENCE_OPS
    assert layer_ops_for(torch.device("cuda"), torch.float32) is layer_ops.REFERENCE_OPS
    monkeypatch.setenv("COTSERVE_LAYER_OPS", "reference")
    assert layer_ops_for(cpu, torch.float32) is layer_ops.REFERENCE_OPS
    monkeypatch.setenv("COTSERVE_LAYER_OPS", "auto")
    monkeypatch.setenv("COTSERVE_KERNELS", "reference")
    assert layer_ops_for(cpu, torch.float32) is layer_ops.REFERENCE_OPS
    monkeypatch.setenv("COTSERVE_LAYER_OPS", "fast")
    with pytest.raises(ValueError, match=r"COTSERVE_LAYER_OPS: 'fast', allowed auto, reference"):
        layer_ops_for(cpu, torch.float32)


@torch.inference_mode()
def test_the_demo_model_serves_the_same_with_the_c_operations(monkeypatch):
    """The loader gives a float32 CPU model the C operations; a prefill of 40 tokens and its hidden states match the
    same checkpoint run on the references (float32 rounding), with the same greedy token at every position."""
    from cotserve.worker.models.attention import DenseCausalAttention

    native = load_model(DEMO_MODEL)
    monkeypatch.setenv("COTSERVE_LAYER_OPS", "reference")
    reference = load_model(DEMO_MODEL)
    assert native.model.model.norm.ops.name == "cpu-native" and reference.model.model.norm.ops is layer_ops.REFERENCE_OPS
    served, loaded = native.model, reference.model
    for name, param in loaded.named_parameters():  # the same values; the dense weights stored transposed when served
        assert torch.equal(dict(served.named_parameters())[name], param), name
    layer = served.model.layers[0]
    for weight in (layer.self_attn.qkv[0], layer.self_attn.o_proj.weight, layer.mlp.gate_up[0], layer.mlp.down_proj.weight,
                   served.lm_head.weight):
        assert cpu_native.transposed(weight)
    assert served.model.embed_tokens.weight is served.lm_head.weight  # still tied
    assert layer.self_attn.q_proj.weight.data_ptr() == layer.self_attn.qkv[0].data_ptr()  # a view, nothing stored twice
    assert not cpu_native.transposed(loaded.model.layers[0].self_attn.o_proj.weight)
    ids = torch.randint(3, native.config.vocab_size, (80,), generator=_gen(11))
    positions = torch.arange(40).repeat(2)
    got = native.model(ids, positions, DenseCausalAttention(2, 40))
    want = reference.model(ids, positions, DenseCausalAttention(2, 40))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    logits_got, logits_want = native.model.compute_logits(got), reference.model.compute_logits(want)
    assert torch.equal(logits_got.argmax(-1), logits_want.argmax(-1))
