"""Helpers shared by the `cotserve` commands: logging, error exits, wide tables, the local stack."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Coroutine, NoReturn, Optional

import typer

from cotserve.common.errors import CotserveError


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def fail(service: str, message: object) -> NoReturn:
    """A start-up problem: one line on stderr naming the service, exit status 2, no traceback."""
    typer.echo(f"cotserve {service}: {message}", err=True)
    raise typer.Exit(2)


def run_service(service: str, main: Coroutine) -> None:
    """Run a service's `serve()` to completion; configuration, model and binding errors `fail`."""
    try:
        asyncio.run(main)
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


def stack(model: Optional[Path], port: int, redis_url: Optional[str], full: bool = True,
           worker_extra: tuple[str, ...] = (), gateway_extra: tuple[str, ...] = (),
           telemetry_port: int = 4317, telemetry_http_port: int = 8317) -> tuple[list, str]:
    """The services `up` starts, in start order, and the Redis URL they share. `full=False` (benchmarks)
    starts only the worker and the gateway. With `full`, the telemetry service starts first and every
    other service exports its spans to it over OTLP (batched every half second); the gateway reports
    its windows to the SLO predictor and follows its forecasts."""
    from cotserve.common.procs import Child, free_port, grpc_ready, python_cli, redis_child

    children = []
    if redis_url is None and full:
        redis, redis_url = redis_child(free_port())
        children.append(redis)
    env = {"COTSERVE_REDIS_URL": redis_url} if redis_url else {}
    if full:
        telemetry_addr = f"127.0.0.1:{telemetry_port}"
        children.append(Child("telemetry", telemetry_addr,
                              python_cli("serve", "telemetry", "--port", str(telemetry_port), "--http-port", str(telemetry_http_port)),
                              grpc_ready(telemetry_addr), env))
        env = {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{telemetry_addr}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_BSP_SCHEDULE_DELAY": "500"}
    worker_addr = f"127.0.0.1:{free_port()}"
    # the bundled demo model ends each reasoning step with "."; another model's steps are its operator's to name
    demo = ["--reasoning-step", "."] if model is None and "--model" not in worker_extra else []
    worker_args = ["serve", "worker", "--port", worker_addr.rsplit(":", 1)[1], *demo, *worker_extra] + (["--model", str(model)] if model else [])
    children.append(Child("worker", worker_addr, python_cli(*worker_args), grpc_ready(worker_addr), env))
    sandbox_addr = f"127.0.0.1:{free_port()}"
    slo_addr = f"127.0.0.1:{free_port()}"
    if full:
        children.append(Child("slo", slo_addr, python_cli("serve", "slo", "--port", slo_addr.rsplit(":", 1)[1]),
                              grpc_ready(slo_addr), env))
        router_addr = f"127.0.0.1:{free_port()}"
        children.append(Child("router", router_addr, python_cli("serve", "router", "--port", router_addr.rsplit(":", 1)[1]),
                              grpc_ready(router_addr), env))
        children.append(Child("sandbox", sandbox_addr, python_cli("serve", "sandbox", "--port", sandbox_addr.rsplit(":", 1)[1]),
                              grpc_ready(sandbox_addr), env))
    gateway_addr = f"127.0.0.1:{port}"
    sandbox_args = ("--sandbox", sandbox_addr, "--slo", slo_addr) if full else ()
    children.append(Child("gateway", gateway_addr, python_cli("serve", "gateway", "--port", str(port), "--worker", worker_addr,
                                                              *sandbox_args, *gateway_extra), grpc_ready(gateway_addr), env))
    return children, redis_url
