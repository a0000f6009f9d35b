"""TLS for every service: the settings each service's config inherits (`--tls-cert`, `--tls-key`,
`--tls-client-ca`), and the credentials built from them. No grpc import until credentials are built: configs load at
every `cotserve` start.

With `tls_cert` and `tls_key` a service's gRPC port speaks TLS only (a plaintext client fails its handshake); with
`tls_client_ca` too, only clients presenting a certificate that chains to that CA get through (mutual TLS), and the
certificate's common name is the identity `common.authz` authorizes. A service that calls others (the gateway: its
workers, sandbox and SLO predictor) trusts `upstream_tls_ca` for them and presents its identity's certificate.
Probes that cannot present a certificate (Kubernetes' gRPC probes, compose health checks) ask `health_port`: plaintext,
gRPC health only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _read(path: Path, name: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{name}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{name}: {path} is not PEM (no -----BEGIN line)")
    return data


@dataclass(slots=True)
class TlsSettings:
    """The TLS settings every service takes (each service's config class inherits them)."""

    tls_cert: Path | None = None
    """PEM certificate chain this service presents; with tls_key its gRPC port speaks TLS only."""
    tls_key: Path | None = None
    """PEM private key of tls_cert."""
    tls_client_ca: Path | None = None
    """PEM CA bundle client certificates must chain to: mutual TLS (a client without such a certificate is refused)."""
    health_port: int = 0
    """A second, plaintext port serving only gRPC health checks, for probes that cannot present a certificate
    (Kubernetes' gRPC probes); 0: none."""

    def check_tls(self) -> None:
        """ValueError naming the setting when the files cannot serve."""
        if not 0 <= self.health_port <= 65535:
            raise ValueError(f"health_port: {self.health_port}, allowed 0..65535")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert / tls_key: give both (TLS) or neither (plaintext)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca: mutual TLS needs the service's own tls_cert and tls_key")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            if getattr(self, name) is not None:
                _read(getattr(self, name), name)

    def server_credentials(self) -> Any:
        """grpc.ServerCredentials for the settings, None for plaintext."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        import grpc

        client_ca = _read(self.tls_client_ca, "tls_client_ca") if self.tls_client_ca is not None else None
        return grpc.ssl_server_credentials([(_read(self.tls_key, "tls_key"), _read(self.tls_cert, "tls_cert"))],
                                           root_certificates=client_ca, require_client_auth=client_ca is not None)

    def ssl_context(self, client_auth: bool = True) -> Any:
        """An ssl.SSLContext for the service's HTTP ports (the same certificate, and client CA unless not
        `client_auth`: a page for browsers), None for plaintext."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        import ssl

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        if self.tls_client_ca is not None and client_auth:
            context.load_verify_locations(self.tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_credentials(self, ca: Path | None, cert: Path | None = None, key: Path | None = None) -> Any:
        """grpc.ChannelCredentials for calling a service that trusts `ca`'s certificates (None: plaintext), presenting
        `cert` and `key` (default: this service's own certificate, when it has one)."""
        if ca is None:
            return None
        import grpc

        names = ("upstream_tls_key", "upstream_tls_cert")
        if cert is None:
            cert, key, names = self.tls_cert, self.tls_key, ("tls_key", "tls_cert")
        own = (_read(key, names[0]), _read(cert, names[1])) if cert and key else (None, None)
        return grpc.ssl_channel_credentials(_read(ca, "upstream_tls_ca"), *own)


TLS_CA_ENV, TLS_CLIENT_CERT_ENV, TLS_CLIENT_KEY_ENV = "COTSERVE_TLS_CA", "COTSERVE_TLS_CLIENT_CERT", "COTSERVE_TLS_CLIENT_KEY"
"""Where a client of the gateway finds the CA of the gateway's certificate (and its own certificate, for a gateway
asking for mutual TLS): `cotserve generate`, `trace check`'s requests."""

ADMIN_TLS_CA_ENV, ADMIN_TLS_CERT_ENV, ADMIN_TLS_KEY_ENV = "COTSERVE_ADMIN_TLS_CA", "COTSERVE_ADMIN_TLS_CERT", "COTSERVE_ADMIN_TLS_KEY"
"""Where the admin commands (`router`, `sandbox`, `slo`, `heatmap`, `trace check`'s lookups) and `up`'s health
checks find the CA of the internal services and the certificate they present (the `operator` identity's, for mutual
TLS). Unset, they read the gateway client's variables above, as before the services had identities of their own."""


def env_credentials(admin: bool = True) -> Any:
    """grpc.ChannelCredentials from the environment: the admin variables (`admin`, falling back to the gateway
    client's when `COTSERVE_ADMIN_TLS_CA` is unset) or the gateway client's; None (plaintext) when no CA is named."""
    import os

    names = (TLS_CA_ENV, TLS_CLIENT_CERT_ENV, TLS_CLIENT_KEY_ENV)
    if admin and os.environ.get(ADMIN_TLS_CA_ENV):
        names = (ADMIN_TLS_CA_ENV, ADMIN_TLS_CERT_ENV, ADMIN_TLS_KEY_ENV)
    ca, cert, key = names
    if not os.environ.get(ca):
        return None
    import grpc

    def read(env: str) -> bytes | None:
        return _read(Path(os.environ[env]), env) if os.environ.get(env) else None

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


def client_channel(address: str, credentials: Any = None) -> Any:
    """A blocking channel to a service with `credentials`, or (None) the admin credentials from the environment
    (`env_credentials`): TLS when a CA is named, else plaintext."""
    import grpc

    credentials = credentials or env_credentials()
    return grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)


def aio_channel(address: str, credentials: Any, **kwargs: Any) -> Any:
    """A grpc.aio channel to `address`: secure with `credentials`, plaintext without."""
    import grpc

    if credentials is None:
        return grpc.aio.insecure_channel(address, **kwargs)
    return grpc.aio.secure_channel(address, credentials, **kwargs)
