"""The gateway's commands: `cotserve serve gateway` (generated from `GatewayConfig`) and `cotserve tenants add-key`
(API keys for the gateway's tenants)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cotserve.common.config import serve_service
from cotserve.gateway.config import GatewayConfig

tenants_app = typer.Typer(help="Tenants of the gateway: API keys and limits.", no_args_is_help=True)


@tenants_app.command("add-key")
def tenants_add_key(
    name: str = typer.Argument(..., help="Tenant name (created if new)."),
    file: Path = typer.Option(..., "--file", envvar="COTSERVE_TENANTS_FILE", help="The tenants TOML file (created if missing)."),
    requests_per_min: Optional[int] = typer.Option(None, help="Set the tenant's requests per minute."),
    tokens_per_min: Optional[int] = typer.Option(None, help="Set the tenant's tokens (prompt + completion) per minute."),
    max_concurrent: Optional[int] = typer.Option(None, help="Set the tenant's concurrent requests."),
    sla_classes: Optional[str] = typer.Option(None, help="Set the classes the tenant may use, comma-separated from realtime, interactive, batch (a new tenant gets interactive,batch: REALTIME is granted explicitly)."),
) -> None:
    """Create an API key for a tenant: print it once, store only its SHA-256 hash."""
    from cotserve.common.sampling import SlaClass
    from cotserve.gateway.tenants import add_key

    classes = None
    if sla_classes is not None:
        try:
            classes = frozenset(SlaClass[c.strip().upper()] for c in sla_classes.split(",") if c.strip())
        except KeyError:
            raise typer.BadParameter(f"sla_classes: {sla_classes!r}, allowed: realtime, interactive, batch") from None
        if not classes:
            raise typer.BadParameter("sla_classes: name at least one of realtime, interactive, batch")
    for flag, value in (("requests_per_min", requests_per_min), ("tokens_per_min", tokens_per_min),
                        ("max_concurrent", max_concurrent)):
        if value is not None and value < 1:
            raise typer.BadParameter(f"{flag}: {value}, must be >= 1")
    try:
        key = add_key(file, name, classes, requests_per_min=requests_per_min, tokens_per_min=tokens_per_min,
                      max_concurrent=max_concurrent)
    except ValueError as exc:
        typer.echo(f"cotserve tenants: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(key)
    typer.echo(f"stored the key's SHA-256 for tenant {name!r} in {file}; this is the only time the key is shown", err=True)


def mount(root: typer.Typer, serve: typer.Typer) -> None:
    """The gateway's commands on the `cotserve` command line."""
    serve_service(serve, "gateway", GatewayConfig, "Start one gateway in front of one or more workers.")
    root.add_typer(tenants_app, name="tenants")
