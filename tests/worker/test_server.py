"""The worker end to end: a real `cotserve serve worker` process, spoken to over gRPC."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cotserve.common.v1 import common_pb2
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import free_port, start_worker, stop_process, wait_worker_idle


@pytest.fixture
def stub(demo_worker):
    with grpc.insecure_channel(demo_worker) as ch:
        yield worker_pb2_grpc.WorkerServiceStub(ch)


def gen(prompt: str = "", **sampling) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(prompt_text=prompt, sampling=common_pb2.SamplingParams(**sampling))


def test_health_and_reflection(demo_worker):
    with grpc.insecure_channel(demo_worker) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "cotserve.worker.v1.WorkerService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        (resp,) = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        names = {s.name for s in resp.list_services_response.service}
        assert {"cotserve.worker.v1.WorkerService", "grpc.health.v1.Health"} <= names


def test_info_describes_model_and_cache(stub):
    info = stub.Info(worker_pb2.InfoRequest())
    assert (info.model_name, info.architecture, info.dtype, info.device) == ("cotserve-demo", "LlamaForCausalLM", "float32", "cpu")
    assert info.vocab_size == 1464 and info.max_context_tokens == 256 and len(info.model_revision) == 12
    assert info.kv_cache.dtype == "float32" and info.kv_cache.block_size_tokens == 16
    assert info.kv_cache.bytes_per_token == 2 * 4 * 3 * 64 * 4  # K+V, 4 layers, 3 KV heads, head_dim 64, fp32
    assert info.kv_cache.total_blocks == 32 * 16  # capped at max_num_seqs full-length sequences


def test_streaming_generate(stub):
    chunks = list(stub.Generate(gen("37+48-12=", max_new_tokens=64)))
    assert "".join(c.text for c in chunks) == "<think>37+48=85. 85-12=73.</think> 73"
    last = chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert last.usage.prompt_tokens == 6 and last.usage.completion_tokens == sum(len(c.token_ids) for c in chunks)
    assert 0 <= last.timing.queue_ms <= last.timing.ttft_ms <= last.timing.total_ms
    assert chunks[0].timing.ttft_ms > 0


def test_prompt_token_ids_logprobs_and_length(stub):
    ids = stub.Tokenize(worker_pb2.TokenizeRequest(text="37+48-12=", add_special_tokens=True)).token_ids
    req = worker_pb2.GenerateRequest(prompt_token_ids=ids, sampling=common_pb2.SamplingParams(max_new_tokens=4, logprobs=True))
    chunks = list(stub.Generate(req))
    assert "".join(c.text for c in chunks) == "<think>37+48"  # <think>, 37, +, 48
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert all(len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs) for c in chunks)
    assert sum(len(c.logprobs) for c in chunks) == 4


def test_tokenize(stub):
    resp = stub.Tokenize(worker_pb2.TokenizeRequest(text="85-12=", add_special_tokens=True))
    assert list(resp.tokens) == ["<s>", "85", "-12", "="]
    assert len(resp.token_ids) == 4


BAD = [
    (gen("1+1=", max_new_tokens=-1), "sampling.max_new_tokens: -1 is out of range (1..256)"),
    (gen("1+1=", max_new_tokens=100000), "sampling.max_new_tokens: 100000 is out of range (1..256)"),
    (gen("1+1=", temperature=3.0), "sampling.temperature: 3.0 is out of range (0..2)"),
    (gen("1+1=", temperature=float("nan")), "sampling.temperature: nan is out of range (0..2)"),
    (gen("1+1=", top_p=0.0), "sampling.top_p: 0.0 is out of range (0 < top_p <= 1)"),
    (gen("1+1=", top_k=-2), "sampling.top_k: -2 is out of range (0..1464, 0 = off)"),
    (gen("1+1=", stop=["a"] * 9), "sampling.stop: 9 strings, at most 8 allowed"),
    (gen("1+1=", stop_token_ids=[5000]), "sampling.stop_token_ids: 5000 is out of range (0..1463)"),
    (gen(""), "prompt_text / prompt_token_ids / messages: the prompt is empty"),
    (worker_pb2.GenerateRequest(prompt_text="1", prompt_token_ids=[1]), "prompt_text, prompt_token_ids and messages: set exactly one"),
    (worker_pb2.GenerateRequest(prompt_text="1", messages=[common_pb2.ChatMessage(role="user", content="1")]),
     "prompt_text, prompt_token_ids and messages: set exactly one"),
    (worker_pb2.GenerateRequest(prompt_token_ids=[1, 99999]), "prompt_token_ids: token 99999 is out of range (0..1463)"),
    (gen("1+" * 200), "prompt: 401 tokens is over the model's context (prompt must be at most 255 tokens"),
    (worker_pb2.GenerateRequest(prompt_text="1+1=", sla_class=42), "sla_class: unknown value 42 (allowed: REALTIME, INTERACTIVE, BATCH)"),
]


@pytest.mark.parametrize("request_,message", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_input_is_invalid_argument_naming_the_field(stub, demo_worker, request_, message):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    wait_worker_idle(demo_worker)


def test_cancel_midway_frees_the_blocks(stub, demo_worker):
    call = stub.Generate(gen("1+2+3=", max_new_tokens=250, ignore_eos=True))
    got = [next(call) for _ in range(3)]
    assert len(got) == 3
    assert stub.Stats(worker_pb2.StatsRequest()).kv_blocks_used > 0
    call.cancel()
    stats = wait_worker_idle(demo_worker)
    assert stats.kv_blocks_free == 32 * 16


def test_deadline_exceeded_frees_the_blocks(stub, demo_worker):
    # 250 tokens take at least ~0.25 s at batch 1 on 2 cores (a decode step ~1 ms), the first ~6 ms: the deadline
    # falls mid-generation
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(gen("1+2+3=", max_new_tokens=250, ignore_eos=True), timeout=0.05))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_worker_idle(demo_worker)


def test_concurrent_streams_and_stats(stub, demo_worker):
    results: dict[int, str] = {}

    def one(i: int) -> None:
        results[i] = "".join(c.text for c in stub.Generate(gen(f"{i}+{i}=", max_new_tokens=32)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {i: r for i, r in results.items()} == {i: f"<think>{i}+{i}={2 * i}.</think> {2 * i}" for i in range(12)}
    stats = wait_worker_idle(demo_worker)
    assert stats.num_requests_finished_total >= 12
    assert stats.step_latency_p50_ms > 0 and stats.step_latency_p95_ms >= stats.step_latency_p50_ms
    assert stats.generated_tokens_per_s > 0
    assert stats.utilization_is_cpu and 0 <= stats.utilization <= 1 and stats.memory_used_bytes > 50_000_000  # torch alone


def test_paused_batch_sits_out_while_interactive_runs_and_loses_nothing(stub, demo_worker):
    with pytest.raises(grpc.RpcError) as err:
        stub.PauseBatch(worker_pb2.PauseBatchRequest(duration_ms=60_001))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "duration_ms: 60001, allowed 0..60000" in err.value.details()
    before = stub.Stats(worker_pb2.StatsRequest()).batch_paused_steps_total
    batch = stub.Generate(worker_pb2.GenerateRequest(prompt_text="1+2=", sla_class=common_pb2.SLA_CLASS_BATCH,
                                                     sampling=common_pb2.SamplingParams(max_new_tokens=240, ignore_eos=True)))
    first = next(batch)  # BATCH running
    try:
        stub.PauseBatch(worker_pb2.PauseBatchRequest(duration_ms=30_000))
        urgent = list(stub.Generate(worker_pb2.GenerateRequest(
            prompt_text="3+4=", sla_class=common_pb2.SLA_CLASS_INTERACTIVE,
            sampling=common_pb2.SamplingParams(max_new_tokens=60, ignore_eos=True))))
        paused_steps = stub.Stats(worker_pb2.StatsRequest()).batch_paused_steps_total - before
    finally:
        stub.PauseBatch(worker_pb2.PauseBatchRequest(duration_ms=0))  # the session's worker: leave it unpaused
    rest = list(batch)
    assert sum(len(c.token_ids) for c in urgent) == 60
    assert paused_steps >= 55  # every INTERACTIVE step but its first few (the pause lands within a step) ran alone
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 240  # BATCH went on afterwards, nothing lost
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    wait_worker_idle(demo_worker)


def test_utilization_probe_reads_this_process_cpu_share():
    import time

    from cotserve.worker.utilization import UtilizationProbe

    probe = UtilizationProbe("cpu", cores=1)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # one core busy
        pass
    busy, is_cpu, rss = probe.read()
    time.sleep(0.3)
    idle, _, _ = probe.read()
    assert is_cpu and rss > 0
    assert busy > 0.7 and idle < 0.2


def test_broken_model_folder_fails_at_start_with_a_clear_message(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    proc = subprocess.run(
        [sys.executable, "-m", "cotserve.cli", "serve", "worker", "--model", str(tmp_path), "--port", str(free_port())],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "architecture 'BertModel' is not supported" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sigterm_drains_in_flight_streams_then_exits_cleanly():
    proc, address = start_worker("--grace-s", "20")
    try:
        with grpc.insecure_channel(address) as ch:
            call = worker_pb2_grpc.WorkerServiceStub(ch).Generate(gen("1+2=", max_new_tokens=120, ignore_eos=True))
            first = next(call)
            proc.send_signal(signal.SIGTERM)
            rest = list(call)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert sum(len(c.token_ids) for c in [first, *rest]) == 120 and first.text
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            stop_process(proc)
