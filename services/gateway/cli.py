"""`cotserve tenants add-key`: API keys for the gateway's tenants."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


tenants_app = typer.Typer(help="Tenants of the gateway: API keys and limits.", no_args_is_help=True)


@tenants_app.command("add-key")
def tenants_add_key(
    name: str = typer.Argument(..., help="Tenant name (created if new)."),
    file: Path = typer.Option(..., "--file", envvar="COTSERVE_TENANTS_FILE", help="The tenants TOML file (created if missing)."),
    requests_per_min: Optional[int] = typer.Option(None, help="Set the tenant's requests per minute."),
    tokens_per_min: Optional[int] = typer.Option(None, help="Set the tenant's tokens (prompt + completion) per minute."),
    max_concurrent: Optional[int] = typer.Option(None, help="Set the tenant's concurrent requests."),
) -> None:
    """Create an API key for a tenant: print it once, store only its SHA-256 hash."""
    from cotserve.gateway.tenants import add_key

    for flag, value in (("requests_per_min", requests_per_min), ("tokens_per_min", tokens_per_min),
                        ("max_concurrent", max_concurrent)):
        if value is not None and value < 1:
            raise typer.BadParameter(f"{flag}: {value}, must be >= 1")
    try:
        key = add_key(file, name, requests_per_min=requests_per_min, tokens_per_min=tokens_per_min,
                      max_concurrent=max_concurrent)
    except ValueError as exc:
        typer.echo(f"cotserve tenants: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(key)
    typer.echo(f"stored the key's SHA-256 for tenant {name!r} in {file}; this is the only time the key is shown", err=True)
