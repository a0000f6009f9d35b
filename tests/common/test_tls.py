"""TLS on every service, with a CA made in the test: a gateway that requires client certificates (mutual TLS) in
front of a worker that speaks TLS only; plaintext, an untrusted CA and a missing client certificate are refused;
the SDK and `cotserve generate` connect with the right files."""

from __future__ import annotations

import asyncio
import sys

import grpc
import pytest

from cotserve.common.tls import TlsSettings
from cotserve.common.tlsgen import issue, make_ca
from cotserve.gateway.server import GatewayConfig, start_gateway
from cotserve.sdk import AsyncClient, CotserveError
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc


def test_mutual_tls_through_the_gateway_to_a_tls_worker(tmp_path):
    ca, wrong = make_ca(tmp_path, "ca"), make_ca(tmp_path, "wrong-ca")
    ca_pem, wrong_pem = tmp_path / "ca.pem", tmp_path / "wrong-ca.pem"
    server_cert, server_key = issue(tmp_path, ca, "server", server=True)
    client_cert, client_key = issue(tmp_path, ca, "client", server=False)
    rogue_cert, rogue_key = issue(tmp_path, wrong, "rogue", server=False)

    async def refused(**kw) -> str:
        try:
            async with AsyncClient(address, timeout_s=5, **kw) as c:
                await c.generate("1+1=", max_new_tokens=2)
        except CotserveError as err:
            return err.code.name
        return "OK"

    async def main():
        nonlocal address
        # the worker speaks TLS only; the gateway trusts its CA, presents its own certificate to it, and requires one
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4, tls_cert=server_cert,
                                                 tls_key=server_key, tls_client_ca=ca_pem))
        gw = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], tls_cert=server_cert,
                                               tls_key=server_key, tls_client_ca=ca_pem, upstream_tls_ca=ca_pem))
        address = gw.server.address
        try:
            for _ in range(200):
                if gw.pool.models():
                    break
                await asyncio.sleep(0.05)
            ok_kw = dict(root_certificates=str(ca_pem), client_cert=str(client_cert), client_key=str(client_key))
            async with AsyncClient(address, **ok_kw) as c:
                text = (await c.generate("37+48-12=", max_new_tokens=32)).text
            outcomes = {"plaintext": await refused(), "wrong CA": await refused(root_certificates=str(wrong_pem),
                                                                                 client_cert=str(client_cert), client_key=str(client_key)),
                        "no client certificate": await refused(root_certificates=str(ca_pem)),
                        "client certificate of another CA": await refused(root_certificates=str(ca_pem),
                                                                          client_cert=str(rogue_cert), client_key=str(rogue_key))}
            async with grpc.aio.insecure_channel(worker.server.address) as ch:  # the worker refuses plaintext too
                with pytest.raises(grpc.aio.AioRpcError) as plain:
                    await worker_pb2_grpc.WorkerServiceStub(ch).Info(worker_pb2.InfoRequest(), timeout=2)
                assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "cotserve.cli", "generate", "37+48-12=", "--address", address, "--tls-ca", str(ca_pem),
                "--tls-cert", str(client_cert), "--tls-key", str(client_key), stdout=asyncio.subprocess.PIPE)
            out, _ = await cli.communicate()
            return text, outcomes, out.decode()
        finally:
            await gw.stop()
            await worker.stop()

    address = ""
    text, outcomes, cli_out = asyncio.run(main())
    assert text == "<think>37+48=85. 85-12=73.</think> 73"
    assert outcomes == {"plaintext": "UNAVAILABLE", "wrong CA": "UNAVAILABLE", "no client certificate": "UNAVAILABLE",
                        "client certificate of another CA": "UNAVAILABLE"}
    assert cli_out.startswith("<think>37+48=85. 85-12=73.</think> 73\n")


def test_tls_settings_that_cannot_serve_are_refused_naming_the_setting(tmp_path):
    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="tls_cert / tls_key: give both"):
        TlsSettings(tls_cert=pem).check_tls()
    with pytest.raises(ValueError, match="tls_client_ca: mutual TLS needs the service's own tls_cert"):
        TlsSettings(tls_client_ca=pem).check_tls()
    with pytest.raises(ValueError, match="tls_key: .*junk.pem is not PEM"):
        TlsSettings(tls_cert=pem, tls_key=junk).check_tls()
    with pytest.raises(ValueError, match="tls_cert: cannot read"):
        GatewayConfig(workers=["127.0.0.1:1"], tls_cert=tmp_path / "missing.pem", tls_key=pem).validate()
