"""Authorization by identity: one table says which service identity may call which RPC; a service that asks for
client certificates refuses every other caller with PERMISSION_DENIED naming the identity and the RPC. Real mutual
TLS over loopback, certificates from `cotserve tls init`'s own code."""

from __future__ import annotations

import asyncio
import importlib
import logging

import grpc
import pytest

from cotserve.common import authz
from cotserve.common.tlsgen import local_tls
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

SERVICES = ("gateway", "worker", "router", "slo", "sandbox", "telemetry")


def test_every_rpc_of_every_service_has_a_row_and_every_row_is_an_rpc():
    rpcs = set()
    for service in SERVICES:
        module = importlib.import_module(f"cotserve.{service}.v1.{service}_pb2")
        for svc in module.DESCRIPTOR.services_by_name.values():
            rpcs |= {f"/{svc.full_name}/{m.name}" for m in svc.methods}
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    otlp = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"]
    rpcs |= {f"/{otlp.full_name}/{m.name}" for m in otlp.methods}
    assert rpcs - set(authz.POLICY) == set(), "an RPC without a row: add it to common/authz.py's POLICY"
    assert set(authz.POLICY) - rpcs == set(), "a row for an RPC that does not exist"
    for method, allowed in authz.POLICY.items():
        assert allowed is authz.PUBLIC or allowed <= set(authz.IDENTITIES), method


@pytest.mark.parametrize("method,identity,refused", [
    ("/cotserve.worker.v1.WorkerService/Generate", "gateway", False),
    ("/cotserve.worker.v1.WorkerService/Generate", "operator", True),
    ("/cotserve.worker.v1.WorkerService/Generate", None, True),
    ("/cotserve.worker.v1.WorkerService/PauseBatch", "operator", False),
    ("/cotserve.router.v1.RouterService/SetPolicy", "gateway", True),
    ("/cotserve.slo.v1.SloService/ReportWindows", "operator", True),
    ("/cotserve.slo.v1.SloService/ExportWindows", "gateway", True),
    ("/cotserve.gateway.v1.GatewayService/Generate", None, False),
    ("/grpc.health.v1.Health/Check", None, False),
    ("/cotserve.worker.v1.WorkerService/Unknown", "gateway", True),
])
def test_the_table_decides(method, identity, refused):
    assert (authz.check(method, identity) is not None) == refused


def test_a_worker_with_mutual_tls_serves_each_rpc_only_to_the_identities_its_row_names(tmp_path, caplog):
    local_tls(tmp_path, identities=("worker", "gateway", "operator"))
    ca = tmp_path / "cotserve-local-ca.pem"

    def channel(identity: str, address: str):
        creds = grpc.ssl_channel_credentials(ca.read_bytes(), (tmp_path / f"{identity}.key").read_bytes(),
                                             (tmp_path / f"{identity}.pem").read_bytes())
        return grpc.aio.secure_channel(address, creds)

    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4,
                                                 tls_cert=tmp_path / "worker.pem", tls_key=tmp_path / "worker.key",
                                                 tls_client_ca=ca))
        try:
            async with channel("gateway", worker.server.address) as gw, channel("operator", worker.server.address) as op:
                as_gateway, as_operator = worker_pb2_grpc.WorkerServiceStub(gw), worker_pb2_grpc.WorkerServiceStub(op)
                chunks = [c async for c in as_gateway.Generate(worker_pb2.GenerateRequest(
                    request_id="r", prompt_text="1+1=", sampling={"max_new_tokens": 3}), timeout=30)]
                assert sum(len(c.token_ids) for c in chunks) == 3
                await as_operator.PauseBatch(worker_pb2.PauseBatchRequest(duration_ms=0), timeout=5)
                assert (await as_operator.Stats(worker_pb2.StatsRequest(), timeout=5)).kv_blocks_free > 0
                with pytest.raises(grpc.aio.AioRpcError) as denied:
                    async for _ in as_operator.Generate(worker_pb2.GenerateRequest(request_id="x", prompt_text="1+1="),
                                                        timeout=5):
                        pass
                with pytest.raises(grpc.aio.AioRpcError) as denied_mux:
                    call = as_operator.Multiplex()
                    await call.done_writing()
                    async for _ in call:
                        pass
                return denied.value, denied_mux.value, worker.engine.scheduler.has_work()
        finally:
            await worker.stop()

    with caplog.at_level(logging.WARNING, logger="cotserve.authz"):
        denied, denied_mux, busy = asyncio.run(main())
    for err, rpc in ((denied, "Generate"), (denied_mux, "Multiplex")):
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.details() == (f"identity 'operator' may not call /cotserve.worker.v1.WorkerService/{rpc} "
                                 "(allowed: gateway)")
    assert not busy  # the refused request never reached the engine
    assert any("refused: identity 'operator' may not call" in r.message for r in caplog.records)
