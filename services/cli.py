"""`cotserve`: the command line. Each room (service, tool) defines its own commands in its `cli.py` and a
`mount(root, serve)` that puts them here; this module only mounts them.

Flags win over `COTSERVE_*` environment variables, which win over a `--config` file (the `serve` commands), which
wins over defaults.
"""

from __future__ import annotations

import importlib

import typer

ROOMS = ("cotserve.up", "cotserve.worker.cli", "cotserve.gateway.cli", "cotserve.telemetry.cli", "cotserve.slo.cli",
         "cotserve.router.cli", "cotserve.sandbox.cli", "cotserve.sdk.cli", "cotserve.bench.cli", "cotserve.kveval.cli",
         "cotserve.demo.cli")
"""The modules whose `mount(root, serve)` adds commands, in the order `cotserve --help` lists them."""

app = typer.Typer(help="cotserve: serve language models, reasoning models first.", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_show_locals=False)
serve_app = typer.Typer(help="Run one service in the foreground.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")
for _room in ROOMS:
    importlib.import_module(_room).mount(app, serve_app)


def main() -> None:
    from cotserve.common.procs import die_with_supervisor

    die_with_supervisor()
    app()


if __name__ == "__main__":
    main()
