"""`cotserve demo train | eval`: the bundled demo model, trained and measured."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cotserve.common.clitools import run_loop

demo_app = typer.Typer(help="The bundled demo model: train it, measure it.", no_args_is_help=True)


@demo_app.command("train")
def demo_train(
    out: Path = typer.Option(..., help="Folder to write the checkpoint to."),
    task: str = typer.Option("demo", help="demo (the bundled demo model) or testbed (the reasoning testbed)."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps (default 3000; 2400 for the testbed)."),
    seed: int = typer.Option(0, help="Seed for weights and data."),
) -> None:
    """Train the demo arithmetic model or the reasoning testbed (15-25 minutes on 2 CPU cores)."""
    from cotserve.demo.train import main as train_main

    train_main(["--out", str(out), "--task", task, "--seed", str(seed), *(["--steps", str(steps)] if steps is not None else [])])


@demo_app.command("eval")
def demo_eval(
    address: str = typer.Option("127.0.0.1:50051", help="Address of a worker serving the demo model."),
    n: int = typer.Option(500, help="Problems to ask."),
    seed: int = typer.Option(12345, help="Seed of the problem set."),
    concurrency: int = typer.Option(32, help="Requests in flight at once."),
) -> None:
    """Ask a served demo model fresh arithmetic problems (greedy) and print its exact-answer accuracy."""
    from cotserve.demo.evaluate import evaluate

    result = run_loop(evaluate(address, n=n, seed=seed, concurrency=concurrency, progress=True))
    typer.echo(f"accuracy {result.correct}/{result.total} = {result.accuracy:.1%} ({result.seconds:.1f}s)")


def mount(root: typer.Typer, serve: typer.Typer) -> None:
    """The demo model's commands on the `cotserve` command line."""
    root.add_typer(demo_app, name="demo")
