"""`cotserve`: the command line. Each room (service, tool) defines its own commands in its `cli.py` and a
`mount(root, serve)` that puts them here; this module only mounts them.

Flags win over `COTSERVE_*` environment variables, which win over a `--config` file (the `serve` commands), which
wins over defaults.
"""

from __future__ import annotations

import importlib
import sys

import typer
import typer.main

ROOMS = ("cotserve.up", "cotserve.sdk.cli", "cotserve.worker.cli", "cotserve.gateway.cli", "cotserve.telemetry.cli",
         "cotserve.slo.cli", "cotserve.router.cli", "cotserve.sandbox.cli", "cotserve.bench.cli", "cotserve.kveval.cli",
         "cotserve.demo.cli", "cotserve.common.tlsgen")
"""The modules whose `mount(root, serve)` adds commands, in the order `cotserve --help` lists them."""

app = typer.Typer(help="cotserve: serve language models, reasoning models first.", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_show_locals=False)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"cotserve {version('cotserve')}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                       help="Print the installed cotserve's version and exit.")) -> None:
    """cotserve: serve language models, reasoning models first."""
serve_app = typer.Typer(help="Run one service in the foreground.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")
for _room in ROOMS:
    importlib.import_module(_room).mount(app, serve_app)


README = "README.md"
TABLE_START = "<!-- commands: made by `make readme` from the command line itself; tests/test_cli.py checks it is current -->"
TABLE_END = "<!-- commands end -->"


def readme_with_commands(text: str) -> str:
    """The README's text with its command table (between TABLE_START and TABLE_END) made anew from `app`."""
    from cotserve.common.clitools import command_table

    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_START}\n{command_table(typer.main.get_command(app))}{TABLE_END}{tail}"


SERVICE_EXTRAS = ("worker", "gateway", "router", "slo", "sandbox", "telemetry")
"""Services whose packages are the extra of their name (`pip install 'cotserve[worker]'`); everything else that needs
more than the client's packages (`up`, `bench`, ...) is in `cotserve[all]`."""


def missing_extra_message(argv: list[str], err: ModuleNotFoundError) -> str:
    """What to tell a user whose install lacks a package the command imports: the extra that brings it."""
    extra = argv[2] if argv[1:2] == ["serve"] and argv[2:3] and argv[2] in SERVICE_EXTRAS else "all"
    command = " ".join(["cotserve", *argv[1:3 if extra != "all" else 2]])
    return (f"{command}: a package it needs is not installed ({err.name or err}): "
            f"pip install 'cotserve[{extra}]'")


def main() -> None:
    from cotserve.common.procs import die_with_supervisor

    die_with_supervisor()
    try:
        app()
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] == "cotserve":
            raise  # our own code missing is a bug, not an install choice
        typer.echo(missing_extra_message(sys.argv, err), err=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
