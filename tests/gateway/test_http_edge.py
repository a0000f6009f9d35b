"""The OpenAI HTTP edge against what a hostile or clumsy client sends: bodies in pieces, chunked or large, the wrong
Content-Type, text that is not text, JSON nested past reason, a malformed deadline header, a body that never comes,
and clients that go away; and metrics that a caller cannot fill with labels of its own. A real gateway and worker in
this process, raw sockets where a library would hide what is sent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest
from prometheus_client import generate_latest

from cotserve.gateway.config import GatewayConfig
from cotserve.gateway.server import start_gateway
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker

CHAT = {"model": "cotserve-demo", "messages": [{"role": "user", "content": "37+48-12="}], "max_tokens": 8}


@contextlib.asynccontextmanager
async def stack(**gateway):
    worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=8))
    gw = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], http_port=0, **gateway))
    try:
        yield worker, gw
    finally:
        await gw.stop()
        await worker.stop()


async def exchange(port: int, parts: list[bytes], pause_s: float = 0.05, read: bool = True) -> tuple[int, dict]:
    """Send `parts` as separate writes with a pause between them; the status and the JSON body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause_s)
        raw = await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunk(body)
    return status, json.loads(body) if body else {}


def dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, body = out + rest[:n], rest[n + 2:]
    return out


def request(body: bytes, content_type: str = "application/json", extra: str = "", chunked: bool = False) -> bytes:
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: {content_type}\r\n"
            f"{length}\r\n{extra}\r\n").encode()


def test_a_body_in_pieces_chunked_or_large_is_read_whole():
    async def main():
        async with stack() as (_, gw):
            body = json.dumps(CHAT).encode()
            status, answer = await exchange(gw.http.port, [request(body), body[:20], body[20:]])
            assert status == 200 and answer["choices"][0]["finish_reason"]
            chunks = b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in (body[:30], body[30:])) + b"0\r\n\r\n"
            status, answer = await exchange(gw.http.port, [request(b"", chunked=True) + chunks])
            assert status == 200 and answer["choices"]
            big = json.dumps({**CHAT, "user": "u" * 300_000}).encode()  # past 200 KB, under the limit
            status, answer = await exchange(gw.http.port, [request(big), big[:100_000], big[100_000:]])
            assert status == 200 and answer["choices"]

    asyncio.run(main())


@pytest.mark.parametrize("body,content_type,extra,status,message", [
    (json.dumps(CHAT).encode(), "text/plain", "", 415, "Content-Type: 'text/plain', expected application/json"),
    (b'{"model": "cotserve-demo", "messages": [{"role": "user", "content": "\\ud800"}]}', "application/json", "", 400,
     "messages[0].content: not valid text"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", "", 400, "request body: nested too deeply"),
    (json.dumps(CHAT).encode(), "application/json", "x-envoy-expected-rq-timeout-ms: " + "9" * 400 + "\r\n", 400,
     "x-envoy-expected-rq-timeout-ms: '9999"),
], ids=["text-plain", "lone-surrogate", "nested-100k", "timeout-header-overflow"])
def test_what_is_not_a_request_is_refused_naming_why_never_a_500(body, content_type, extra, status, message):
    async def main():
        async with stack() as (_, gw):
            return await exchange(gw.http.port, [request(body, content_type, extra) + body])

    got, answer = asyncio.run(main())
    assert got == status and answer["error"]["message"].startswith(message), answer


def test_a_body_that_never_comes_is_answered_408_after_the_timeout():
    async def main():
        async with stack(http_body_timeout_s=0.5) as (_, gw):
            return await exchange(gw.http.port, [request(b"").replace(b"Content-Length: 0", b"Content-Length: 100")])

    status, answer = asyncio.run(main())
    assert status == 408 and answer["error"]["message"] == "request body: not received within 0.5 s"


def test_a_client_that_goes_away_frees_the_workers_seat_streamed_or_not_and_is_counted_cancelled():
    async def main():
        async with stack() as (worker, gw):
            engine = worker.engine
            for stream in (False, True):
                body = json.dumps({**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": stream}).encode()
                sock = socket.create_connection(("127.0.0.1", gw.http.port))
                sock.sendall(request(body) + body)
                while not engine.scheduler.running:
                    await asyncio.sleep(0.01)
                sock.close()
                for _ in range(500):  # a non-streamed request used to run on for seconds
                    if not engine.scheduler.has_work():
                        break
                    await asyncio.sleep(0.01)
                assert not engine.scheduler.has_work() and engine.block_manager.num_free_blocks == engine.config.num_blocks
            text = generate_latest(gw.metrics.registry).decode()
            cancelled = [ln for ln in text.splitlines() if ln.startswith("cotserve_gateway_requests_total")
                         and 'code="CANCELLED"' in ln]
            assert cancelled and float(cancelled[0].split()[-1]) >= 1

    asyncio.run(main())


def test_a_caller_cannot_add_metric_labels_of_its_own():
    """A model name the gateway does not serve is counted as "unknown" (gRPC and HTTP alike), never under the name the
    caller typed: every new name would be a new series."""
    from cotserve.sdk import AsyncClient, NotFound

    async def main():
        async with stack() as (_, gw):
            async with AsyncClient(gw.server.address) as client:
                for i in range(5):
                    with pytest.raises(NotFound):
                        await client.generate("1+1=", model=f"made-up-model-{i}", max_new_tokens=2)
            for i in range(5):
                body = json.dumps({**CHAT, "model": f"made-up-http-{i}"}).encode()
                status, _ = await exchange(gw.http.port, [request(body) + body])
                assert status == 404
            return generate_latest(gw.metrics.registry).decode()

    text = asyncio.run(main())
    assert "made-up" not in text
    counted = [ln for ln in text.splitlines() if ln.startswith("cotserve_gateway_requests_total")
               and 'model="unknown"' in ln and 'code="NOT_FOUND"' in ln]
    assert counted and float(counted[0].split()[-1]) == 5


def test_one_address_past_its_connection_cap_is_answered_429_and_closed_until_one_of_its_connections_ends():
    async def main():
        async with stack(http_max_connections_per_client=2) as (_, gw):
            held = [await asyncio.open_connection("127.0.0.1", gw.http.port) for _ in range(2)]
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.http.port)
            raw = await asyncio.wait_for(reader.read(), 60)  # answered and closed before it sends a byte
            writer.close()
            held[0][1].close()
            body = json.dumps(CHAT).encode()
            for _ in range(500):  # the closed connection is counted off once the server sees it end
                status, answer = await exchange(gw.http.port, [request(body) + body], pause_s=0)
                if status != 429:
                    break
                await asyncio.sleep(0.01)
            held[1][1].close()
            return raw, status, answer

    raw, status, answer = asyncio.run(main())
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429 ") and json.loads(body)["error"] == {
        "message": "too many open connections from this address (limit 2, --http-max-connections-per-client)",
        "type": "rate_limit_error", "param": None, "code": "too_many_connections"}
    assert status == 200 and answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 8
