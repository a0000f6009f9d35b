"""The decoder layer's small operations in C (`cpu_native`: RMSNorm with the residual add, RoPE while splitting q/k/v,
SiLU times up) against their torch references (`layer_ops`), the choice `dispatch.layer_ops_for` makes, and a served
model with them against the same model with the references."""

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


def test_the_choice_is_c_on_the_cpu_in_float32_and_the_references_otherwise(monkeypatch):
    cpu = torch.device("cpu")
    assert layer_ops_for(cpu, torch.float32).rms_norm is cpu_native.rms_norm
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
    ids = torch.randint(3, native.config.vocab_size, (80,), generator=_gen(11))
    positions = torch.arange(40).repeat(2)
    got = native.model(ids, positions, DenseCausalAttention(2, 40))
    want = reference.model(ids, positions, DenseCausalAttention(2, 40))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    logits_got, logits_want = native.model.compute_logits(got), reference.model.compute_logits(want)
    assert torch.equal(logits_got.argmax(-1), logits_want.argmax(-1))
