"""`cotserve kv eval | calibrate` on the demo model: the table's rows, the identities that must hold
(full precision against itself, FP8's bytes), and the calibration's recommendation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cotserve.demo.arithmetic import problems
from cotserve.kveval.evaluate import CacheConfig, compare, decode_logprobs, windows_of
from cotserve.worker.models.loader import load_model
from cotserve.worker.config import DEMO_MODEL


def arithmetic_text() -> str:
    return " ".join(p.prompt + p.completion for p in problems(7, 20))


def test_teacher_forced_decode_matches_one_dense_forward():
    loaded = load_model(DEMO_MODEL, device=torch.device("cpu"))
    ids = loaded.tokenizer.encode(arithmetic_text()).ids[:80]
    paged, nbytes = decode_logprobs(loaded, ids, 50, CacheConfig("full", None))
    from cotserve.worker.models.attention import DenseCausalAttention

    with torch.inference_mode():
        x = torch.tensor(ids)
        hidden = loaded.model(x, torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
        dense = torch.log_softmax(loaded.model.compute_logits(hidden).float(), -1)[49:-1]
    assert paged.shape == dense.shape == (30, loaded.config.vocab_size)
    assert torch.allclose(paged, dense, atol=1e-4)
    assert nbytes == 4 * 2 * 3 * 64 * 4 * 16 * sum(-(-(t + 1) // 16) for t in range(50, 79)) / 29  # fp32 pages read, averaged
    ppl, ppl2, kl, agree = compare(paged, paged, torch.tensor(ids[50:]))
    assert ppl == ppl2 and kl == 0 and agree == 1


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="no Triton backend")
@pytest.mark.parametrize("cfg", [CacheConfig("fp8 + top-2", torch.float8_e4m3fn, 2), CacheConfig("fp16", torch.float16)],
                         ids=lambda c: c.name)
def test_the_worker_on_triton_kernels_gives_the_references_logits(monkeypatch, cfg):
    """The whole runner (writes, page selection, decode attention) on the Triton kernels against the
    torch references: same teacher-forced log-probabilities step by step."""
    loaded = load_model(DEMO_MODEL, device=torch.device("cpu"))
    ids = loaded.tokenizer.encode(arithmetic_text()).ids[:72]
    monkeypatch.setenv("COTSERVE_KERNELS", "reference")
    want, want_bytes = decode_logprobs(loaded, ids, 52, cfg)
    monkeypatch.setenv("COTSERVE_KERNELS", "triton")
    got, got_bytes = decode_logprobs(loaded, ids, 52, cfg)
    assert got.shape == (20, loaded.config.vocab_size) and got_bytes == want_bytes
    assert torch.allclose(got, want, atol=2e-4), (got - want).abs().max()


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip("│").split("│")]


def test_windows_are_evenly_spaced_and_topk_bytes_count_the_page_bounds():
    tokens = list(range(100))
    assert [w[0] for w in windows_of(tokens, 40, 4)] == [0, 20, 40, 60] and all(len(w) == 40 for w in windows_of(tokens, 40, 4))
    assert windows_of(tokens, 100, 3) == [tokens]
    with pytest.raises(ValueError, match="context: 101"):
        windows_of(tokens, 101, 1)
    loaded = load_model(DEMO_MODEL, device=torch.device("cpu"))
    ids = loaded.tokenizer.encode(arithmetic_text()).ids[:80]
    _, nbytes = decode_logprobs(loaded, ids, 50, CacheConfig("fp8 + top-2", torch.float8_e4m3fn, 2))
    page = 16 * 4 * 2 * 3 * (64 + 2)  # 16 tokens x 4 layers x (K, V) x 3 KV heads x (64 B payload + 2 B scale)
    bounds = 4 * 3 * 2 * 64 * 4  # per page scored: 4 layers x 3 KV heads x (min, max) x 64 x float32
    steps = [-(-(t + 1) // 16) for t in range(50, 79)]
    assert nbytes == sum(page * min(2, p) + bounds * p for p in steps) / len(steps)


def test_eval_and_calibrate_commands(tmp_path):
    (tmp_path / "t.txt").write_text(arithmetic_text())
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "kv", "eval", "--text", str(tmp_path / "t.txt"), "--context", "48,96",
                          "--eval-tokens", "8", "--windows", "3", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == 10  # 2 contexts x (full, fp8, top-k at 1/8, 1/4, 1/2)
    assert all(cells(r)[2] == "24" for r in rows)  # 3 windows x 8 decode steps pooled
    assert "full precision" in rows[0] and "+0.00%" in rows[0] and "100.0%" in rows[0] and "1.000" in rows[0]
    assert "fp8" in rows[1] and "0.258" in rows[1]  # (64 + 2) / (64 x 4) bytes per element of fp32
    too_long = subprocess.run([sys.executable, "-m", "cotserve.cli", "kv", "eval", "--text", str(tmp_path / "t.txt"),
                               "--context", "4096", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert too_long.returncode == 2 and "4096" in too_long.stderr
    cal = subprocess.run([sys.executable, "-m", "cotserve.cli", "kv", "calibrate", "--text", str(tmp_path / "t.txt"), "--context", "64",
                          "--eval-tokens", "16", "--budget", "2", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert cal.returncode == 0, cal.stderr
    lines = cal.stdout.strip().splitlines()
    assert len(lines) == 5 and all(line.startswith("layer") for line in lines[:4])
    top2 = sorted(int(line.split()[1].rstrip(":")) for line in lines[:2])
    assert lines[-1] == f"recommended: --kv-cache-dtype fp8_e4m3 --kv-skip-layers {top2[0]},{top2[1]}"


def test_the_long_context_checkpoint_is_trained_and_top_k_dense_layers_cost_less():
    """tests/fixtures/stdlib_llama (context 2048, trained on the standard library's source) on its
    held-out text: far better than chance, FP8 nearly free; keeping layers 0 and 1 dense under top-k
    reads more bytes and moves the output less."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "stdlib_llama"
    loaded = load_model(fixture, device=torch.device("cpu"))
    assert loaded.config.max_context == 2048 and loaded.config.head_dim == 64
    ids = loaded.tokenizer.encode((fixture / "eval.txt").read_text()[:20000]).ids[:384]
    full, full_bytes = decode_logprobs(loaded, ids, 352, CacheConfig("full", None))
    targets = torch.tensor(ids[352:])
    ppl, fp8_ppl, fp8_kl, _ = compare(full, decode_logprobs(loaded, ids, 352, CacheConfig("fp8", torch.float8_e4m3fn))[0], targets)
    assert ppl < 400 < loaded.config.vocab_size and abs(fp8_ppl / ppl - 1) < 0.01 and fp8_kl < 1e-3
    sparse, sparse_bytes = decode_logprobs(loaded, ids, 352, CacheConfig("k4", torch.float8_e4m3fn, 4))
    dense, dense_bytes = decode_logprobs(loaded, ids, 352, CacheConfig("k4 dense", torch.float8_e4m3fn, 4,
                                                                        topk_dense_layers=frozenset({0, 1})))
    assert sparse_bytes < dense_bytes < full_bytes
    assert compare(full, dense, targets)[2] < compare(full, sparse, targets)[2]
