"""`--kv-cache-dtype`: every setting serves through the gateway; FP8 pages take about a quarter of
fp32's bytes and keep the demo model's accuracy."""

# In-process workers here run their engine as a thread (engine_process=False): these tests are about the KV cache formats, not
# the engine process boundary, which tests/worker/test_engine_process.py and every CLI-started worker cover;
# a second interpreter importing torch per worker would add about 2 s to each start.

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest
import torch

from cotserve.common.procs import free_port
from cotserve.gateway.server import GatewayConfig, start_gateway
from cotserve.sdk import AsyncClient
from cotserve.demo.arithmetic import problems
from cotserve.demo.evaluate import evaluate
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import start_worker as start_worker_process
from tests.conftest import stop_process
from tests.demo.test_demo_model import FIXED_SAMPLE_SEED


def test_every_kv_cache_dtype_serves_through_the_gateway():
    async def main():
        seen = {}
        for name in ("auto", "fp32", "fp16", "bf16", "fp8_e4m3"):
            worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4, kv_cache_dtype=name, kv_cache_bytes=8_000_000))
            gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address]))
            try:
                async with AsyncClient(gateway.server.address) as client:
                    r = await client.generate("37+48-12=", max_new_tokens=32, temperature=0.0)
                async with grpc.aio.insecure_channel(worker.server.address) as ch:
                    info = await worker_pb2_grpc.WorkerServiceStub(ch).Info(worker_pb2.InfoRequest())
                seen[name] = (r.text, info.kv_cache.dtype, info.kv_cache.bytes_per_token, info.kv_cache.total_blocks)
            finally:
                await gateway.stop()
                await worker.stop()
        return seen

    seen = asyncio.run(main())
    assert {text for text, *_ in seen.values()} == {"<think>37+48=85. 85-12=73.</think> 73"}
    assert {n: d for n, (_, d, _, _) in seen.items()} == {"auto": "float32", "fp32": "float32", "fp16": "float16",
                                                          "bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn"}
    fp32_bytes, fp8_bytes = seen["fp32"][2], seen["fp8_e4m3"][2]
    assert fp32_bytes == 4 * 2 * 3 * 64 * 4  # layers x (K, V) x kv heads x head_dim x 4 bytes
    assert fp8_bytes == 4 * 2 * 3 * (64 + 2)  # one byte per element + an fp16 scale per token and head
    assert fp8_bytes / fp32_bytes <= 0.27 and fp8_bytes / seen["bf16"][2] <= 0.53
    assert seen["fp8_e4m3"][3] >= 3.5 * seen["fp32"][3]  # the same budget holds 3.8x the blocks


def test_unknown_kv_cache_dtype_is_a_clear_start_up_error():
    with pytest.raises(ValueError, match="kv_cache_dtype: 'int4', allowed: auto, fp8_e4m3, fp16, bf16, fp32"):
        WorkerConfig(kv_cache_dtype="int4").validate()


def test_fp8_cache_keeps_the_demo_models_accuracy(demo_worker):
    sample = problems(FIXED_SAMPLE_SEED, 50)
    full = asyncio.run(evaluate(demo_worker, sample=sample, concurrency=16))
    proc, address = start_worker_process("--kv-cache-dtype", "fp8_e4m3", "--max-num-seqs", "32")
    try:
        fp8 = asyncio.run(evaluate(address, sample=sample, concurrency=16))
    finally:
        stop_process(proc)
    assert fp8.total == 50 and fp8.correct >= full.correct - 1, (full.correct, fp8.correct, fp8.wrong[:5])


def test_topk_pages_serve_and_read_everything_when_a_sequence_is_short():
    async def main():
        texts = {}
        for dtype, topk, dense in (("auto", 0, ()), ("auto", 8, ()), ("fp8_e4m3", 8, ()), ("auto", 2, ()), ("fp8_e4m3", 2, ()),
                                   ("auto", 2, (0, 1, 2, 3))):
            worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4, kv_cache_dtype=dtype, kv_topk_pages=topk,
                                                     kv_cache_bytes=8_000_000, block_size=4, kv_topk_dense_layers=dense))
            gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address]))
            try:
                async with AsyncClient(gateway.server.address) as client:
                    r = await client.generate("12+30-7+5=", max_new_tokens=40, temperature=0.0)
                texts[(dtype, topk) if not dense else "all dense"] = (r.text, r.usage.completion_tokens)
            finally:
                await gateway.stop()
                await worker.stop()
        return texts

    texts = asyncio.run(main())
    want = texts[("auto", 0)]
    assert want[0] == "<think>12+30=42. 42-7=35. 35+5=40.</think> 40"
    # 8 pages of 4 tokens hold the whole sequence: top-k reads everything and changes nothing
    assert texts[("auto", 8)] == want and texts[("fp8_e4m3", 8)] == want
    # 2 pages (the first and the current one) of a ~30-token sequence: sparse, but it still serves
    assert texts[("auto", 2)][1] > 0 and texts[("fp8_e4m3", 2)][1] > 0
    assert texts["all dense"] == want  # --kv-topk-dense-layers naming every layer: nothing is sparse
    with pytest.raises(ValueError, match="kv_topk_dense_layers: only with --kv-topk-pages > 0"):
        WorkerConfig(kv_topk_dense_layers=(0,)).validate()
    with pytest.raises(ValueError, match="kv_topk_pages: 1, must be 0 \\(off\\) or >= 2"):
        WorkerConfig(kv_topk_pages=1).validate()


def test_skip_layers_keep_their_cache_at_full_precision():
    async def main():
        # the engine in this process, so that the test can look at its runner's caches
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4, kv_cache_dtype="fp8_e4m3",
                                                 kv_skip_layers=(0, 3), kv_cache_bytes=8_000_000))
        try:
            caches = worker.engine.runner.caches
            assert [c.k.dtype for c in caches] == [torch.float32, torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32]
            assert [c.k_scale is not None for c in caches] == [False, True, True, False]
            assert worker.engine.kv_spec.skip_layers == {0, 3}
            assert worker.engine.kernels == "cpu-native kernels, cpu-native layer ops"  # in the SERVING line
            async with grpc.aio.insecure_channel(worker.server.address) as ch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)
                info = await stub.Info(worker_pb2.InfoRequest())
                text = "".join([c.text async for c in stub.Generate(worker_pb2.GenerateRequest(prompt_text="37+48-12="))])
            return info.kv_cache.bytes_per_token, text
        finally:
            await worker.stop()

    per_token, text = asyncio.run(main())
    assert per_token == 2 * 2 * 3 * 64 * 4 + 2 * 2 * 3 * 66  # two fp32 layers, two FP8 layers with their scales
    assert text == "<think>37+48=85. 85-12=73.</think> 73"
    with pytest.raises(ValueError, match="kv_skip_layers: only with --kv-cache-dtype fp8_e4m3"):
        WorkerConfig(kv_skip_layers=(0,)).validate()
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "serve", "worker", "--port", str(free_port()),
                          "--kv-cache-dtype", "fp8_e4m3", "--kv-skip-layers", "1,7"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "kv_skip_layers: [7] out of range, the model's layers are 0..3" in out.stderr


def test_stats_report_the_kv_bytes_in_use():
    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4, kv_cache_dtype="fp8_e4m3", kv_topk_pages=2,
                                                 kv_cache_bytes=2_000_000))
        try:
            async with grpc.aio.insecure_channel(worker.server.address) as ch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)
                info = await stub.Info(worker_pb2.InfoRequest())
                during = None
                # long enough that the request still holds its blocks when the Stats call arrives, however loaded
                request = worker_pb2.GenerateRequest(prompt_text="37+48-12+5-9+11=",
                                                     sampling={"max_new_tokens": 200, "ignore_eos": True})
                async for _ in stub.Generate(request):
                    if during is None:
                        during = await stub.Stats(worker_pb2.StatsRequest())
                for _ in range(50):
                    after = await stub.Stats(worker_pb2.StatsRequest())
                    if after.kv_blocks_used == 0:
                        break
                    await asyncio.sleep(0.05)
            return info.kv_cache, during, after
        finally:
            await worker.stop()

    kv, during, after = asyncio.run(main())
    block = kv.block_size_tokens * kv.bytes_per_token + 4 * 3 * 2 * 64 * 4  # + the page key min/max top-k scores with
    assert during.kv_blocks_used > 0 and during.kv_bytes_used == during.kv_blocks_used * block
    assert during.kv_bytes_total == kv.total_blocks * block <= 2_000_000 < (kv.total_blocks + 1) * block
    assert after.kv_blocks_used == 0 and after.kv_bytes_used == 0 and after.kv_bytes_total == during.kv_bytes_total
