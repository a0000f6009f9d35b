"""`cotserve up | serve SERVICE | generate | demo ...`: the command line.

Flags win over `COTSERVE_*` environment variables, which win over defaults.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="cotserve: serve language models, reasoning models first.", no_args_is_help=True, add_completion=False)
serve_app = typer.Typer(help="Run one service in the foreground.", no_args_is_help=True)
demo_app = typer.Typer(help="The bundled demo model: train it, measure it.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")
app.add_typer(demo_app, name="demo")


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@serve_app.command("worker")
def serve_worker(
    model: Optional[Path] = typer.Option(None, envvar="COTSERVE_MODEL", help="Hugging Face checkpoint folder (default: the bundled demo model)."),
    host: str = typer.Option("127.0.0.1", envvar="COTSERVE_HOST", help="Address to bind."),
    port: int = typer.Option(50061, envvar="COTSERVE_WORKER_PORT", help="Port to bind (0 picks a free one)."),
    device: str = typer.Option("auto", envvar="COTSERVE_DEVICE", help="cpu, cuda, cuda:N or auto (CUDA when available)."),
    dtype: str = typer.Option("auto", envvar="COTSERVE_DTYPE", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16."),
    kv_cache_bytes: Optional[int] = typer.Option(None, envvar="COTSERVE_KV_CACHE_BYTES", help="KV pool size in bytes (default: 5% of available RAM on CPU, 90% of free GPU memory)."),
    block_size: int = typer.Option(16, envvar="COTSERVE_BLOCK_SIZE", help="Tokens per KV block."),
    max_num_seqs: int = typer.Option(64, envvar="COTSERVE_MAX_NUM_SEQS", help="Sequences per batch at most."),
    max_num_batched_tokens: int = typer.Option(512, envvar="COTSERVE_MAX_NUM_BATCHED_TOKENS", help="Tokens per engine step at most (prefill chunk bound)."),
    max_model_len: Optional[int] = typer.Option(None, envvar="COTSERVE_MAX_MODEL_LEN", help="Longest sequence served (default: the model's context)."),
    served_model_name: Optional[str] = typer.Option(None, envvar="COTSERVE_SERVED_MODEL_NAME", help="Model name clients use (default: the folder's name)."),
    grace_s: float = typer.Option(5.0, envvar="COTSERVE_GRACE_S", help="Seconds to drain in-flight streams on SIGTERM."),
) -> None:
    """Start one model worker."""
    from cotserve.common.errors import ModelLoadError
    from cotserve.worker.server import DEMO_MODEL, WorkerConfig, serve

    _logging()
    cfg = WorkerConfig(
        model=model or DEMO_MODEL, host=host, port=port, device=device, dtype=dtype, kv_cache_bytes=kv_cache_bytes,
        block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, served_model_name=served_model_name, grace_s=grace_s,
    )
    try:
        asyncio.run(serve(cfg))
    except (ModelLoadError, ValueError, OSError) as exc:
        typer.echo(f"cotserve worker: {getattr(exc, 'message', exc)}", err=True)
        raise typer.Exit(2) from None


@app.command("up")
def up(
    model: Optional[Path] = typer.Option(None, envvar="COTSERVE_MODEL", help="Checkpoint folder for the worker (default: the bundled demo model)."),
    port: int = typer.Option(50051, envvar="COTSERVE_PORT", help="Public port of the stack."),
    start_timeout_s: float = typer.Option(120.0, help="Seconds to wait for each service to report SERVING."),
) -> None:
    """Start every service on loopback, wait until each is SERVING, stop all on Ctrl-C/SIGTERM."""
    from rich.console import Console

    from cotserve.common.procs import Child, python_cli, wait_serving

    console = Console(stderr=True)
    worker_args = ["serve", "worker", "--port", str(port)] + (["--model", str(model)] if model else [])
    children = [Child("worker", f"127.0.0.1:{port}", python_cli(*worker_args))]
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for child in children:
            child.start()
            started = time.monotonic()
            with console.status(f"starting {child.name} on {child.address} ...") as status:
                def progress() -> None:
                    status.update(f"starting {child.name} on {child.address} ... {time.monotonic() - started:.0f}s")
                    if stopping:
                        raise KeyboardInterrupt
                wait_serving(child, start_timeout_s, progress)
            console.print(f"[green]✓[/green] {child.name} SERVING on {child.address}")
        console.print(f"cotserve is up: worker API on 127.0.0.1:{port}")
        console.print(f"  try: cotserve generate \"37+48-12=\" --address 127.0.0.1:{port}")
        while not stopping:
            for child in children:
                if child.proc.poll() is not None:
                    console.print(f"[red]{child.name} exited with code {child.proc.returncode}[/red]")
                    console.print(child.log_tail(), markup=False, soft_wrap=True, highlight=False)
                    raise typer.Exit(1)
            time.sleep(0.5)
    except RuntimeError as exc:
        console.print("[red]cotserve up failed:[/red]", end=" ")
        console.print(str(exc), markup=False, soft_wrap=True, highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass
    finally:
        console.print("stopping ...")
        for child in reversed(children):
            child.stop(grace_s=5.0)
        console.print("stopped")


@app.command("generate")
def generate(
    prompt: str = typer.Argument(..., help="Prompt text."),
    address: str = typer.Option("127.0.0.1:50051", envvar="COTSERVE_ADDRESS", help="Address of the worker."),
    max_new_tokens: int = typer.Option(256, help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, help="Sampling temperature, 0..2 (0 = greedy)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    stream: bool = typer.Option(False, "--stream", help="Print text as it arrives."),
) -> None:
    """Generate a completion and print it with its timing line."""
    import grpc

    from cotserve.common.v1 import common_pb2
    from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

    sp = common_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    if seed is not None:
        sp.seed = seed
    text, last = [], None
    try:
        with grpc.insecure_channel(address) as ch:
            for chunk in worker_pb2_grpc.WorkerServiceStub(ch).Generate(worker_pb2.GenerateRequest(prompt_text=prompt, sampling=sp)):
                text.append(chunk.text)
                if stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                last = chunk
    except grpc.RpcError as err:
        typer.echo(f"error: {err.code().name}: {err.details()}", err=True)
        raise typer.Exit(1) from None
    if not stream:
        sys.stdout.write("".join(text))
    t = last.timing
    typer.echo(f"\n[{common_pb2.FinishReason.Name(last.finish_reason)} | {last.usage.completion_tokens} tokens | "
               f"queue {t.queue_ms:.1f} ms, ttft {t.ttft_ms:.1f} ms, total {t.total_ms:.1f} ms]")


@demo_app.command("train")
def demo_train(
    out: Path = typer.Option(..., help="Folder to write the checkpoint to."),
    steps: int = typer.Option(4000, help="Optimizer steps."),
    seed: int = typer.Option(0, help="Seed for weights and data."),
) -> None:
    """Train the demo arithmetic model (about 15 minutes on 2 CPU cores)."""
    from cotserve.worker.demo.train import main as train_main

    train_main(["--out", str(out), "--steps", str(steps), "--seed", str(seed)])


@demo_app.command("eval")
def demo_eval(
    address: str = typer.Option("127.0.0.1:50051", help="Address of a worker serving the demo model."),
    n: int = typer.Option(500, help="Problems to ask."),
    seed: int = typer.Option(12345, help="Seed of the problem set."),
    concurrency: int = typer.Option(32, help="Requests in flight at once."),
) -> None:
    """Ask a served demo model fresh arithmetic problems (greedy) and print its exact-answer accuracy."""
    from cotserve.worker.demo.evaluate import evaluate

    result = asyncio.run(evaluate(address, n=n, seed=seed, concurrency=concurrency, progress=True))
    typer.echo(f"accuracy {result.correct}/{result.total} = {result.accuracy:.1%} ({result.seconds:.1f}s)")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
