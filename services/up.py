"""`cotserve up`: every service on loopback (`common.topology.stack`), started in order, supervised, stopped together."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Callable, Optional

import typer


class _Stop:
    """Set by SIGTERM or SIGINT: the stack stops at its next check."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self.request)
        signal.signal(signal.SIGINT, self.request)

    def request(self, signum: int, frame: object) -> None:
        self.requested = True


def _waiter(console, stop: _Stop, start_timeout_s: float) -> Callable:
    """Each service's start, with a ticking status line; a stop requested while waiting stops it all."""
    from cotserve.common.procs import wait_serving

    def wait(child) -> None:
        started = time.monotonic()
        with console.status(f"starting {child.name} ...") as status:
            def progress() -> None:
                status.update(f"starting {child.name} ... {time.monotonic() - started:.0f}s")
                if stop.requested:
                    raise KeyboardInterrupt
            wait_serving(child, start_timeout_s, progress)
        console.print(f"[green]✓[/green] {child.name} ready on {child.address}")

    return wait


def _greet(console, port: int, http_port: int, metrics_port: int, redis_url: str, telemetry_port: int,
           telemetry_http_port: int, ca: Optional[Path] = None, operator_env: Optional[Path] = None) -> None:
    scheme, env, cacert = ("https", f"COTSERVE_TLS_CA={ca} ", f" --cacert {ca}") if ca else ("http", "", "")
    console.print(f"cotserve is up: gateway on 127.0.0.1:{port}, OpenAI-compatible API on {scheme}://127.0.0.1:{http_port}/v1 "
                  f"(redis {redis_url})")
    console.print(f'  try: {env}cotserve generate "37+48-12=" --address 127.0.0.1:{port} --stream', markup=False,
                  soft_wrap=True, highlight=False)
    console.print(f"  or:  curl -s{cacert} {scheme}://127.0.0.1:{http_port}/v1/chat/completions -H 'Content-Type: application/json' "
                  """-d '{"messages": [{"role": "user", "content": "37+48-12="}]}'""", markup=False, soft_wrap=True, highlight=False)
    console.print(f"  metrics: http://127.0.0.1:{metrics_port}/metrics (gateway) to :{metrics_port + 5} (telemetry)"
                  if metrics_port else "  metrics: off")
    admin = f"source {operator_env} && " if operator_env else ""
    console.print(f"  latency heatmaps: {scheme}://127.0.0.1:{telemetry_http_port}/  "
                  f"(or {admin}cotserve heatmap --address 127.0.0.1:{telemetry_port} --out heatmap.png)",
                  markup=False, soft_wrap=True, highlight=False)


def _stack_tls(console, logs: Path, internal: bool, public: bool):
    """This run's CA and certificates (in its log folder, tls/): mutual TLS between the services unless
    `--insecure-internal`, the gateway's ports over TLS with `--tls`; the admin commands' variables in tls/operator.env."""
    import shlex

    from cotserve.common.tlsgen import stack_tls

    if not internal:
        console.print("[yellow]warning:[/yellow] --insecure-internal: the services call each other in plaintext and "
                      "serve any caller on their ports, with no identity checked")
    files = stack_tls(logs / "tls", internal=internal, public=public)
    if files is None:
        return None
    say = lambda line: console.print(line, markup=False, soft_wrap=True, highlight=False)  # noqa: E731
    say(f"TLS: local CA {files.ca}")
    if internal:
        env_file = files.folder / "operator.env"
        env_file.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in files.operator_env().items()))
        say(f"mutual TLS between the services; for the admin commands (the operator's certificate): source {env_file}")
    return files


def up(
    model: Optional[Path] = typer.Option(None, envvar="COTSERVE_MODEL", help="Checkpoint folder for the worker (default: the bundled demo model)."),
    port: int = typer.Option(50051, envvar="COTSERVE_PORT", help="The gateway's port: the stack's public address."),
    http_port: int = typer.Option(8000, envvar="COTSERVE_HTTP_PORT", help="The gateway's OpenAI-compatible HTTP API port (/v1/chat/completions, /v1/completions, /v1/models)."),
    redis_url: Optional[str] = typer.Option(None, envvar="COTSERVE_REDIS_URL", help="Use this Redis instead of starting the embedded one."),
    telemetry_port: int = typer.Option(4317, envvar="COTSERVE_TELEMETRY_PORT", help="The telemetry service's OTLP/gRPC port; every service exports its spans there."),
    telemetry_http_port: int = typer.Option(8317, envvar="COTSERVE_TELEMETRY_HTTP_PORT", help="Port of the live heatmap page."),
    metrics_port: int = typer.Option(9301, envvar="COTSERVE_METRICS_PORT", help="Every service's Prometheus /metrics, "
                                     "from this port up: gateway +0, worker +1, slo +2, router +3, sandbox +4, telemetry +5 (0: off)."),
    tls: bool = typer.Option(False, "--tls", help="The gateway's ports (gRPC, HTTP) and, with mutual TLS inside, the "
                             "heatmap page speak TLS too, with a server certificate from this run's CA (its log folder, "
                             "tls/); clients trust it with COTSERVE_TLS_CA=<that folder>/cotserve-local-ca.pem."),
    insecure_internal: bool = typer.Option(False, "--insecure-internal", help="The services call each other in "
                                           "plaintext, with no certificate checked (default: mutual TLS, every call "
                                           "authorized by the caller's identity; common/authz.py). Logged as a warning."),
    start_timeout_s: float = typer.Option(120.0, help="Seconds to wait for each service to report SERVING."),
    max_crashes: int = typer.Option(5, help="A service that exits this many times within two minutes stops the stack."),
) -> None:
    """Start every service on loopback (Redis, telemetry, worker, SLO predictor, router, sandbox, gateway), wait
    until each is ready, restart any that exits (with backoff; the others keep serving), stop all on Ctrl-C/SIGTERM.
    Each run's logs go to one folder (~/.cache/cotserve/up/<time>-<pid>/, the last five runs kept)."""
    from rich.console import Console

    from cotserve.common.procs import CrashLoop, Supervisor, run_dir, running
    from cotserve.common.topology import stack

    console = Console(stderr=True)
    logs = run_dir()
    tls_files = _stack_tls(console, logs, not insecure_internal, tls)
    children, redis_url = stack(model, port, redis_url, telemetry_port=telemetry_port,
                                telemetry_http_port=telemetry_http_port, log_dir=logs, http_port=http_port,
                                metrics_port=metrics_port, tls=tls_files)
    stop = _Stop()
    failure: str | None = None
    console.print(f"logs: {logs}")
    try:
        with running(children, grace_s=5.0, wait=_waiter(console, stop, start_timeout_s)):
            _greet(console, port, http_port, metrics_port, redis_url, telemetry_port, telemetry_http_port,
                   tls_files.ca if tls_files and tls_files.public else None,
                   tls_files.folder / "operator.env" if tls_files and tls_files.internal else None)
            supervisor = Supervisor(children, lambda line: console.print(line, markup=False, soft_wrap=True, highlight=False),
                                    start_timeout_s=start_timeout_s, max_crashes=max_crashes)
            try:
                while not stop.requested:
                    supervisor.poll()
                    time.sleep(0.25)
            finally:
                console.print("stopping ...")
    except (RuntimeError, CrashLoop) as exc:  # a service that would not start, or one that keeps crashing
        failure = str(exc)
    except KeyboardInterrupt:
        pass
    console.print(f"stopped (logs in {logs})")
    if failure is not None:
        console.print("[red]cotserve up failed:[/red]", end=" ")
        console.print(failure, markup=False, soft_wrap=True, highlight=False)
        raise typer.Exit(1)


def mount(root: typer.Typer, serve: typer.Typer) -> None:
    """`up` on the `cotserve` command line."""
    root.command("up")(up)
