"""TLS for every service: the settings each service's config inherits (`--tls-cert`, `--tls-key`,
`--tls-client-ca`), and the credentials built from them. No grpc import until credentials are built: configs load at
every `cotserve` start.

With `tls_cert` and `tls_key` a service's gRPC port speaks TLS only (a plaintext client fails its handshake); with
`tls_client_ca` too, only clients presenting a certificate that chains to that CA get through (mutual TLS). A service
that calls others (the gateway: its workers, sandbox and SLO predictor) trusts `upstream_tls_ca` for them and, when it
has a certificate of its own, presents it.
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

    def check_tls(self) -> None:
        """ValueError naming the setting when the files cannot serve."""
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

    def ssl_context(self) -> Any:
        """An ssl.SSLContext for the service's HTTP ports (the same certificate, and client CA), None for plaintext."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        import ssl

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        if self.tls_client_ca is not None:
            context.load_verify_locations(self.tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_credentials(self, ca: Path | None) -> Any:
        """grpc.ChannelCredentials for calling a service that trusts `ca`'s certificates (None: plaintext), presenting
        this service's own certificate when it has one."""
        if ca is None:
            return None
        import grpc

        own = (_read(self.tls_key, "tls_key"), _read(self.tls_cert, "tls_cert")) if self.tls_cert and self.tls_key else (None, None)
        return grpc.ssl_channel_credentials(_read(ca, "upstream_tls_ca"), *own)


TLS_CA_ENV, TLS_CLIENT_CERT_ENV, TLS_CLIENT_KEY_ENV = "COTSERVE_TLS_CA", "COTSERVE_TLS_CLIENT_CERT", "COTSERVE_TLS_CLIENT_KEY"
"""Where a command-line client finds the CA (and its own certificate) for services that speak TLS: `cotserve generate`,
the admin commands (`router`, `sandbox`, `slo`, `heatmap`, `trace check`) and `up --tls`'s health checks read them."""


def env_credentials() -> Any:
    """grpc.ChannelCredentials from `COTSERVE_TLS_CA` (and the client certificate variables), None when it is unset."""
    import os

    ca = os.environ.get(TLS_CA_ENV)
    if not ca:
        return None
    import grpc

    def read(env: str) -> bytes | None:
        return _read(Path(os.environ[env]), env) if os.environ.get(env) else None

    return grpc.ssl_channel_credentials(_read(Path(ca), TLS_CA_ENV), read(TLS_CLIENT_KEY_ENV), read(TLS_CLIENT_CERT_ENV))


def client_channel(address: str) -> Any:
    """A blocking channel to a service: over TLS when `COTSERVE_TLS_CA` names a CA, else plaintext."""
    import grpc

    credentials = env_credentials()
    return grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)


def aio_channel(address: str, credentials: Any, **kwargs: Any) -> Any:
    """A grpc.aio channel to `address`: secure with `credentials`, plaintext without."""
    import grpc

    if credentials is None:
        return grpc.aio.insecure_channel(address, **kwargs)
    return grpc.aio.secure_channel(address, credentials, **kwargs)
