"""Every service's event loop (`clitools.run_loop`): uvloop by default, the standard library's on request."""

import asyncio

import pytest
import uvloop

from cotserve.common.clitools import run_loop


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_services_run_on_uvloop_by_default(monkeypatch):
    monkeypatch.delenv("COTSERVE_EVENT_LOOP", raising=False)
    assert run_loop(_loop_type()) is uvloop.Loop


def test_the_standard_loop_on_request(monkeypatch):
    monkeypatch.setenv("COTSERVE_EVENT_LOOP", "asyncio")
    loop_type = run_loop(_loop_type())
    assert loop_type is not uvloop.Loop and issubclass(loop_type, asyncio.BaseEventLoop)


def test_an_unknown_loop_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("COTSERVE_EVENT_LOOP", "trio")
    main = _loop_type()
    with pytest.raises(ValueError, match=r"COTSERVE_EVENT_LOOP='trio': give uvloop or asyncio"):
        run_loop(main)
    assert main.cr_frame is None  # closed, not left to warn that it was never awaited


def test_a_grpc_aio_call_completes_on_uvloop(monkeypatch):
    """grpc.aio's poller hands completions to whichever loop runs: one health check over loopback on uvloop."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    monkeypatch.delenv("COTSERVE_EVENT_LOOP", raising=False)

    async def check() -> int:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                return reply.status
        finally:
            await server.stop(0)

    assert run_loop(check()) == health_pb2.HealthCheckResponse.SERVING
