"""CompiledOnCpu: warm-up compiles every variant it is shown, so serving calls never compile."""

from __future__ import annotations

import threading

import torch
from torch._dynamo.utils import counters

from cotserve.kernels.cpu_compile import CompiledOnCpu, compile_setting


def weighted_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() * w.float()).sum(-1)


def test_warm_up_compiles_each_dtype_then_calls_of_any_shape_compile_nothing_and_match_eager():
    fn = CompiledOnCpu(weighted_rows)
    with compile_setting(True):
        for dtype in (torch.float32, torch.float16):  # a second dtype is a variant of its own, compiled by warm_up too
            fn.warm_up(torch.zeros(2, 3, 5, dtype=dtype), torch.ones(5, dtype=dtype))
        compiled_frames = counters["stats"]["unique_graphs"]
        for dtype in (torch.float32, torch.float16):
            for rows in (2, 7, 33):
                x, w = torch.randn(rows, 4, 5).to(dtype), torch.randn(5).to(dtype)
                assert torch.allclose(fn(x, w), weighted_rows(x, w), atol=1e-5)
        assert counters["stats"]["unique_graphs"] == compiled_frames  # nothing compiled while "serving"
    assert fn._compiled is not None and not fn._failed


def test_calls_during_a_warm_up_run_the_eager_function():
    seen: list[bool] = []
    gate, inside = threading.Event(), threading.Event()

    def slow(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return x + 1

    fn = CompiledOnCpu(slow)
    real_compile = fn._compile

    def compile_slowly():
        inside.set()
        gate.wait(30)
        return real_compile()

    fn._compile = compile_slowly
    with compile_setting(True):
        t = threading.Thread(target=fn.warm_up, args=(torch.zeros(2, 3),))
        t.start()
        inside.wait(30)
        assert torch.equal(fn(torch.zeros(2, 3)), torch.ones(2, 3)) and seen == [False]  # eager, at once
        gate.set()
        t.join(60)
    assert fn._compiled is not None and True in seen  # the warm-up traced it
