"""Helpers shared by the `cotserve` commands: logging, error exits, flag parsing, wide tables."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Coroutine, NoReturn

import typer

from cotserve.common.errors import CotserveError


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def fail(service: str, message: object) -> NoReturn:
    """A start-up problem: one line on stderr naming the service, exit status 2, no traceback."""
    typer.echo(f"cotserve {service}: {message}", err=True)
    raise typer.Exit(2)


def run_loop(main: Coroutine):
    """Run `main` to completion on uvloop where it is installed (grpc.aio's poller hands every completion to the
    event loop, and uvloop's loop iteration costs a fraction of asyncio's: one request through the gateway took
    1.70-1.84 ms of its CPU on asyncio's loop and 1.43-1.46 on uvloop's, time to first token 5.0-5.7 -> 4.2-4.3 ms,
    both services on the same loop in each run); `COTSERVE_EVENT_LOOP=asyncio` keeps the standard library's."""
    choice = os.environ.get("COTSERVE_EVENT_LOOP", "uvloop")
    if choice not in ("uvloop", "asyncio"):
        main.close()
        raise ValueError(f"COTSERVE_EVENT_LOOP={choice!r}: give uvloop or asyncio")
    if choice == "uvloop":
        try:
            import uvloop
        except ImportError:  # not on this platform (Windows): the standard loop
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def run_service(service: str, main: Coroutine) -> None:
    """Run a service's `serve()` to completion (`run_loop`); configuration, model and binding errors `fail`."""
    try:
        run_loop(main)
    except (CotserveError, ValueError, OSError) as exc:
        fail(service, getattr(exc, "message", exc))


def int_list(text: str, example: str = "1,8,32", minimum: int = 1) -> list[int]:
    """A comma-separated list of integers from a flag, each >= `minimum`, or a BadParameter naming the rule."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: give comma-separated integers, e.g. {example}") from None
    if not values or min(values) < minimum:
        raise typer.BadParameter(f"{text!r}: every value must be >= {minimum}")
    return values


def rpc_error_exit(err) -> None:
    typer.echo(f"error: {err.code().name}: {err.details()}", err=True)
    raise typer.Exit(1)


def wide_console():
    """Tables print whole when piped to a file (rich would otherwise assume 80 columns)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def command_rows(group, prefix: str = "cotserve") -> list[tuple[str, str, str]]:
    """Every command under a (typer) click group, depth first in the group's order: its invocation with arguments,
    the first paragraph of its help, and its options (listed up to eight, else the first six and how many more).
    The README's command table is made from these, so it says what the command line says."""
    rows = []
    for name, cmd in group.commands.items():
        if getattr(cmd, "hidden", False):
            continue
        path = f"{prefix} {name}"
        if hasattr(cmd, "commands"):
            rows += command_rows(cmd, path)
            continue
        args = " ".join(p.name.upper() if p.required else f"[{p.name.upper()}]"
                        for p in cmd.params if p.param_type_name == "argument")
        flags = [p.opts[0] for p in cmd.params if p.param_type_name == "option" and p.name != "help"]
        shown = flags if len(flags) <= 8 else [*flags[:6], f"and {len(flags) - 6} more"]
        help_text = " ".join((cmd.help or "").split("\n\n")[0].split())
        rows.append((f"{path} {args}".strip(), help_text, ", ".join(f"`{f}`" if f.startswith("-") else f for f in shown)))
    return rows


def command_table(group) -> str:
    """`command_rows` as a markdown table."""
    lines = ["| command | what it does | options |", "| --- | --- | --- |"]
    for command, help_text, options in command_rows(group):
        lines.append(f"| `{command}` | {help_text.replace('|', chr(92) + '|')} | {options} |")
    return "\n".join(lines) + "\n"
