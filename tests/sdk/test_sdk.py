"""The SDK against a real gateway and worker: typed results, streaming, errors with their codes."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cotserve.sdk import (
    AsyncClient, Client, FailedPrecondition, GenerateResult, InvalidArgument, NotFound, StreamChunk, Timing, Usage,
)
from tests.conftest import wait_worker_idle, worker_stats

ANSWER = "<think>37+48=85. 85-12=73.</think> 73"


@pytest.fixture
def client(demo_gateway):
    with Client(demo_gateway, timeout_s=60) as c:
        yield c


def test_unary_generate_returns_a_typed_result(client):
    r = client.generate("37+48-12=", max_new_tokens=64)
    assert isinstance(r, GenerateResult) and isinstance(r.usage, Usage) and isinstance(r.timing, Timing)
    assert r.text == ANSWER and r.finish_reason == "stop"
    assert r.usage == Usage(prompt_tokens=6, completion_tokens=len(r.token_ids), reasoning_tokens=14) and r.token_ids[-1] == 1
    assert 0 <= r.timing.queue_ms <= r.timing.ttft_ms <= r.timing.total_ms
    assert r.logprobs is None


def test_streaming_yields_typed_chunks(client):
    chunks = list(client.stream("37+48-12=", max_new_tokens=64, logprobs=True, sla="realtime"))
    assert all(isinstance(c, StreamChunk) for c in chunks)
    assert "".join(c.text for c in chunks) == ANSWER
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in chunks) and chunks[-1].timing.total_ms > 0
    assert all(len(c.logprobs) == len(c.token_ids) >= 1 and all(lp <= 0 for lp in c.logprobs) for c in chunks)
    assert chunks[0].usage is None and chunks[0].timing is None


def test_seeded_sampling_is_reproducible_through_the_gateway(client):
    a = client.generate("5+5=", temperature=1.5, seed=42, max_new_tokens=20, ignore_eos=True)
    b = client.generate("5+5=", temperature=1.5, seed=42, max_new_tokens=20, ignore_eos=True)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20 and a.finish_reason == "length"


def test_list_models_and_tokenize(client):
    (m,) = client.list_models()
    assert (m.name, m.max_context_tokens, m.num_healthy_workers) == ("cotserve-demo", 256, 1) and len(m.revision) == 12
    assert client.tokenize("85-12=") == [0, client.tokenize("85")[1], client.tokenize("-12")[1], client.tokenize("=")[1]]


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(max_new_tokens=-5), InvalidArgument, "sampling.max_new_tokens: -5 is out of range (1..256)"),
    (dict(temperature=2.5), InvalidArgument, "sampling.temperature: 2.5 is out of range (0..2)"),
    (dict(top_p=1.5), InvalidArgument, "sampling.top_p: 1.5 is out of range (0 < top_p <= 1)"),
    (dict(prompt=""), InvalidArgument, "prompt / messages: give exactly one"),
    (dict(sla=7), InvalidArgument, "sla_class: unknown value 7 (allowed: REALTIME, INTERACTIVE, BATCH)"),
    (dict(sla="urgent"), InvalidArgument, "sla: 'urgent' is not an SLA class (allowed: realtime, interactive, batch)"),
    (dict(prompt="1+" * 300), InvalidArgument, "prompt: 601 tokens is over the model's context"),
    (dict(model="gpt-9"), NotFound, "model: 'gpt-9' is not served here (served: cotserve-demo)"),
    (dict(post_processor="strip-think"), FailedPrecondition,
     "post_processor: module 'strip-think' cannot run: this gateway has no sandbox service (--sandbox)"),
])
def test_bad_input_raises_the_matching_sdk_error_and_leaks_nothing(client, demo_worker, kwargs, exc, message):
    prompt = kwargs.pop("prompt", "1+1=")
    with pytest.raises(exc) as err:
        client.generate(prompt, **kwargs)
    assert message in err.value.message
    assert err.value.code == getattr(grpc.StatusCode, {InvalidArgument: "INVALID_ARGUMENT", NotFound: "NOT_FOUND",
                                                        FailedPrecondition: "FAILED_PRECONDITION"}[exc])
    with pytest.raises(exc):
        list(client.stream(prompt, **kwargs))
    wait_worker_idle(demo_worker)


def test_cancelling_a_stream_midway_returns_the_workers_blocks(client, demo_worker):
    stream = client.stream("1+2+3=", max_new_tokens=250, ignore_eos=True)
    got = [next(stream) for _ in range(3)]
    assert len(got) == 3 and worker_stats(demo_worker).kv_blocks_used > 0
    stream.close()  # cancels the gateway call, which cancels the worker stream
    stats = wait_worker_idle(demo_worker)
    assert stats.kv_blocks_free == 32 * 16


def test_deadline_exceeded_frees_the_workers_blocks(client, demo_worker):
    from cotserve.sdk import DeadlineExceeded

    start = time.monotonic()
    # 250 tokens take at least ~0.25 s (a decode step ~1 ms on 2 cores, more through the gateway); the first token
    # ~10 ms: the deadline falls mid-generation
    with pytest.raises(DeadlineExceeded):
        client.generate("1+2+3=", max_new_tokens=250, ignore_eos=True, timeout_s=0.05)
    assert time.monotonic() - start < 5
    wait_worker_idle(demo_worker)


def test_async_client_has_the_same_methods(demo_gateway):
    async def main():
        async with AsyncClient(demo_gateway, timeout_s=60) as c:
            r = await c.generate("37+48-12=", max_new_tokens=64)
            chunks = [ch async for ch in c.stream("37+48-12=", max_new_tokens=64)]
            models = await c.list_models()
            ids = await c.tokenize("1+1=")
            with pytest.raises(InvalidArgument, match="sampling.temperature"):
                await c.generate("1+1=", temperature=-1.0)
            many = await asyncio.gather(*(c.generate(f"{i}+{i}=", max_new_tokens=32) for i in range(8)))
            return r, chunks, models, ids, many

    r, chunks, models, ids, many = asyncio.run(main())
    assert r.text == ANSWER and "".join(c.text for c in chunks) == ANSWER
    assert [m.name for m in models] == ["cotserve-demo"] and ids[0] == 0
    assert [m.text for m in many] == [f"<think>{i}+{i}={2 * i}.</think> {2 * i}" for i in range(8)]
