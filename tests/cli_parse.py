"""A command line as `cotserve` would parse it, for the deployment tests (compose, Kubernetes)."""

from __future__ import annotations

from typing import Any

import typer.main


def parse_cli(args: list[str]) -> tuple[Any, dict]:
    """`args` parsed by the real `cotserve` command line down to the command they name: (command, its parameters).
    A bad option or value raises click's usage error, as `cotserve` would exit 2 on it."""
    from cotserve.cli import app

    cmd = typer.main.get_command(app)
    ctx = cmd.make_context("cotserve", list(args), resilient_parsing=False)
    while hasattr(cmd, "resolve_command"):  # a group (typer's groups are not click.Group subclasses)
        name, cmd, rest = cmd.resolve_command(ctx, ctx._protected_args + ctx.args)
        ctx = cmd.make_context(name, rest, parent=ctx)
    return cmd, ctx.params


def envvars(cmd: Any) -> set[str]:
    """Every environment variable a command's options read."""
    return {v for p in cmd.params for v in ([p.envvar] if isinstance(p.envvar, str) else p.envvar or [])}
