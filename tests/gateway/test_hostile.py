"""Hostile input and faults at the gateway and the worker (issue 20): each finding as a test that the
old code failed, over real gRPC, a real Redis, the real sandbox and the demo model."""

# In-process workers here run their engine as a thread (engine_process=False): these tests are about the gateway and the worker front, not
# the engine process boundary, which tests/worker/test_engine_process.py and every CLI-started worker cover;
# a second interpreter importing torch per worker would add about 2 s to each start.

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cotserve.common.procs import free_port
from cotserve.gateway.pool import WorkerPool
from cotserve.gateway.quota import LEASE_MS, QuotaEnforcer
from cotserve.gateway.server import GatewayConfig, start_gateway
from cotserve.gateway.tenants import Tenant, TenantRegistry, Unauthenticated, add_key, hash_key
from cotserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cotserve.common.sampling import SlaClass
from cotserve.sandbox.server import SandboxConfig, start_sandbox
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        return resp.status


async def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def test_a_huge_prompt_is_refused_at_once_and_stalls_no_one(tmp_path):
    """A 3.9 MB prompt used to be tokenized on the worker's event loop for 2.5 s, starving Stats (the
    gateway then dropped the worker). Now the worker refuses it before tokenizing, the gateway before
    forwarding it, and Stats keeps answering; a message over the gateway's byte limit is refused by gRPC."""

    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4))
        gw = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], max_request_bytes=1 << 20))
        out = {}
        try:
            huge = "37+48-12=" * (3_900_006 // 9)
            async with grpc.aio.insecure_channel(worker.server.address) as ch, \
                    grpc.aio.insecure_channel(gw.server.address) as gch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)
                gstub = gateway_pb2_grpc.GatewayServiceStub(gch)
                latencies: list[float] = []
                stop = asyncio.Event()

                async def poll_stats():
                    while not stop.is_set():
                        t0 = time.monotonic()
                        await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                        latencies.append(time.monotonic() - t0)
                        await asyncio.sleep(0.01)

                poller = asyncio.create_task(poll_stats())
                await asyncio.sleep(0.1)
                t0 = time.monotonic()
                out["worker"] = await _code(lambda: stub.Generate(worker_pb2.GenerateRequest(prompt_text=huge), timeout=30))
                out["worker_s"] = time.monotonic() - t0
                out["tokenize"] = await _code(lambda: stub.Tokenize(worker_pb2.TokenizeRequest(text=huge[:1_300_000]), timeout=30))
                out["gateway_bytes"] = await _code(
                    lambda: gstub.Generate(gateway_pb2.GenerateRequest(prompt=huge), timeout=30))
                out["gateway_chars"] = await _code(
                    lambda: gstub.Generate(gateway_pb2.GenerateRequest(prompt=huge[:900_000]), timeout=30))
                await asyncio.sleep(0.1)
                stop.set()
                await poller
                out["stats_max_s"] = max(latencies)
                out["info"] = await stub.Info(worker_pb2.InfoRequest(), timeout=5)
                # an ordinary request still works
                out["ok"] = await gstub.Generate(gateway_pb2.GenerateRequest(prompt="37+48-12="), timeout=30)
            return out
        finally:
            await gw.stop()
            await worker.stop()

    out = asyncio.run(main())
    context, token_chars = out["info"].max_context_tokens, out["info"].max_token_chars
    assert token_chars == 8  # the demo vocabulary's longest entry
    code, msg = out["worker"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert msg == (f"prompt_text: 3900006 characters cannot fit in {context - 1} tokens (at most "
                   f"{(context - 1) * token_chars} characters: the longest token is {token_chars})")
    assert out["worker_s"] < 1.0  # refused, not tokenized (2.5 s before)
    assert out["tokenize"][0] == grpc.StatusCode.INVALID_ARGUMENT and out["tokenize"][1].startswith("text: 1300000 characters")
    assert out["gateway_bytes"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    code, msg = out["gateway_chars"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert msg == f"prompt: 900000 characters, at most {context * token_chars} allowed (what model 'cotserve-demo''s context can hold)"
    assert out["stats_max_s"] < 0.5, out["stats_max_s"]
    assert out["ok"].text


def test_prompt_limits_configured_at_the_gateway():
    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4))
        gw = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], max_prompt_chars=40,
                                               max_prompt_tokens=5))
        try:
            async with grpc.aio.insecure_channel(gw.server.address) as ch:
                stub = gateway_pb2_grpc.GatewayServiceStub(ch)
                chars = await _code(lambda: stub.Generate(gateway_pb2.GenerateRequest(prompt="1+" * 21), timeout=30))
                tokens = await _code(lambda: stub.Generate(gateway_pb2.GenerateRequest(prompt="37+48-12="), timeout=30))
                fits = await stub.Generate(gateway_pb2.GenerateRequest(prompt="1+1="), timeout=30)
            return chars, tokens, fits
        finally:
            await gw.stop()
            await worker.stop()

    chars, tokens, fits = asyncio.run(main())
    assert chars == (grpc.StatusCode.INVALID_ARGUMENT, "prompt: 42 characters, at most 40 allowed (the limit)")
    assert tokens == (grpc.StatusCode.INVALID_ARGUMENT, "prompt: 6 tokens is over the limit of 5 prompt tokens")
    assert fits.text


def test_every_rpc_is_authenticated_once_and_health_follows_the_workers(tmp_path):
    tenants = tmp_path / "tenants.toml"
    key = add_key(tenants, "acme")

    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4))
        gw = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], tenants_file=tenants,
                                               poll_interval_s=0.1, worker_wait_s=0.5))
        out = {}
        try:
            async with grpc.aio.insecure_channel(gw.server.address) as ch:
                stub = gateway_pb2_grpc.GatewayServiceStub(ch)
                good = (("authorization", f"Bearer {key}"),)
                out["list_anon"] = await _code(lambda: stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5))
                out["tok_anon"] = await _code(lambda: stub.Tokenize(gateway_pb2.TokenizeRequest(text="1+1"), timeout=5))
                out["list"] = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=good, timeout=5)
                out["tok"] = await stub.Tokenize(gateway_pb2.TokenizeRequest(text="1+1"), metadata=good, timeout=5)
                out["twice"] = await _code(lambda: stub.Generate(
                    gateway_pb2.GenerateRequest(prompt="1+1="), timeout=5,
                    metadata=(("authorization", "Bearer wrong"), ("authorization", f"Bearer {key}"))))
                out["realtime"] = await _code(lambda: stub.Generate(
                    gateway_pb2.GenerateRequest(prompt="1+1=", sla_class=1), metadata=good, timeout=5))
                out["health_up"] = await _health(gw.server.address)
                await worker.stop()
                deadline = time.monotonic() + 10
                while (status := await _health(gw.server.address)) != health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() < deadline, "the gateway stayed SERVING with no worker"
                    await asyncio.sleep(0.05)
                out["health_down"] = status
                out["gen_down"] = await _code(lambda: stub.Generate(gateway_pb2.GenerateRequest(prompt="1+1="),
                                                                    metadata=good, timeout=5))
            return out
        finally:
            await gw.stop()

    out = asyncio.run(main())
    assert out["list_anon"][0] == grpc.StatusCode.UNAUTHENTICATED and out["tok_anon"][0] == grpc.StatusCode.UNAUTHENTICATED
    assert [m.name for m in out["list"].models] == ["cotserve-demo"] and list(out["tok"].token_ids)
    assert out["twice"] == (grpc.StatusCode.UNAUTHENTICATED,
                            "authorization: sent 2 times; send exactly one `authorization: Bearer <key>`")
    assert out["realtime"] == (grpc.StatusCode.PERMISSION_DENIED,
                               "sla_class: tenant 'acme' may not use REALTIME (allowed: INTERACTIVE, BATCH)")
    assert out["health_up"] == health_pb2.HealthCheckResponse.SERVING
    assert out["health_down"] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert out["gen_down"][0] == grpc.StatusCode.UNAVAILABLE


def test_internal_errors_carry_an_id_not_the_exception(monkeypatch, caplog):
    def broken(self, name):
        raise RuntimeError("connect to redis://10.1.2.3:6379 failed: secret")

    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4))
        gw = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address]))
        try:
            monkeypatch.setattr(WorkerPool, "resolve_model", broken)
            async with grpc.aio.insecure_channel(gw.server.address) as ch:
                stub = gateway_pb2_grpc.GatewayServiceStub(ch)
                try:
                    await stub.Generate(gateway_pb2.GenerateRequest(prompt="1+1="), timeout=5)
                except grpc.aio.AioRpcError as err:
                    return err
        finally:
            monkeypatch.undo()
            await gw.stop()
            await worker.stop()

    with caplog.at_level("ERROR", logger="cotserve.rpc"):
        err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "10.1.2.3" not in err.details() and "secret" not in err.details() and "RuntimeError" not in err.details()
    error_id = dict(err.trailing_metadata())["error-id"]
    assert err.details() == f"internal error (error id {error_id}; the service's log has the details)"
    assert any(error_id in r.getMessage() and "10.1.2.3" in r.getMessage() for r in caplog.records)


def test_invalid_utf8_is_invalid_argument():
    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4))
        try:
            good = worker_pb2.GenerateRequest(prompt_text="ab").SerializeToString()
            bad = good.replace(b"ab", b"a\xff")
            async with grpc.aio.insecure_channel(worker.server.address) as ch:
                call = ch.unary_stream("/cotserve.worker.v1.WorkerService/Generate",
                                       request_serializer=lambda b: b, response_deserializer=lambda b: b)
                return await _code(lambda: call(bad, timeout=5))
        finally:
            await worker.stop()

    assert asyncio.run(main()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "request: not a valid message: String field had bad UTF-8 (every string field must be valid UTF-8)")


def test_quota_is_checked_before_the_pre_processor_and_redis_trouble_is_unavailable(tmp_path, redis_url):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.slow]\nkey_sha256 = ["{hash_key("k")}"]\nrequests_per_min = 1\n')
    meta = (("authorization", "Bearer k"),)

    async def main():
        sandbox = await start_sandbox(SandboxConfig(port=0, store_dir=tmp_path / "store"), provider)
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4))
        gw = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], tenants_file=tenants,
                                               redis_url=redis_url, sandbox_address=sandbox.server.address))
        no_redis = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], tenants_file=tenants,
                                                     redis_url=f"redis://127.0.0.1:{free_port()}/0"))
        out = {}
        try:
            for name, address in (("gw", gw.server.address), ("no_redis", no_redis.server.address)):
                async with grpc.aio.insecure_channel(address) as ch:
                    stub = gateway_pb2_grpc.GatewayServiceStub(ch)
                    req = gateway_pb2.GenerateRequest(prompt="12+30=", pre_processor="cot-guard")
                    out[name] = [await _code(lambda: stub.Generate(req, metadata=meta, timeout=10)) for _ in range(3)]
            out["runs"] = [s for s in exporter.get_finished_spans() if s.name == "sandbox.run cot-guard"]
            return out
        finally:
            for svc in (no_redis, gw, worker, sandbox):
                await svc.stop()

    out = asyncio.run(main())
    assert [c for c, _ in out["gw"]] == [grpc.StatusCode.OK] + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert len(out["runs"]) == 1  # the over-quota requests never reached the sandbox
    assert out["no_redis"] == [(grpc.StatusCode.UNAVAILABLE,
                                "quota: the tenant-limits store (Redis) is unavailable; retry later")] * 3


def test_concurrency_leases_are_renewed_while_a_request_lives(redis_url):
    import redis as sync_redis

    async def main():
        quota = QuotaEnforcer.from_url(redis_url)
        tenant = Tenant("long", max_concurrent=2)
        try:
            grant = await quota.admit(tenant, 10)
            key = "cotserve:quota:long:concurrent"
            first = sync_redis.Redis.from_url(redis_url).zscore(key, grant.members()[0])
            await asyncio.sleep(0.05)
            renewed = await quota.renew(grant)
            second = sync_redis.Redis.from_url(redis_url).zscore(key, grant.members()[0])
            await quota.release(grant, 10)
            gone = await quota.renew(grant)
            return first, renewed, second, gone
        finally:
            await quota.close()

    first, renewed, second, gone = asyncio.run(main())
    assert renewed and second > first and second - time.time() * 1000 == pytest.approx(LEASE_MS, abs=2000)
    assert not gone  # a released lease is not brought back


def test_realtime_is_granted_explicitly(tmp_path):
    path = tmp_path / "t.toml"
    add_key(path, "plain")
    add_key(path, "rt", sla_classes=frozenset(SlaClass))
    reg = TenantRegistry.from_file(path)
    assert reg.tenants["plain"].sla_classes == {SlaClass.INTERACTIVE, SlaClass.BATCH}
    assert reg.tenants["rt"].sla_classes == set(SlaClass)
    assert TenantRegistry.open().authenticate({}).sla_classes == set(SlaClass)  # no tenants file: local use
    with pytest.raises(Unauthenticated, match="sent 2 times"):
        reg.authenticate([("authorization", "Bearer a"), ("Authorization", "Bearer b")])


class _SlowStats(worker_pb2_grpc.WorkerServiceServicer):
    """A worker whose Stats answers late `slow` times in a row, then on time."""

    def __init__(self, slow: int) -> None:
        self.slow = slow

    async def Info(self, request, context):
        return worker_pb2.InfoResponse(model_name="m", max_context_tokens=64, vocab_size=10)

    async def Stats(self, request, context):
        if self.slow > 0:
            self.slow -= 1
            await asyncio.sleep(0.3)
        return worker_pb2.StatsResponse(kv_blocks_free=10)


def test_a_slow_poll_does_not_take_a_worker_out_but_three_in_a_row_do():
    async def main():
        servicer = _SlowStats(slow=0)
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = WorkerPool([f"127.0.0.1:{port}"], poll_interval_s=3600, poll_timeout_s=0.1)
        changes: list[bool] = []
        pool.on_change = changes.append
        try:
            await pool.start()
            (w,) = pool.workers
            seen = [w.healthy]
            servicer.slow = 2
            for _ in range(2):
                await pool.poll_once()
                seen.append(w.healthy)
            await pool.poll_once()  # on time again
            seen.append(w.healthy)
            servicer.slow = 3
            for _ in range(3):
                await pool.poll_once()
                seen.append(w.healthy)
            await server.stop(0)
            servicer.slow = 0
            await pool.poll_once()  # fine again... but the server is gone: refused
            seen.append(w.healthy)
            return seen, changes
        finally:
            await pool.stop()

    seen, changes = asyncio.run(main())
    assert seen == [True, True, True, True, True, True, False, False]
    assert changes == [True, False]


def test_a_cancelled_stream_ends_its_spans_in_its_own_context(caplog):
    """Cancelled streams used to leave their generators to the garbage collector, which closed them in
    another context: 'Failed to detach context' (18 lines each) and spans ending late."""
    import gc

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4), provider)
        gw = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address]), provider)
        try:
            async with grpc.aio.insecure_channel(gw.server.address) as ch:
                stub = gateway_pb2_grpc.GatewayServiceStub(ch)
                for _ in range(3):
                    call = stub.GenerateStream(gateway_pb2.GenerateStreamRequest(prompt="37+48-12="))
                    got = 0
                    async for _chunk in call:
                        got += 1
                        if got == 3:
                            break
                    call.cancel()
                    await asyncio.sleep(0.3)
                gc.collect()
                await asyncio.sleep(0.2)
        finally:
            await gw.stop()
            await worker.stop()

    with caplog.at_level("ERROR"):
        asyncio.run(main())
        gc.collect()
    assert not [r for r in caplog.records if "detach" in r.getMessage()]
    roots = [s for s in exporter.get_finished_spans() if s.parent is None and s.name.startswith("generate")]
    assert len(roots) == 3  # each cancelled request's span ended


def test_a_request_waits_for_a_restarting_worker_instead_of_failing():
    """With one worker, every request that arrived during its restart used to fail with UNAVAILABLE
    ("no healthy worker"); now it waits (up to worker_wait_s, never past its deadline) and is served."""

    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4))
        address = worker.server.address
        gw = await start_gateway(GatewayConfig(port=0, workers=[address], poll_interval_s=0.1, worker_wait_s=20))
        try:
            await worker.stop()
            deadline = time.monotonic() + 10
            while any(w.healthy for w in gw.pool.workers):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            async with grpc.aio.insecure_channel(gw.server.address) as ch:
                stub = gateway_pb2_grpc.GatewayServiceStub(ch)
                waiting = asyncio.ensure_future(stub.Generate(gateway_pb2.GenerateRequest(prompt="37+48-12="), timeout=30))
                short = await _code(lambda: stub.Generate(gateway_pb2.GenerateRequest(prompt="1+1="), timeout=1))
                restarted = await start_worker(WorkerConfig(engine_process=False, port=int(address.rsplit(":", 1)[1]), max_num_seqs=4))
                try:
                    return await waiting, short
                finally:
                    await restarted.stop()
        finally:
            await gw.stop()

    served, short = asyncio.run(main())
    assert served.text == "<think>37+48=85. 85-12=73.</think> 73"
    assert short[0] == grpc.StatusCode.UNAVAILABLE  # its deadline came first: told so before it passed
