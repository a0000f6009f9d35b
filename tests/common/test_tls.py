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
    worker_cert, worker_key = issue(tmp_path, ca, "worker", server=True)  # each service its identity's certificate
    server_cert, server_key = issue(tmp_path, ca, "gateway", server=True)
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
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4, tls_cert=worker_cert,
                                                 tls_key=worker_key, tls_client_ca=ca_pem))
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
    with pytest.raises(ValueError, match=r"health_port: 70000, allowed 0\.\.65535"):
        TlsSettings(health_port=70000).check_tls()
    with pytest.raises(ValueError, match="upstream_tls_cert / upstream_tls_key: give both"):
        GatewayConfig(workers=["127.0.0.1:1"], upstream_tls_ca=pem, upstream_tls_cert=pem).validate()
    with pytest.raises(ValueError, match="upstream_tls_cert: presenting a certificate needs upstream_tls_ca"):
        GatewayConfig(workers=["127.0.0.1:1"], upstream_tls_cert=pem, upstream_tls_key=pem).validate()


def test_the_health_port_answers_probes_in_plaintext_and_nothing_else(tmp_path):
    """A service with mutual TLS refuses a probe without a certificate on its port; its health port answers the
    same health in plaintext (a Kubernetes gRPC probe) and serves no other RPC."""
    from cotserve.common.procs import free_port, health_status
    from cotserve.common.tlsgen import local_tls
    from cotserve.telemetry.config import TelemetryConfig
    from cotserve.telemetry.server import start_telemetry
    from cotserve.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc

    local_tls(tmp_path, identities=("telemetry",))
    health_port = free_port()

    async def main():
        running = await start_telemetry(TelemetryConfig(port=0, state_file=None, tls_cert=tmp_path / "telemetry.pem",
                                                        tls_key=tmp_path / "telemetry.key",
                                                        tls_client_ca=tmp_path / "cotserve-local-ca.pem",
                                                        health_port=health_port))
        probe = f"127.0.0.1:{health_port}"
        try:
            statuses = await asyncio.to_thread(lambda: (health_status(running.server.address, 2.0, None),
                                                        health_status(probe, 2.0, None)))
            async with grpc.aio.insecure_channel(probe) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as other:
                    await telemetry_pb2_grpc.TelemetryServiceStub(ch).GetStats(telemetry_pb2.GetStatsRequest(), timeout=5)
        finally:
            await running.stop()
        stopped = await asyncio.to_thread(health_status, probe, 1.0, None)
        return statuses, other.value.code(), stopped

    (on_port, on_probe), other, stopped = asyncio.run(main())
    assert on_port is None  # no certificate: no handshake, no answer
    assert on_probe == 1  # SERVING
    assert other == grpc.StatusCode.UNIMPLEMENTED
    assert stopped is None  # the probe port closes with the service


def _handshake(files, server_hostname: str) -> str:
    """A real TLS handshake over a loopback socket: a server presenting `files`' server certificate, a client that
    trusts only `files`' CA and checks `server_hostname`; returns the negotiated protocol version."""
    import socket
    import ssl
    import threading

    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(files / "server.pem", files / "server.key")
    client_ctx = ssl.create_default_context(cafile=str(files / "cotserve-local-ca.pem"))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)
            except (ssl.SSLError, OSError):
                pass

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with socket.create_connection(listener.getsockname()) as raw:
            with client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
                version = tls.version()
                tls.sendall(b"x")
        thread.join(5)
    return version


def test_tls_init_makes_certificates_for_the_hosts_named(tmp_path):
    """`cotserve tls init --host gateway --host 10.1.2.3`: a CA, a server and a client certificate in a new folder,
    keys readable by the owner only; the server certificate passes a real handshake for each name given and for
    localhost, and fails one for a name not given."""
    import ssl
    import stat
    import subprocess

    out = tmp_path / "tls" / "nested"
    result = subprocess.run([sys.executable, "-m", "cotserve.cli", "tls", "init", "--out", str(out), "--host", "gateway",
                             "--host", "10.1.2.3", "--days", "7"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    from cotserve.common.authz import IDENTITIES

    names = ["cotserve-local-ca.pem", "server.pem", "server.key", "client.pem", "client.key",
             *(f"{i}.{ext}" for i in IDENTITIES for ext in ("pem", "key"))]
    assert result.stdout.split() == [str(out / n) for n in names]
    for key in ("cotserve-local-ca.key", "server.key", "client.key", *(f"{i}.key" for i in IDENTITIES)):
        assert stat.S_IMODE((out / key).stat().st_mode) == 0o600
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    for identity in IDENTITIES:  # each identity's certificate names it, and is valid for its own host name
        cert = x509.load_pem_x509_certificate((out / f"{identity}.pem").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == identity
        assert identity in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    for host in ("gateway", "10.1.2.3", "localhost", "127.0.0.1"):
        assert _handshake(out, host).startswith("TLS")
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        _handshake(out, "worker")

    from cryptography import x509
    cert = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert 7 * 86400 <= lifetime.total_seconds() <= 7 * 86400 + 600

    bad = subprocess.run([sys.executable, "-m", "cotserve.cli", "tls", "init", "--out", str(out), "--days", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--days" in bad.stderr


def test_a_worker_found_through_dns_is_checked_against_the_name_it_was_found_by(tmp_path):
    """A Kubernetes headless Service answers pod addresses, which no certificate names: the gateway checks the
    worker's certificate against the Service's name (`worker`) instead, presenting its `gateway` identity. A worker
    whose certificate is for another name is not taken into rotation."""
    from cotserve.common.tlsgen import local_tls

    local_tls(tmp_path, identities=("worker", "gateway", "router"))
    ca = tmp_path / "cotserve-local-ca.pem"

    async def serve(identity: str) -> bool:
        worker = await start_worker(WorkerConfig(engine_process=False, host="127.0.0.2", port=0, max_num_seqs=4,
                                                 tls_cert=tmp_path / f"{identity}.pem", tls_key=tmp_path / f"{identity}.key",
                                                 tls_client_ca=ca))
        port = worker.server.port

        async def resolve(name: str, p: int) -> list[str]:
            return [f"127.0.0.2:{port}"] if name == "worker" else []

        gw = await start_gateway(GatewayConfig(port=0, worker_dns=[f"worker:{port}"], poll_interval_s=0.1,
                                               upstream_tls_ca=ca, upstream_tls_cert=tmp_path / "gateway.pem",
                                               upstream_tls_key=tmp_path / "gateway.key"), resolve=resolve)
        try:
            for _ in range(60):  # three seconds of polls
                if gw.pool.models():
                    async with AsyncClient(gw.server.address) as c:
                        return (await c.generate("37+48-12=", max_new_tokens=32)).text.endswith(" 73")
                await asyncio.sleep(0.05)
            return False
        finally:
            await gw.stop()
            await worker.stop()

    assert asyncio.run(serve("worker"))  # its certificate names `worker`: served
    assert not asyncio.run(serve("router"))  # a certificate for another name (and 127.0.0.2 in none): refused
