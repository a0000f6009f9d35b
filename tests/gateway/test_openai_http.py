"""The OpenAI-compatible HTTP API against a real stack (a worker and gateways in their own processes), through the
official `openai` client: sync and async, streaming, n, logprobs, the reasoning field, errors with their statuses;
the SSE framing byte for byte; the README's curl example; tenants' keys, classes and limits; the trace parent."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from cotserve.common.procs import free_port
from cotserve.sdk import Client, InvalidArgument
from tests.conftest import start_gateway, stop_process, wait_worker_idle

PROMPT = "37+48-12="
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def http_gateway(demo_worker):
    """(gRPC address, HTTP base URL) of a gateway with the HTTP API in front of the session's demo worker."""
    port = free_port()
    proc, address = start_gateway(demo_worker, extra=("--http-port", str(port)))
    yield address, f"http://127.0.0.1:{port}/v1"
    stop_process(proc)


def _client(base: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=60, **kw)


def test_chat_matches_the_grpc_api_with_reasoning_apart(http_gateway):
    address, base = http_gateway
    with _client(base) as client:
        r = client.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=48)
        models = client.models.list()
    with Client(address) as sdk:
        g = sdk.generate(messages=MESSAGES, max_new_tokens=48)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert choice.message.reasoning == g.reasoning_text == "37+48=85. 85-12=73."
    assert choice.message.content.strip() == g.answer_text == "73"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (g.usage.prompt_tokens, g.usage.completion_tokens)
    assert r.usage.completion_tokens_details.reasoning_tokens == g.usage.reasoning_tokens > 0
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "cotserve-demo"
    assert r.service_tier == "default"
    assert [m.id for m in models.data] == ["cotserve-demo"]


def test_async_streaming_says_what_the_whole_response_says(http_gateway):
    _, base = http_gateway

    async def main():
        async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
            whole = await client.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=48)
            stream = await client.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=48,
                                                          stream=True, stream_options={"include_usage": True})
            return whole, [event async for event in stream]

    whole, events = asyncio.run(main())
    deltas = [e.choices[0].delta for e in events if e.choices]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == whole.choices[0].message.reasoning
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "stop"
    assert events[-1].choices == [] and events[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(e.usage is None for e in events[:-1])


def test_completions_with_logprobs_and_chat_top_logprobs(http_gateway):
    address, base = http_gateway
    with _client(base) as client:
        c = client.completions.create(model="cotserve-demo", prompt=PROMPT, max_tokens=24, logprobs=2)
        chat = client.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=24, logprobs=True,
                                              top_logprobs=3)
    with Client(address) as sdk:
        g = sdk.generate(PROMPT, max_new_tokens=24, logprobs=True)
    assert c.choices[0].text == g.text and c.object == "text_completion"
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert [round(x, 4) for x in lp.token_logprobs] == [round(x, 4) for x in g.logprobs]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top, key=top.get) == token and top[token] == pytest.approx(logprob, abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert [t.token for t in entry.top_logprobs][0] == entry.token and len(entry.top_logprobs) == 3
        assert bytes(entry.bytes) == entry.token.encode()
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob


def test_n_seeded_samples_are_the_grpc_apis_samples(http_gateway):
    address, base = http_gateway
    hard = [{"role": "user", "content": "12+30-7+5+61-20="}]
    with _client(base) as client:
        r = client.chat.completions.create(model="cotserve-demo", messages=hard, max_tokens=40, n=3, temperature=2.0,
                                           seed=7)
    with Client(address) as sdk:
        g = sdk.generate(messages=hard, max_new_tokens=40, n=3, temperature=2.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [(c.message.reasoning or "") + "|" + c.message.content for c in r.choices] == \
        [_split(c.text) for c in g.choices]
    assert r.usage.completion_tokens == g.usage.completion_tokens


def _split(text: str) -> str:
    """A raw completion as `reasoning|content`, as the HTTP API splits it."""
    thinking, _, answer = text.removeprefix("<think>").partition("</think>")
    return thinking + "|" + answer if "</think>" in text else thinking + "|"


def _raw(base: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = re.match(r"http://([^:]+):(\d+)", base).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1" + path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_sse_framing_byte_for_byte(http_gateway):
    _, base = http_gateway
    status, headers, body = _raw(base, "/chat/completions", json.dumps(
        {"messages": MESSAGES, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}).encode())
    assert status == 200 and headers["content-type"] == "text/event-stream; charset=utf-8"
    assert body.endswith(b"data: [DONE]\n\n") and body.startswith(b"data: {")
    payloads = body[len(b"data: "):-len(b"\n\n")].split(b"\n\ndata: ")
    events = [json.loads(p) for p in payloads[:-1]]
    rebuilt = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in events)
    assert rebuilt + b"data: [DONE]\n\n" == body  # nothing but `data: <json>` events, each ended by a blank line
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    assert {e["id"] for e in events} == {"chatcmpl-" + headers["x-request-id"]}


def test_errors_carry_openais_error_object_and_status(http_gateway):
    _, base = http_gateway
    with _client(base) as client:
        with pytest.raises(openai.NotFoundError) as nf:
            client.chat.completions.create(model="gpt-9", messages=MESSAGES)
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="cotserve-demo", messages=MESSAGES, temperature=7)
        with pytest.raises(openai.BadRequestError) as unknown:
            client.chat.completions.create(model="cotserve-demo", messages=MESSAGES, extra_body={"frobnicate": 1})
        with pytest.raises(openai.BadRequestError) as too_long:
            client.completions.create(model="cotserve-demo", prompt=PROMPT, max_tokens=100_000)
    assert nf.value.status_code == 404 and nf.value.body["param"] == "model" and nf.value.body["code"] == "model_not_found"
    assert "'gpt-9' is not served here" in nf.value.body["message"]
    assert bad.value.body == {"message": "temperature: 7.0 is out of range (0..2)", "type": "invalid_request_error",
                              "param": "temperature", "code": "invalid_argument"}
    assert unknown.value.body["param"] == "frobnicate"
    assert too_long.value.body["param"] == "max_tokens" and "out of range" in too_long.value.body["message"]
    status, _, body = _raw(base, "/chat/completions", b'{"messages": [')
    assert status == 400 and json.loads(body)["error"]["message"].startswith("request body: not valid JSON")
    status, _, body = _raw(base, "/chat/completions", b'{"pad": "' + b"x" * (5 << 20) + b'"}')
    assert status == 413 and json.loads(body)["error"]["message"] == "request body: 5242891 bytes, at most 4194304 allowed"
    status, _, body = _raw(base, "/nothing", b"{}")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"


def test_the_readmes_curl_example_runs(http_gateway):
    _, base = http_gateway
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    command = re.search(r"```sh\n(curl -s http://127\.0\.0\.1:8000/v1/chat/completions.*?)\n```", readme, re.S).group(1)
    out = subprocess.run(["bash", "-c", command.replace("http://127.0.0.1:8000", base.removesuffix("/v1"))],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    answer = json.loads(out)
    assert answer["choices"][0]["message"]["content"].strip() == "73"
    assert answer["choices"][0]["message"]["reasoning"] == "37+48=85. 85-12=73."


def test_a_client_that_goes_away_frees_the_workers_pages(http_gateway, demo_worker):
    _, base = http_gateway

    async def main():
        async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
            stream = await client.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=200,
                                                          stream=True, extra_body={"ignore_eos": True})
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    break
            await stream.close()

    asyncio.run(main())
    stats = wait_worker_idle(demo_worker, timeout_s=10)
    assert stats.kv_blocks_used == 0 and stats.num_running_seqs == 0


def test_tenants_keys_classes_limits_and_the_deadline(demo_worker, redis_url, tmp_path):
    from cotserve.gateway.tenants import add_key

    tenants = tmp_path / "tenants.toml"
    key = add_key(tenants, "acme", requests_per_min=2)
    port = free_port()
    proc, _ = start_gateway(demo_worker, extra=("--http-port", str(port), "--tenants-file", str(tenants),
                                                "--redis-url", redis_url, "--batch-limit", "0"))
    base = f"http://127.0.0.1:{port}/v1"
    try:
        with _client(base, api_key="wrong") as client, pytest.raises(openai.AuthenticationError) as unauthenticated:
            client.models.list()
        with _client(base, api_key=key) as client:
            with pytest.raises(openai.PermissionDeniedError) as denied:
                client.chat.completions.create(model="cotserve-demo", messages=MESSAGES, service_tier="priority")
            with pytest.raises(openai.APIStatusError) as late:  # BATCH waits for a slot that never comes
                client.chat.completions.create(model="cotserve-demo", messages=MESSAGES, service_tier="flex",
                                               extra_headers={"x-envoy-expected-rq-timeout-ms": "300"})
            with pytest.raises(openai.RateLimitError) as limited:
                for _ in range(3):
                    client.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=4)
    finally:
        stop_process(proc)
    assert unauthenticated.value.status_code == 401 and unauthenticated.value.body["code"] == "invalid_api_key"
    assert denied.value.status_code == 403 and denied.value.body["param"] == "service_tier"
    assert late.value.status_code == 504 and late.value.body["type"] == "timeout"
    assert int(limited.value.response.headers["retry-after"]) >= 1 and "retry-after-ms" in limited.value.response.headers


def test_no_worker_is_503():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cotserve.cli", "serve", "gateway", "--port", str(free_port()),
                             "--worker", f"127.0.0.1:{free_port()}", "--http-port", str(port), "--worker-wait-s", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                status, _, body = _raw(base, "/chat/completions", json.dumps({"messages": MESSAGES}).encode())
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the gateway's HTTP API never listened"
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(10)
    assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable"


def test_the_http_span_continues_the_callers_trace():
    """A `traceparent` header parents the gateway's request span, which carries what the gRPC path's does."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from cotserve.gateway.server import GatewayConfig, start_gateway as start_gw
    from cotserve.worker.config import WorkerConfig
    from cotserve.worker.server import start_worker

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4))
        gw = await start_gw(GatewayConfig(port=0, workers=[worker.server.address], http_port=0), provider)
        try:
            while not gw.pool.models():
                await asyncio.sleep(0.05)
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.http.port}/v1", api_key="x", max_retries=0) as c:
                await c.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=8, user="u-17",
                                                extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
        finally:
            await gw.stop()
            await worker.stop()

    asyncio.run(main())
    span = next(s for s in exporter.get_finished_spans() if s.name == "generate cotserve-demo")
    assert format(span.context.trace_id, "032x") == trace_id and format(span.parent.span_id, "016x") == parent
    assert span.attributes["cotserve.component"] == "gateway" and span.attributes["cotserve.user"] == "u-17"
    assert span.attributes["http.response.status_code"] == 200
    assert any(s.name == "queue wait" and s.parent.span_id == span.context.span_id for s in exporter.get_finished_spans())


def test_the_throughput_benchs_http_client_counts_every_token(http_gateway):
    from cotserve.bench.throughput import run_level_http

    _, base = http_gateway
    level = asyncio.run(run_level_http(base, 3, PROMPT, 5, 4))
    assert (level.num_requests, level.output_tokens, len(level.ttft_ms)) == (4, 20, 4)


def test_processors_and_reasoning_options_as_extra_body_fields(tmp_path):
    """cotserve's own options travel beside OpenAI's: a post-processor's output is the whole content, and
    reasoning_effort / max_thinking_tokens budget the thinking as the gRPC API's reasoning options do."""
    from cotserve.gateway.server import GatewayConfig, start_gateway as start_gw
    from cotserve.sandbox.server import SandboxConfig, start_sandbox
    from cotserve.sdk import AsyncClient, Reasoning
    from cotserve.worker.config import WorkerConfig
    from cotserve.worker.server import start_worker

    hard = [{"role": "user", "content": "12+30-7+5+61-20="}]

    async def main():
        sandbox = await start_sandbox(SandboxConfig(port=0, store_dir=tmp_path / "store"))
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4, reasoning_step="."))
        gw = await start_gw(GatewayConfig(port=0, workers=[worker.server.address], http_port=0,
                                          sandbox_address=sandbox.server.address))
        try:
            while not gw.pool.models():
                await asyncio.sleep(0.05)
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.http.port}/v1", api_key="x", max_retries=0) as c:
                post = await c.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=64,
                                                       extra_body={"post_processor": "strip-think"})
                none = await c.chat.completions.create(model="cotserve-demo", messages=hard, max_tokens=64,
                                                       reasoning_effort="none")
                steps = await c.chat.completions.create(model="cotserve-demo", messages=hard, max_tokens=64,
                                                        extra_body={"max_thinking_tokens": 8})
                vote = await c.chat.completions.create(model="cotserve-demo", messages=hard, max_tokens=64,
                                                       temperature=1.0, seed=3,
                                                       extra_body={"self_consistency": {"max_samples": 4}})
            async with AsyncClient(gw.server.address) as sdk:
                grpc_steps = await sdk.generate(messages=hard, max_new_tokens=64, reasoning=Reasoning(max_thinking_tokens=8))
            return post, none, steps, grpc_steps, vote
        finally:
            await gw.stop()
            await worker.stop()
            await sandbox.stop()

    post, none, steps, grpc_steps, vote = asyncio.run(main())
    result = vote.self_consistency  # cotserve's field beside OpenAI's
    assert 1 <= result["samples_used"] <= 4 and result["answer"] and sum(v["count"] for v in result["votes"]) >= 1
    assert post.choices[0].message.content == "73" and getattr(post.choices[0].message, "reasoning", None) is None
    assert none.usage.completion_tokens_details.reasoning_tokens <= 2  # the markers alone: no thinking budget
    assert not getattr(none.choices[0].message, "reasoning", "").strip() and none.choices[0].message.content.strip()
    assert steps.choices[0].message.reasoning == grpc_steps.reasoning_text
    assert steps.choices[0].message.content.strip() == grpc_steps.answer_text
    assert steps.usage.completion_tokens_details.reasoning_tokens == grpc_steps.usage.reasoning_tokens


# Qwen3's convention for hybrid thinking: with enable_thinking false, the generation prompt carries an empty
# thinking block, so the model answers at once (the demo model's own turns otherwise)
HYBRID_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                   "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}")


def test_chat_template_kwargs_reach_the_template_and_turn_thinking_off(tmp_path):
    """`chat_template_kwargs` through the official client's `extra_body`, as vLLM takes it: a template that honours
    `enable_thinking` (Qwen3's switch) answers without thinking when it is false (no reasoning, no reasoning tokens,
    one more prompt token pair), and thinks as before otherwise; a bad variable name is a 400 naming it."""
    import shutil

    from cotserve.worker.config import DEMO_MODEL
    from tests.conftest import start_worker

    model = tmp_path / "hybrid"
    shutil.copytree(DEMO_MODEL, model)
    (model / "chat_template.jinja").write_text(HYBRID_TEMPLATE)
    worker, worker_address = start_worker("--model", str(model), "--max-num-seqs", "4")
    port = free_port()
    gateway, address = start_gateway(worker_address, extra=("--http-port", str(port)))
    try:
        with _client(f"http://127.0.0.1:{port}/v1") as client:
            def ask(**extra):
                return client.chat.completions.create(model="hybrid", messages=MESSAGES, max_tokens=48, **extra)

            thinking, direct = ask(), ask(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            with pytest.raises(openai.BadRequestError) as bad:
                ask(extra_body={"chat_template_kwargs": {"messages": []}})
        with Client(address) as sdk:  # the gRPC API and the SDK: the same variables, only with messages
            sdk_direct = sdk.generate(messages=MESSAGES, max_new_tokens=48, chat_template_kwargs={"enable_thinking": False})
            with pytest.raises(InvalidArgument, match="chat_template_kwargs: only with messages"):
                sdk.generate(PROMPT, chat_template_kwargs={"enable_thinking": False})
    finally:
        stop_process(gateway)
        stop_process(worker)
    assert thinking.choices[0].message.reasoning == "37+48=85. 85-12=73." and thinking.usage.completion_tokens_details.reasoning_tokens > 0
    assert not getattr(direct.choices[0].message, "reasoning", None)
    # all of the output is answer (the demo model, never trained to answer without thinking, says little)
    assert direct.usage.completion_tokens_details.reasoning_tokens == 0 < direct.usage.completion_tokens
    assert direct.usage.prompt_tokens == thinking.usage.prompt_tokens + 2  # <think> and </think>, one token each
    assert bad.value.status_code == 400 and bad.value.body["param"] == "chat_template_kwargs.messages"
    assert sdk_direct.reasoning_text == "" and sdk_direct.usage.reasoning_tokens == 0
    assert "chat_template_kwargs.messages: set by the renderer itself" in bad.value.body["message"]


def test_logit_bias_and_penalties_change_what_is_sampled(http_gateway):
    """A bias of -100 on the greedy first token makes another the first (the SDK over gRPC, and the HTTP API); a
    frequency penalty changes an output that repeats its tokens."""
    address, base = http_gateway
    with Client(address) as sdk:
        plain = sdk.generate(prompt="1+1+1+1+1+1+1+1+1+1=", max_new_tokens=40, ignore_eos=True)
        biased = sdk.generate(prompt="1+1+1+1+1+1+1+1+1+1=", max_new_tokens=40, ignore_eos=True,
                              logit_bias={plain.token_ids[0]: -100.0})
    assert biased.token_ids[0] != plain.token_ids[0]
    assert max(plain.token_ids.count(t) for t in set(plain.token_ids)) > 2
    with _client(base) as client:
        http = client.completions.create(model="cotserve-demo", prompt="1+1+1+1+1+1+1+1+1+1=", max_tokens=40,
                                         frequency_penalty=2.0, extra_body={"ignore_eos": True})
        bias = client.completions.create(model="cotserve-demo", prompt="1+1+1+1+1+1+1+1+1+1=", max_tokens=1,
                                         logit_bias={str(plain.token_ids[0]): -100})
    assert http.choices[0].text != plain.text  # (what a penalty does to the logits: test_sampler.py's reference)
    assert bias.choices[0].text == biased.text[:len(bias.choices[0].text)]


def test_one_model_by_id_a_clients_request_id_and_the_developer_role(http_gateway):
    _, base = http_gateway
    with _client(base) as client:
        model = client.models.retrieve("cotserve-demo")
        listed = client.models.list().data[0]
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("nope")
        raw = client.chat.completions.with_raw_response.create(
            model="cotserve-demo", messages=MESSAGES, max_tokens=48, extra_headers={"x-request-id": "trace-42.a:b"})
        odd = client.chat.completions.with_raw_response.create(
            model="cotserve-demo", messages=MESSAGES, max_tokens=1, extra_headers={"x-request-id": "no spaces please"})
        plain = client.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=48)
        developer = client.chat.completions.create(
            model="cotserve-demo", messages=[{"role": "developer", "content": "Be brief."}, *MESSAGES], max_tokens=48)
    assert (model.id, model.created, model.owned_by) == ("cotserve-demo", listed.created, "cotserve") and model.created > 0
    assert missing.value.body["code"] == "model_not_found" and "cotserve-demo" in missing.value.message
    assert raw.headers["x-request-id"] == "trace-42.a:b" and raw.parse().id == "chatcmpl-trace-42.a:b"
    assert odd.headers["x-request-id"] != "no spaces please" and len(odd.headers["x-request-id"]) == 32
    # the demo template drops system turns and refuses other roles: developer is read as system
    assert developer.choices[0].message.content == plain.choices[0].message.content
