"""A local certificate authority for `cotserve up --tls`, `cotserve tls init` (the compose stack's and Envoy's
certificates) and the TLS tests: a CA, a server certificate for the loopback addresses (and any host names given),
a client certificate, and one certificate per service identity (`common.authz.IDENTITIES`: its common name is the
identity the authorization table names; it serves and calls, valid for loopback, the hosts given and the identity's
own name, as a compose service or a Kubernetes Service of that name resolves), as PEM files in one folder."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import typer


@dataclass(frozen=True, slots=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _write(folder: Path, stem: str, cert, key) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization

    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = folder / f"{stem}.key"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return folder / f"{stem}.pem", key_path


def _builder(subject: str, issuer, public_key, days: int):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer).public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days)))


def make_ca(folder: Path, name: str = "cotserve-local-ca", days: int = 30):
    """A self-signed CA, written as `<name>.pem` / `<name>.key`; returns (certificate, key) to issue with."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(name, subject, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).sign(key, hashes.SHA256()))
    _write(folder, name, cert, key)
    return cert, key


def _alt_name(host: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def issue(folder: Path, ca, stem: str, server: bool, days: int = 30, hosts: Sequence[str] = ()) -> tuple[Path, Path]:
    """A certificate signed by `ca` (from `make_ca`): for a server, valid for 127.0.0.1, ::1, localhost and `hosts`
    (names or addresses)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(stem, ca_cert.subject, key.public_key(), days)
    if server:
        names = dict.fromkeys(["127.0.0.1", "::1", "localhost", *hosts])
        builder = builder.add_extension(x509.SubjectAlternativeName([_alt_name(h) for h in names]), critical=False)
    return _write(folder, stem, builder.sign(ca_key, hashes.SHA256()), key)


def local_tls(folder: Path, hosts: Sequence[str] = (), days: int = 30,
              identities: Sequence[str] = ()) -> TlsFiles:
    """A fresh CA with a server certificate (loopback and `hosts`), a client certificate and a certificate for each
    of `identities` (`<identity>.pem` / `.key`) in `folder`."""
    ca = make_ca(folder, days=days)
    server = issue(folder, ca, "server", server=True, days=days, hosts=hosts)
    client = issue(folder, ca, "client", server=False, days=days)
    for identity in identities:
        issue(folder, ca, identity, server=True, days=days, hosts=(*hosts, identity))
    return TlsFiles(folder / "cotserve-local-ca.pem", *server, *client)


@dataclass(frozen=True, slots=True)
class StackTls:
    """The certificates of a stack on one machine (`cotserve up`, the benchmarks), made by `local_tls` in `folder`:
    mutual TLS between its services, each presenting its identity's certificate (`internal`), and the gateway's
    public ports (gRPC, HTTP) and the heatmap page over TLS with the server certificate too (`public`)."""

    folder: Path
    internal: bool = True
    public: bool = False

    @property
    def ca(self) -> Path:
        return self.folder / "cotserve-local-ca.pem"

    def identity(self, name: str) -> tuple[Path, Path]:
        """`name`'s certificate and key."""
        return self.folder / f"{name}.pem", self.folder / f"{name}.key"

    def credentials(self, identity: str | None):
        """grpc.ChannelCredentials trusting the CA and presenting `identity`'s certificate (None: none)."""
        from cotserve.common.tls import TlsSettings

        cert, key = self.identity(identity) if identity else (None, None)
        return TlsSettings().client_credentials(self.ca, cert, key)

    def operator_env(self) -> dict[str, str]:
        """The variables with which `cotserve`'s admin commands call the services as `operator`."""
        from cotserve.common.tls import ADMIN_TLS_CA_ENV, ADMIN_TLS_CERT_ENV, ADMIN_TLS_KEY_ENV

        cert, key = self.identity("operator")
        return {ADMIN_TLS_CA_ENV: str(self.ca), ADMIN_TLS_CERT_ENV: str(cert), ADMIN_TLS_KEY_ENV: str(key)}


def stack_tls(folder: Path, internal: bool = True, public: bool = False) -> StackTls | None:
    """A fresh CA and every identity's certificate in `folder` for a stack with mutual TLS inside (`internal`)
    and/or TLS on its public ports (`public`); None when neither."""
    from cotserve.common.authz import IDENTITIES

    if not (internal or public):
        return None
    local_tls(folder, identities=IDENTITIES)
    return StackTls(folder, internal, public)


tls_app = typer.Typer(help="Certificates for TLS between cotserve's services and its clients.", no_args_is_help=True)


@tls_app.command("init")
def init_command(
    out: Path = typer.Option(..., "--out", help="Folder for the PEM files (made if missing): cotserve-local-ca.pem, server.pem/.key, client.pem/.key."),
    host: Optional[list[str]] = typer.Option(None, "--host", help="A name or address the server certificate is also valid for (repeat; loopback is always in)."),
    days: int = typer.Option(365, "--days", min=1, help="Days the certificates are valid."),
    identity: Optional[list[str]] = typer.Option(None, "--identity", help="A service identity to issue a certificate "
                                                 "for (repeat; default: every identity of the authorization table)."),
) -> None:
    """Make a local CA, a server and a client certificate, and one certificate per service identity (for mutual TLS
    between the services: their common names are the identities `common/authz.py` authorizes)."""
    from cotserve.common.authz import IDENTITIES

    unknown = sorted(set(identity or ()) - set(IDENTITIES))
    if unknown:
        raise typer.BadParameter(f"{', '.join(unknown)} (identities: {', '.join(IDENTITIES)})", param_hint="--identity")
    names = tuple(identity or IDENTITIES)
    files = local_tls(out, host or (), days, names)
    for path in (files.ca, files.server_cert, files.server_key, files.client_cert, files.client_key):
        typer.echo(path)
    for name in names:
        typer.echo(out / f"{name}.pem")
        typer.echo(out / f"{name}.key")


def mount(root: typer.Typer, serve: typer.Typer) -> None:
    """`cotserve tls init` on the command line."""
    root.add_typer(tls_app, name="tls")
