"""`cotserve up | serve SERVICE | generate | bench | sandbox | moe | tenants | demo`: the command line.

Flags win over `COTSERVE_*` environment variables, which win over defaults.
"""

from __future__ import annotations

import asyncio
import importlib
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from cotserve.bench.cli import bench_app
from cotserve.common.clitools import fail, run_service, setup_logging
from cotserve.common.config import serve_command
from cotserve.common.topology import stack
from cotserve.gateway.cli import tenants_app
from cotserve.router.cli import moe_app
from cotserve.sandbox.cli import sandbox_app
from cotserve.slo.cli import slo_app
from cotserve.telemetry.cli import heatmap_command, trace_app
from cotserve.kveval.cli import kv_app
from cotserve.router.config import RouterConfig
from cotserve.sandbox.config import SandboxConfig
from cotserve.slo.config import SloConfig
from cotserve.telemetry.config import TelemetryConfig
from cotserve.worker.config import WorkerConfig

app = typer.Typer(help="cotserve: serve language models, reasoning models first.", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_show_locals=False)


serve_app = typer.Typer(help="Run one service in the foreground.", no_args_is_help=True)


demo_app = typer.Typer(help="The bundled demo model: train it, measure it.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")
app.add_typer(bench_app, name="bench")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(moe_app, name="moe")
app.add_typer(tenants_app, name="tenants")
app.add_typer(demo_app, name="demo")
app.add_typer(trace_app, name="trace")
app.add_typer(slo_app, name="slo")
app.add_typer(kv_app, name="kv")
app.command("heatmap")(heatmap_command)


def _serve(service: str, config: type, help: str) -> None:
    """`cotserve serve <service>`, generated from the service's config: logging set up, then its own `serve(config)`
    (the service's module imported only when the command runs)."""

    def run(cfg) -> None:
        setup_logging()
        run_service(service, importlib.import_module(f"cotserve.{service}.server").serve(cfg))

    serve_command(serve_app, config, service, run, help)


_serve("worker", WorkerConfig, "Start one model worker.")
_serve("telemetry", TelemetryConfig, "Start the telemetry service: OTLP trace receiver, latency heatmaps, recent traces.")
_serve("router", RouterConfig, "Start the MoE router (policy over Redis, expert load, balancing).")
_serve("sandbox", SandboxConfig, "Start the WASI sandbox service.")
_serve("slo", SloConfig, "Start the SLO predictor: XGBoost violation forecasts, latency predictions, scale advice.")


@serve_app.command("gateway")
def serve_gateway(
    worker: list[str] = typer.Option([], "--worker", envvar="COTSERVE_WORKERS", help="Worker address HOST:PORT (repeatable)."),
    workers_file: Optional[Path] = typer.Option(None, envvar="COTSERVE_WORKERS_FILE", help='TOML file with workers = ["HOST:PORT", ...].'),
    host: str = typer.Option("127.0.0.1", envvar="COTSERVE_HOST", help="Address to bind."),
    port: int = typer.Option(50051, envvar="COTSERVE_GATEWAY_PORT", help="Port to bind (0 picks a free one)."),
    poll_interval_s: float = typer.Option(0.5, envvar="COTSERVE_POLL_INTERVAL_S", help="Seconds between Stats polls of each worker."),
    sla_target: list[str] = typer.Option([], "--sla-target", envvar="COTSERVE_SLA_TARGETS", help="CLASS=TTFT_MS/ITL_P95_MS, e.g. interactive=1000/100 (repeatable; defaults: realtime=250/50, interactive=1000/100, batch=30000/1000)."),
    batch_limit: int = typer.Option(128, envvar="COTSERVE_BATCH_LIMIT", help="BATCH requests in flight per worker at most."),
    max_queue_interactive: int = typer.Option(256, envvar="COTSERVE_MAX_QUEUE_INTERACTIVE", help="INTERACTIVE requests waiting per worker at most (then RESOURCE_EXHAUSTED)."),
    max_queue_batch: int = typer.Option(1024, envvar="COTSERVE_MAX_QUEUE_BATCH", help="BATCH requests waiting per worker at most (then RESOURCE_EXHAUSTED)."),
    no_admission: bool = typer.Option(False, "--no-admission", help="Forward every request at once, no per-class limits or queues (a benchmark baseline)."),
    metrics_port: int = typer.Option(0, envvar="COTSERVE_GATEWAY_METRICS_PORT", help="Port for Prometheus /metrics (0 = off)."),
    tenants_file: Optional[Path] = typer.Option(None, envvar="COTSERVE_TENANTS_FILE", help="TOML tenants file (API key hashes, classes, limits); without it, one open tenant."),
    redis_url: Optional[str] = typer.Option(None, envvar="COTSERVE_REDIS_URL", help="Redis holding tenant limits, shared by every gateway."),
    sandbox: Optional[str] = typer.Option(None, "--sandbox", envvar="COTSERVE_SANDBOX_ADDRESS", help="Sandbox service HOST:PORT for pre/post-processors."),
    fail_open: list[str] = typer.Option([], "--fail-open", help="Module whose failure lets text through unchanged (repeatable; default: fail closed)."),
    slo: Optional[str] = typer.Option(None, "--slo", envvar="COTSERVE_SLO_ADDRESS", help="SLO predictor HOST:PORT: report windows to it, shed BATCH and route by its forecasts (default: none)."),
    slo_admission: bool = typer.Option(True, "--slo-admission/--no-slo-admission", help="Defer BATCH while the predictor forecasts an urgent class missing its target."),
    slo_routing: bool = typer.Option(True, "--slo-routing/--no-slo-routing", help="Route among a model's workers by predicted TTFT."),
    slo_budget_ms: float = typer.Option(5.0, envvar="COTSERVE_SLO_BUDGET_MS", help="Milliseconds routing waits for a prediction before using the load heuristic."),
    slo_retry_after_ms: int = typer.Option(10_000, help="retry-after-ms sent with a deferred BATCH request."),
    prefix_cache_scope: str = typer.Option("tenant", envvar="COTSERVE_PREFIX_CACHE_SCOPE", help="Who shares workers' cached prompt blocks: tenant (requests of the same tenant only; the default, as a shared cache leaks prompts through timing) or global."),
    max_request_bytes: int = typer.Option(4 << 20, envvar="COTSERVE_GATEWAY_MAX_REQUEST_BYTES", help="Largest request message accepted, in bytes (larger: RESOURCE_EXHAUSTED before it is read)."),
    max_prompt_chars: int = typer.Option(0, envvar="COTSERVE_GATEWAY_MAX_PROMPT_CHARS", help="Prompt characters allowed at most (0: what the model's context can hold: its context times its longest token)."),
    max_prompt_tokens: int = typer.Option(0, envvar="COTSERVE_GATEWAY_MAX_PROMPT_TOKENS", help="Prompt tokens allowed at most, checked by the worker (0: the model's context less one)."),
    worker_wait_s: float = typer.Option(10.0, envvar="COTSERVE_GATEWAY_WORKER_WAIT_S", help="Seconds a request waits for a worker of its model to come (back) into rotation, e.g. during a restart, before UNAVAILABLE (never past its deadline; 0: fail at once)."),
    grace_s: float = typer.Option(5.0, envvar="COTSERVE_GRACE_S", help="Seconds to drain in-flight streams on SIGTERM."),
) -> None:
    """Start one gateway in front of one or more workers."""
    from cotserve.common.sampling import SlaClass
    from cotserve.common.sla import sla_targets
    from cotserve.gateway.admission import AdmissionConfig
    from cotserve.gateway.server import GatewayConfig, serve

    setup_logging()
    try:
        admission = AdmissionConfig(enabled=not no_admission, batch_limit=batch_limit,
                                    max_queue={SlaClass.INTERACTIVE: max_queue_interactive, SlaClass.BATCH: max_queue_batch})
        admission.targets = sla_targets(sla_target)
        cfg = GatewayConfig(host=host, port=port, workers=list(worker), workers_file=workers_file,
                            poll_interval_s=poll_interval_s, grace_s=grace_s, admission=admission,
                            metrics_port=metrics_port, tenants_file=tenants_file, redis_url=redis_url,
                            sandbox_address=sandbox, fail_open_modules=frozenset(fail_open), slo_address=slo,
                            slo_admission=slo_admission, slo_routing=slo_routing, slo_predict_budget_ms=slo_budget_ms,
                            slo_retry_after_ms=slo_retry_after_ms, prefix_cache_scope=prefix_cache_scope,
                            max_request_bytes=max_request_bytes, max_prompt_chars=max_prompt_chars,
                            max_prompt_tokens=max_prompt_tokens, worker_wait_s=worker_wait_s)
        cfg.validate()
    except ValueError as exc:
        fail("gateway", exc)
    run_service("gateway", serve(cfg))


@app.command("up")
def up(
    model: Optional[Path] = typer.Option(None, envvar="COTSERVE_MODEL", help="Checkpoint folder for the worker (default: the bundled demo model)."),
    port: int = typer.Option(50051, envvar="COTSERVE_PORT", help="The gateway's port: the stack's public address."),
    redis_url: Optional[str] = typer.Option(None, envvar="COTSERVE_REDIS_URL", help="Use this Redis instead of starting the embedded one."),
    telemetry_port: int = typer.Option(4317, envvar="COTSERVE_TELEMETRY_PORT", help="The telemetry service's OTLP/gRPC port; every service exports its spans there."),
    telemetry_http_port: int = typer.Option(8317, envvar="COTSERVE_TELEMETRY_HTTP_PORT", help="Port of the live heatmap page."),
    start_timeout_s: float = typer.Option(120.0, help="Seconds to wait for each service to report SERVING."),
    max_crashes: int = typer.Option(5, help="A service that exits this many times within two minutes stops the stack."),
) -> None:
    """Start every service on loopback (Redis, telemetry, worker, SLO predictor, router, sandbox, gateway), wait
    until each is ready, restart any that exits (with backoff; the others keep serving), stop all on Ctrl-C/SIGTERM.
    Each run's logs go to one folder (~/.cache/cotserve/up/<time>-<pid>/, the last five runs kept)."""
    from rich.console import Console

    from cotserve.common.procs import CrashLoop, Supervisor, run_dir, running, wait_serving

    console = Console(stderr=True)
    logs = run_dir()
    children, redis_url = stack(model, port, redis_url, telemetry_port=telemetry_port,
                                telemetry_http_port=telemetry_http_port, log_dir=logs)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    failure: str | None = None
    console.print(f"logs: {logs}")

    def wait(child) -> None:  # each service's start, with a ticking status line; Ctrl-C while waiting stops it all
        started = time.monotonic()
        with console.status(f"starting {child.name} ...") as status:
            def progress() -> None:
                status.update(f"starting {child.name} ... {time.monotonic() - started:.0f}s")
                if stopping:
                    raise KeyboardInterrupt
            wait_serving(child, start_timeout_s, progress)
        console.print(f"[green]✓[/green] {child.name} ready on {child.address}")

    try:
        with running(children, grace_s=5.0, wait=wait):
            console.print(f"cotserve is up: gateway on 127.0.0.1:{port} (redis {redis_url})")
            console.print(f'  try: cotserve generate "37+48-12=" --address 127.0.0.1:{port} --stream')
            console.print(f"  latency heatmaps: http://127.0.0.1:{telemetry_http_port}/  "
                          f"(or cotserve heatmap --address 127.0.0.1:{telemetry_port} --out heatmap.png)")
            supervisor = Supervisor(children, lambda line: console.print(line, markup=False, soft_wrap=True, highlight=False),
                                    start_timeout_s=start_timeout_s, max_crashes=max_crashes)
            try:
                while not stopping:
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


@app.command("generate")
def generate(
    prompt: str = typer.Argument(..., help="Prompt text."),
    address: str = typer.Option("127.0.0.1:50051", envvar="COTSERVE_ADDRESS", help="Address of the gateway."),
    model: str = typer.Option("", help="Model name (empty: the only model served)."),
    max_new_tokens: int = typer.Option(256, help="Tokens to generate at most."),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature, 0..2 (0 = greedy; the default, or 1.0 with --self-consistency)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    sla: str = typer.Option("interactive", help="SLA class: realtime, interactive or batch."),
    api_key: Optional[str] = typer.Option(None, envvar="COTSERVE_API_KEY", help="API key, sent as a Bearer token."),
    timeout_s: Optional[float] = typer.Option(None, help="Deadline for the whole call, in seconds."),
    pre_processor: str = typer.Option("", help="Sandbox module run on the prompt first (e.g. cot-guard)."),
    post_processor: str = typer.Option("", help="Sandbox module run on the completed text (e.g. strip-think)."),
    stream: bool = typer.Option(False, "--stream", help="Print text as it arrives (with --n, each sample's line as it completes)."),
    n: int = typer.Option(1, "--n", help="Samples of the prompt, 1..16: computed once, sampled n times (seed + i for sample i)."),
    cache_salt: str = typer.Option("", help="Share cached prompt blocks only with requests that give the same salt."),
    max_thinking_tokens: Optional[int] = typer.Option(None, help="Thinking tokens at most; then the forcing text ends the thinking and the model answers."),
    max_thinking_steps: Optional[int] = typer.Option(None, help="Reasoning steps at most (the worker's --reasoning-step ends a step)."),
    min_thinking_tokens: Optional[int] = typer.Option(None, help="The end of thinking cannot be sampled before this many thinking tokens."),
    forcing_text: Optional[str] = typer.Option(None, help="Text appended when a budget ends the thinking (default: the model's end marker)."),
    early_exit: bool = typer.Option(False, "--early-exit", help="Stop thinking once probes agree on the answer (every reasoning step unless --probe-every-tokens)."),
    probe_every_steps: Optional[int] = typer.Option(None, help="With --early-exit: probe after every this many reasoning steps (default 1)."),
    probe_every_tokens: Optional[int] = typer.Option(None, help="With --early-exit: probe after every this many thinking tokens instead of steps."),
    agree: Optional[int] = typer.Option(None, help="With --early-exit: probes in a row that must agree, 1..16 (default 2)."),
    min_confidence: Optional[float] = typer.Option(None, help="With --early-exit: the agreeing probes' mean token probability must reach this, (0, 1]."),
    self_consistency: Optional[int] = typer.Option(None, help="Vote over up to this many samples (1..64), stopping once the vote is settled; needs --temperature > 0."),
    min_samples: Optional[int] = typer.Option(None, help="With --self-consistency: samples per round and before any stop (default min(3, max))."),
    vote_rule: str = typer.Option("window", help="With --self-consistency: window (identical answers in a row) or posterior (the leader stays the majority)."),
    confidence_weighted: bool = typer.Option(False, "--confidence-weighted", help="With --self-consistency: weight votes by each sample's mean token probability."),
) -> None:
    """Generate a completion through the gateway and print it with its timing line."""
    from cotserve.sdk import Client, CotserveError, EarlyExit, Reasoning, SelfConsistency

    if (probe_every_steps is not None or probe_every_tokens is not None or agree is not None or min_confidence is not None) and not early_exit:
        typer.echo("error: --probe-every-steps, --probe-every-tokens, --agree and --min-confidence need --early-exit", err=True)
        raise typer.Exit(2)
    if (min_samples is not None or confidence_weighted or vote_rule != "window") and self_consistency is None:
        typer.echo("error: --min-samples, --vote-rule and --confidence-weighted need --self-consistency", err=True)
        raise typer.Exit(2)
    if vote_rule not in ("window", "posterior"):
        typer.echo(f"error: --vote-rule: {vote_rule!r} is not window or posterior", err=True)
        raise typer.Exit(2)
    exit_opts = None
    if early_exit:
        exit_opts = EarlyExit(probe_every_tokens=probe_every_tokens,
                              probe_every_steps=probe_every_steps if probe_every_steps is not None or probe_every_tokens is not None else 1,
                              agree=agree, min_confidence=min_confidence)
    vote_opts = None
    if self_consistency is not None:
        vote_opts = SelfConsistency(self_consistency, min_samples=min_samples, rule=vote_rule, confidence_weighted=confidence_weighted)
    if temperature is None:  # a vote needs samples that can differ
        temperature = 1.0 if self_consistency is not None else 0.0
    budget = Reasoning(max_thinking_tokens=max_thinking_tokens, max_thinking_steps=max_thinking_steps,
                       min_thinking_tokens=min_thinking_tokens, forcing_text=forcing_text, early_exit=exit_opts,
                       self_consistency=vote_opts)
    kwargs = dict(model=model, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, sla=sla,
                  timeout_s=timeout_s, api_key=api_key, pre_processor=pre_processor, post_processor=post_processor,
                  n=n, cache_salt=cache_salt, reasoning=budget if budget.is_set else None)
    single = n == 1 and self_consistency is None  # one sample: its text alone; else a line per sample
    vote = None
    try:
        with Client(address) as client:
            if stream:
                texts: dict[int, list[str]] = {}
                reasons: dict[int, str | None] = {}
                for chunk in client.stream(prompt, **kwargs):
                    if single:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                    texts.setdefault(chunk.index, []).append(chunk.text)
                    if chunk.finish_reason:
                        reasons[chunk.index] = chunk.finish_reason
                        if not single:
                            typer.echo(f"[{chunk.index}] {''.join(texts[chunk.index])} ({chunk.finish_reason})")
                    if chunk.usage is not None:  # the stream's last chunk
                        usage, timing, vote = chunk.usage, chunk.timing, chunk.self_consistency
                reason = ", ".join(str(reasons[i]) for i in sorted(reasons))
            else:
                result = client.generate(prompt, **kwargs)
                if single:
                    sys.stdout.write(result.text)
                else:
                    for c in result.choices:
                        typer.echo(f"[{c.index}] {c.text} ({c.finish_reason})")
                reason = ", ".join(str(c.finish_reason) for c in result.choices)
                usage, timing, vote = result.usage, result.timing, result.self_consistency
    except CotserveError as err:
        typer.echo(f"error: {err.code.name}: {err.message}", err=True)
        raise typer.Exit(1) from None
    cached = f" ({usage.cached_prompt_tokens} cached)" if usage.cached_prompt_tokens else ""
    thinking = f" ({usage.reasoning_tokens} reasoning)" if usage.reasoning_tokens else ""
    thinking += f" + {usage.probe_tokens} probe tokens" if usage.probe_tokens else ""
    newline = "\n" if single else ""  # after the streamed or printed text
    if vote is not None:
        table = ", ".join(f"{v.answer or '(none)'} x{v.count}" for v in vote.votes)
        typer.echo(f"vote: {vote.answer} ({table}; {vote.samples_used} samples used, {vote.samples_cancelled} cancelled, "
                   f"stopped by {vote.stop_reason})")
    typer.echo(f"{newline}[{reason} | {usage.prompt_tokens} prompt{cached} + {usage.completion_tokens} completion tokens{thinking} | "
               f"queue {timing.queue_ms:.1f} ms, ttft {timing.ttft_ms:.1f} ms, total {timing.total_ms:.1f} ms]")


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

    result = asyncio.run(evaluate(address, n=n, seed=seed, concurrency=concurrency, progress=True))
    typer.echo(f"accuracy {result.correct}/{result.total} = {result.accuracy:.1%} ({result.seconds:.1f}s)")


def main() -> None:
    from cotserve.common.procs import die_with_supervisor

    die_with_supervisor()
    app()


if __name__ == "__main__":
    main()

