"""The worker's command: `cotserve serve worker`, generated from `WorkerConfig`."""

from __future__ import annotations

import typer

from cotserve.common.config import serve_service
from cotserve.worker.config import WorkerConfig


def mount(root: typer.Typer, serve: typer.Typer) -> None:
    """The worker's command on the `cotserve` command line."""
    serve_service(serve, "worker", WorkerConfig, "Start one model worker.")
