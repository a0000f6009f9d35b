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

app = typer.Typer(help="cotserve: serve language models, reasoning models first.", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_show_locals=False)
serve_app = typer.Typer(help="Run one service in the foreground.", no_args_is_help=True)
demo_app = typer.Typer(help="The bundled demo model: train it, measure it.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")
moe_app = typer.Typer(help="Mixture-of-experts routing: policy and expert load.", no_args_is_help=True)
app.add_typer(moe_app, name="moe")
sandbox_app = typer.Typer(help="The WASI sandbox: register, list and run modules.", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")
tenants_app = typer.Typer(help="Tenants of the gateway: API keys and limits.", no_args_is_help=True)
app.add_typer(tenants_app, name="tenants")
bench_app = typer.Typer(help="Benchmarks: tables, and ratios against a baseline run in the same process.", no_args_is_help=True)
app.add_typer(demo_app, name="demo")
app.add_typer(bench_app, name="bench")


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
    max_num_batched_tokens: int = typer.Option(2048, envvar="COTSERVE_MAX_NUM_BATCHED_TOKENS", help="Tokens per engine step at most (prefill chunk bound)."),
    max_model_len: Optional[int] = typer.Option(None, envvar="COTSERVE_MAX_MODEL_LEN", help="Longest sequence served (default: the model's context)."),
    served_model_name: Optional[str] = typer.Option(None, envvar="COTSERVE_SERVED_MODEL_NAME", help="Model name clients use (default: the folder's name)."),
    metrics_port: int = typer.Option(0, envvar="COTSERVE_WORKER_METRICS_PORT", help="Port for Prometheus /metrics (0 = off)."),
    scheduling: str = typer.Option("priority", envvar="COTSERVE_SCHEDULING", help="priority (SLA class, then arrival) or fifo (arrival only, a benchmark baseline)."),
    redis_url: Optional[str] = typer.Option(None, envvar="COTSERVE_REDIS_URL", help="Redis of the MoE control plane (MoE models follow their routing policy there)."),
    worker_id: Optional[str] = typer.Option(None, envvar="COTSERVE_WORKER_ID", help="This worker's name in Redis keys (default: its address)."),
    max_batch_tokens_when_urgent: int = typer.Option(256, envvar="COTSERVE_MAX_BATCH_TOKENS_WHEN_URGENT", help="BATCH tokens per step at most while urgent work is present."),
    batch_min_share: float = typer.Option(0.1, envvar="COTSERVE_BATCH_MIN_SHARE", help="Share of each step's token budget kept for BATCH work (0..1)."),
    torch_threads: Optional[int] = typer.Option(None, envvar="COTSERVE_TORCH_THREADS", help="CPU threads for torch (default on CPU: all cores but one)."),
    grace_s: float = typer.Option(5.0, envvar="COTSERVE_GRACE_S", help="Seconds to drain in-flight streams on SIGTERM."),
) -> None:
    """Start one model worker."""
    from cotserve.common.errors import ModelLoadError
    from cotserve.worker.server import DEMO_MODEL, WorkerConfig, serve

    _logging()
    cfg = WorkerConfig(
        model=model or DEMO_MODEL, host=host, port=port, device=device, dtype=dtype, kv_cache_bytes=kv_cache_bytes,
        block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, served_model_name=served_model_name, batch_min_share=batch_min_share, torch_threads=torch_threads,
        metrics_port=metrics_port, scheduling=scheduling, max_batch_tokens_when_urgent=max_batch_tokens_when_urgent,
        redis_url=redis_url, worker_id=worker_id,
        grace_s=grace_s,
    )
    try:
        asyncio.run(serve(cfg))
    except (ModelLoadError, ValueError, OSError) as exc:
        typer.echo(f"cotserve worker: {getattr(exc, 'message', exc)}", err=True)
        raise typer.Exit(2) from None


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
    grace_s: float = typer.Option(5.0, envvar="COTSERVE_GRACE_S", help="Seconds to drain in-flight streams on SIGTERM."),
) -> None:
    """Start one gateway in front of one or more workers."""
    from cotserve.common.sampling import SlaClass
    from cotserve.gateway.admission import AdmissionConfig, parse_target
    from cotserve.gateway.server import GatewayConfig, serve

    _logging()
    try:
        admission = AdmissionConfig(enabled=not no_admission, batch_limit=batch_limit,
                                    max_queue={SlaClass.INTERACTIVE: max_queue_interactive, SlaClass.BATCH: max_queue_batch})
        admission.targets.update(parse_target(t) for t in sla_target)
        cfg = GatewayConfig(host=host, port=port, workers=list(worker), workers_file=workers_file,
                            poll_interval_s=poll_interval_s, grace_s=grace_s, admission=admission,
                            metrics_port=metrics_port, tenants_file=tenants_file, redis_url=redis_url,
                            sandbox_address=sandbox, fail_open_modules=frozenset(fail_open))
        cfg.validate()
    except ValueError as exc:
        typer.echo(f"cotserve gateway: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        asyncio.run(serve(cfg))
    except (ValueError, OSError) as exc:
        typer.echo(f"cotserve gateway: {exc}", err=True)
        raise typer.Exit(2) from None


@serve_app.command("sandbox")
def serve_sandbox(
    host: str = typer.Option("127.0.0.1", envvar="COTSERVE_HOST", help="Address to bind."),
    port: int = typer.Option(50071, envvar="COTSERVE_SANDBOX_PORT", help="Port to bind (0 picks a free one)."),
    store_dir: Optional[Path] = typer.Option(None, envvar="COTSERVE_SANDBOX_STORE", help="Folder for modules and compiled artifacts (default: ~/.cache/cotserve/sandbox)."),
    pool_size: Optional[int] = typer.Option(None, envvar="COTSERVE_SANDBOX_POOL", help="Runs executing at once (default: CPU count, at least 2)."),
    no_shipped: bool = typer.Option(False, "--no-shipped", help="Do not register the shipped modules at start."),
    grace_s: float = typer.Option(5.0, envvar="COTSERVE_GRACE_S", help="Seconds to drain in-flight runs on SIGTERM."),
) -> None:
    """Start the WASI sandbox service."""
    from cotserve.sandbox.server import SandboxConfig, serve

    _logging()
    cfg = SandboxConfig(host=host, port=port, register_shipped=not no_shipped, grace_s=grace_s)
    if store_dir is not None:
        cfg.store_dir = store_dir
    if pool_size is not None:
        if pool_size < 1:
            typer.echo(f"cotserve sandbox: pool_size: {pool_size}, must be >= 1", err=True)
            raise typer.Exit(2)
        cfg.pool_size = pool_size
    try:
        asyncio.run(serve(cfg))
    except OSError as exc:
        typer.echo(f"cotserve sandbox: {exc}", err=True)
        raise typer.Exit(2) from None


@serve_app.command("router")
def serve_router(
    redis_url: str = typer.Option("redis://127.0.0.1:6379/0", envvar="COTSERVE_REDIS_URL", help="Redis of the MoE control plane."),
    host: str = typer.Option("127.0.0.1", envvar="COTSERVE_HOST", help="Address to bind."),
    port: int = typer.Option(50081, envvar="COTSERVE_ROUTER_PORT", help="Port to bind (0 picks a free one)."),
    balance: bool = typer.Option(True, "--balance/--no-balance", help="Run the load-balancing loop."),
    balance_interval_s: float = typer.Option(2.0, help="Seconds between balancing rounds."),
    gamma: float = typer.Option(0.05, help="Bias step of the balancing rule."),
    rule: str = typer.Option("sign", help="sign: b += gamma*sign(mean-load); proportional: b += gamma*clip((mean-load)/mean, -1, 1)."),
    grace_s: float = typer.Option(5.0, envvar="COTSERVE_GRACE_S", help="Seconds to drain in-flight calls on SIGTERM."),
) -> None:
    """Start the MoE router (policy over Redis, expert load, balancing)."""
    from cotserve.router.server import RouterConfig, serve

    _logging()
    if gamma <= 0 or balance_interval_s <= 0 or rule not in ("sign", "proportional"):
        typer.echo("cotserve router: gamma and balance_interval_s must be > 0; rule is sign or proportional", err=True)
        raise typer.Exit(2)
    cfg = RouterConfig(redis_url=redis_url, host=host, port=port, balance=balance, balance_interval_s=balance_interval_s,
                       gamma=gamma, rule=rule, grace_s=grace_s)
    try:
        asyncio.run(serve(cfg))
    except OSError as exc:
        typer.echo(f"cotserve router: {exc}", err=True)
        raise typer.Exit(2) from None


@moe_app.command("policy")
def moe_policy(
    model: str = typer.Argument(..., help="Model name."),
    address: str = typer.Option("127.0.0.1:50081", envvar="COTSERVE_ROUTER_ADDRESS", help="Router address."),
) -> None:
    """Print a model's current routing policy."""
    import grpc

    from cotserve.router.v1 import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            p = router_pb2_grpc.RouterServiceStub(ch).GetPolicy(router_pb2.GetPolicyRequest(model=model), timeout=10).policy
        except grpc.RpcError as err:
            _rpc_error(err)
    typer.echo(f"{p.model} v{p.version} top_k={p.top_k or 'checkpoint'}")
    for layer in p.layers:
        bias = " ".join(f"{b:+.3f}" for b in layer.expert_bias) or "none"
        typer.echo(f"  layer {layer.layer}: bias [{bias}] disabled {list(layer.disabled_experts)}")


@moe_app.command("load")
def moe_load(
    model: str = typer.Argument(..., help="Model name."),
    window_s: float = typer.Option(10.0, help="Window to sum over."),
    address: str = typer.Option("127.0.0.1:50081", envvar="COTSERVE_ROUTER_ADDRESS", help="Router address."),
) -> None:
    """Print tokens per expert per layer and each layer's balancedness (mean / max)."""
    import grpc

    from cotserve.router.v1 import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            resp = router_pb2_grpc.RouterServiceStub(ch).GetExpertLoad(
                router_pb2.GetExpertLoadRequest(model=model, window_ms=int(window_s * 1000)), timeout=10)
        except grpc.RpcError as err:
            _rpc_error(err)
    for layer in resp.layers:
        typer.echo(f"layer {layer.layer}: {list(layer.tokens_per_expert)} balancedness {layer.balancedness:.3f}")


def _sandbox_stub(address: str):
    import grpc

    from cotserve.sandbox.v1 import sandbox_pb2_grpc

    return grpc.insecure_channel(address), sandbox_pb2_grpc.SandboxServiceStub


def _rpc_error(err) -> None:
    typer.echo(f"error: {err.code().name}: {err.details()}", err=True)
    raise typer.Exit(1)


@sandbox_app.command("register")
def sandbox_register(
    name: str = typer.Argument(..., help="Module name."),
    file: Path = typer.Argument(..., help="A .wasm or .wat file."),
    address: str = typer.Option("127.0.0.1:50071", envvar="COTSERVE_SANDBOX_ADDRESS", help="Sandbox address."),
) -> None:
    """Register (compile and validate) a module."""
    import grpc

    from cotserve.sandbox.v1 import sandbox_pb2

    data = file.read_bytes()
    req = sandbox_pb2.RegisterModuleRequest(name=name)
    if file.suffix == ".wat":
        req.wat = data.decode()
    else:
        req.wasm = data
    channel, stub = _sandbox_stub(address)
    with channel:
        try:
            m = stub(channel).RegisterModule(req, timeout=60).module
        except grpc.RpcError as err:
            _rpc_error(err)
    typer.echo(f"{m.name} {m.sha256} {m.size_bytes} bytes")


@sandbox_app.command("list")
def sandbox_list(address: str = typer.Option("127.0.0.1:50071", envvar="COTSERVE_SANDBOX_ADDRESS", help="Sandbox address.")) -> None:
    """List registered modules."""
    import grpc

    from cotserve.sandbox.v1 import sandbox_pb2

    channel, stub = _sandbox_stub(address)
    with channel:
        try:
            modules = stub(channel).ListModules(sandbox_pb2.ListModulesRequest(), timeout=30).modules
        except grpc.RpcError as err:
            _rpc_error(err)
    for m in modules:
        typer.echo(f"{m.name}\t{m.sha256[:16]}\t{m.size_bytes} bytes")


@sandbox_app.command("run")
def sandbox_run(
    name: str = typer.Argument(..., help="Module name."),
    input_file: Optional[Path] = typer.Option(None, "--input", help="File to pass on stdin (default: this command's stdin)."),
    arg: list[str] = typer.Option([], "--arg", help="Argument for the module (repeatable)."),
    timeout_ms: int = typer.Option(0, help="Wall-time limit (0: the module's default)."),
    address: str = typer.Option("127.0.0.1:50071", envvar="COTSERVE_SANDBOX_ADDRESS", help="Sandbox address."),
) -> None:
    """Run a module on stdin (or --input) and print its output; the outcome goes to stderr."""
    import grpc

    from cotserve.sandbox.v1 import sandbox_pb2

    data = input_file.read_bytes() if input_file else sys.stdin.buffer.read()
    channel, stub = _sandbox_stub(address)
    with channel:
        try:
            r = stub(channel).Run(sandbox_pb2.RunRequest(name=name, input=data, args=arg,
                                                         limits=sandbox_pb2.RunLimits(timeout_ms=timeout_ms)), timeout=60)
        except grpc.RpcError as err:
            _rpc_error(err)
    sys.stdout.buffer.write(r.output)
    sys.stdout.flush()
    typer.echo(f"[{sandbox_pb2.RunOutcome.Name(r.outcome)} exit {r.exit_code} | fuel {r.fuel_used} | {r.wall_ms:.2f} ms]", err=True)
    if r.outcome != sandbox_pb2.RUN_OUTCOME_OK:
        raise typer.Exit(1)


def _stack(model: Optional[Path], port: int, redis_url: Optional[str], full: bool = True,
           worker_extra: tuple[str, ...] = (), gateway_extra: tuple[str, ...] = ()) -> tuple[list, str]:
    """The services `up` starts, in start order, and the Redis URL they share. `full=False` (benchmarks)
    starts only the worker and the gateway."""
    from cotserve.common.procs import Child, free_port, grpc_ready, python_cli, redis_child

    children = []
    if redis_url is None and full:
        redis, redis_url = redis_child(free_port())
        children.append(redis)
    env = {"COTSERVE_REDIS_URL": redis_url} if redis_url else {}
    worker_addr = f"127.0.0.1:{free_port()}"
    worker_args = ["serve", "worker", "--port", worker_addr.rsplit(":", 1)[1], *worker_extra] + (["--model", str(model)] if model else [])
    children.append(Child("worker", worker_addr, python_cli(*worker_args), grpc_ready(worker_addr), env))
    sandbox_addr = f"127.0.0.1:{free_port()}"
    if full:
        router_addr = f"127.0.0.1:{free_port()}"
        children.append(Child("router", router_addr, python_cli("serve", "router", "--port", router_addr.rsplit(":", 1)[1]),
                              grpc_ready(router_addr), env))
        children.append(Child("sandbox", sandbox_addr, python_cli("serve", "sandbox", "--port", sandbox_addr.rsplit(":", 1)[1]),
                              grpc_ready(sandbox_addr), env))
    gateway_addr = f"127.0.0.1:{port}"
    sandbox_args = ("--sandbox", sandbox_addr) if full else ()
    children.append(Child("gateway", gateway_addr, python_cli("serve", "gateway", "--port", str(port), "--worker", worker_addr,
                                                              *sandbox_args, *gateway_extra), grpc_ready(gateway_addr), env))
    return children, redis_url


@app.command("up")
def up(
    model: Optional[Path] = typer.Option(None, envvar="COTSERVE_MODEL", help="Checkpoint folder for the worker (default: the bundled demo model)."),
    port: int = typer.Option(50051, envvar="COTSERVE_PORT", help="The gateway's port: the stack's public address."),
    redis_url: Optional[str] = typer.Option(None, envvar="COTSERVE_REDIS_URL", help="Use this Redis instead of starting the embedded one."),
    start_timeout_s: float = typer.Option(120.0, help="Seconds to wait for each service to report SERVING."),
) -> None:
    """Start every service on loopback (Redis, worker, gateway), wait until each is ready, stop all on Ctrl-C/SIGTERM."""
    from rich.console import Console

    from cotserve.common.procs import wait_serving

    console = Console(stderr=True)
    children, redis_url = _stack(model, port, redis_url)
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
            console.print(f"[green]✓[/green] {child.name} ready on {child.address}")
        console.print(f"cotserve is up: gateway on 127.0.0.1:{port} (redis {redis_url})")
        console.print(f'  try: cotserve generate "37+48-12=" --address 127.0.0.1:{port} --stream')
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
    address: str = typer.Option("127.0.0.1:50051", envvar="COTSERVE_ADDRESS", help="Address of the gateway."),
    model: str = typer.Option("", help="Model name (empty: the only model served)."),
    max_new_tokens: int = typer.Option(256, help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, help="Sampling temperature, 0..2 (0 = greedy)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    sla: str = typer.Option("interactive", help="SLA class: realtime, interactive or batch."),
    api_key: Optional[str] = typer.Option(None, envvar="COTSERVE_API_KEY", help="API key, sent as a Bearer token."),
    timeout_s: Optional[float] = typer.Option(None, help="Deadline for the whole call, in seconds."),
    pre_processor: str = typer.Option("", help="Sandbox module run on the prompt first (e.g. cot-guard)."),
    post_processor: str = typer.Option("", help="Sandbox module run on the completed text (e.g. strip-think)."),
    stream: bool = typer.Option(False, "--stream", help="Print text as it arrives."),
) -> None:
    """Generate a completion through the gateway and print it with its timing line."""
    from cotserve.sdk import Client, CotserveError

    kwargs = dict(model=model, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, sla=sla,
                  timeout_s=timeout_s, api_key=api_key, pre_processor=pre_processor, post_processor=post_processor)
    try:
        with Client(address) as client:
            if stream:
                last = None
                for chunk in client.stream(prompt, **kwargs):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    last = chunk
                reason, usage, timing = last.finish_reason, last.usage, last.timing
            else:
                result = client.generate(prompt, **kwargs)
                sys.stdout.write(result.text)
                reason, usage, timing = result.finish_reason, result.usage, result.timing
    except CotserveError as err:
        typer.echo(f"error: {err.code.name}: {err.message}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"\n[{reason} | {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens | "
               f"queue {timing.queue_ms:.1f} ms, ttft {timing.ttft_ms:.1f} ms, total {timing.total_ms:.1f} ms]")


@tenants_app.command("add-key")
def tenants_add_key(
    name: str = typer.Argument(..., help="Tenant name (created if new)."),
    file: Path = typer.Option(..., "--file", envvar="COTSERVE_TENANTS_FILE", help="The tenants TOML file (created if missing)."),
    requests_per_min: Optional[int] = typer.Option(None, help="Set the tenant's requests per minute."),
    tokens_per_min: Optional[int] = typer.Option(None, help="Set the tenant's tokens (prompt + completion) per minute."),
    max_concurrent: Optional[int] = typer.Option(None, help="Set the tenant's concurrent requests."),
) -> None:
    """Create an API key for a tenant: print it once, store only its SHA-256 hash."""
    from cotserve.gateway.tenants import add_key

    for flag, value in (("requests_per_min", requests_per_min), ("tokens_per_min", tokens_per_min),
                        ("max_concurrent", max_concurrent)):
        if value is not None and value < 1:
            raise typer.BadParameter(f"{flag}: {value}, must be >= 1")
    try:
        key = add_key(file, name, requests_per_min=requests_per_min, tokens_per_min=tokens_per_min,
                      max_concurrent=max_concurrent)
    except ValueError as exc:
        typer.echo(f"cotserve tenants: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(key)
    typer.echo(f"stored the key's SHA-256 for tenant {name!r} in {file}; this is the only time the key is shown", err=True)


def _wide_console():
    """Tables print whole when piped to a file (rich would otherwise assume 80 columns)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: give comma-separated integers, e.g. 1,8,32") from None
    if not levels or min(levels) < 1:
        raise typer.BadParameter(f"{text!r}: every level must be >= 1")
    return levels


@bench_app.command("throughput")
def bench_throughput(
    address: str = typer.Option("127.0.0.1:50051", envvar="COTSERVE_ADDRESS", help="Gateway address."),
    concurrency: str = typer.Option("1,8,32", help="Comma-separated concurrency levels."),
    prompt_tokens: int = typer.Option(64, help="Tokens per prompt (built with the served tokenizer)."),
    max_new_tokens: int = typer.Option(64, help="Tokens generated per request (end-of-sequence ignored)."),
    requests_per_level: Optional[int] = typer.Option(None, help="Requests per level (default: max(16, 2 x concurrency))."),
    model: str = typer.Option("", help="Model name (empty: the only model served)."),
) -> None:
    """Streaming load through the gateway: req/s, output tok/s, TTFT and inter-token latency percentiles."""
    from cotserve.bench.throughput import run, table

    console = _wide_console()
    results = asyncio.run(run(address, _levels(concurrency), prompt_tokens, max_new_tokens, requests_per_level, model,
                              progress=lambda m: console.print(m, style="dim")))
    console.print(table(results))


@bench_app.command("baseline")
def bench_baseline(
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder (default: the bundled demo model)."),
    address: Optional[str] = typer.Option(None, help="A gateway already serving MODEL (default: start worker + gateway here)."),
    concurrency: int = typer.Option(32, help="cotserve's concurrency (and transformers' static batch size)."),
    prompt_tokens: int = typer.Option(64, help="Tokens per prompt."),
    max_new_tokens: int = typer.Option(64, help="Tokens generated per request."),
    requests: int = typer.Option(64, help="Requests for cotserve and for static batching."),
    single_requests: int = typer.Option(16, help="Requests for transformers one-at-a-time."),
) -> None:
    """Same workload through cotserve and through transformers' generate; prints cotserve's throughput ratios."""
    from rich.table import Table

    from cotserve.bench.baseline import run_transformers
    from cotserve.bench.throughput import prompt_of_tokens, run_level, table
    from cotserve.common.procs import free_port, wait_serving
    from cotserve.sdk import AsyncClient
    from cotserve.worker.server import DEMO_MODEL

    console = _wide_console()
    model_dir = model or DEMO_MODEL
    children = []
    if address is None:
        children, _ = _stack(model_dir, free_port(), None, full=False)
        address = children[-1].address
    try:
        for child in children:
            child.start()
            console.print(f"starting {child.name} ...", style="dim")
            wait_serving(child, 120, lambda: None)

        async def ours():
            async with AsyncClient(address) as c:
                prompt = await prompt_of_tokens(c, prompt_tokens)
                ids = await c.tokenize(prompt)
                await c.generate(prompt, max_new_tokens=4)
            return prompt, ids, await run_level(address, concurrency, prompt, max_new_tokens, requests)

        console.print(f"cotserve: {requests} requests at concurrency {concurrency} ...", style="dim")
        prompt, ids, level = asyncio.run(ours())
    finally:
        for child in reversed(children):
            child.stop(5.0)
    console.print(table([level]))
    console.print(f"transformers: {single_requests} requests one at a time ...", style="dim")
    single = run_transformers(model_dir, ids, max_new_tokens, single_requests, 1)
    console.print(f"transformers: {requests} requests in static batches of {concurrency} ...", style="dim")
    static = run_transformers(model_dir, ids, max_new_tokens, requests, concurrency)
    t = Table(title=f"{prompt_tokens}+{max_new_tokens} tokens per request, {model_dir.name}")
    for col in ("system", "requests", "output tok/s", "cotserve ratio"):
        t.add_column(col, justify="right")
    t.add_row(f"cotserve via gateway, concurrency {concurrency}", str(level.num_requests),
              f"{level.output_tokens_per_s:.1f}", "1.00x")
    for b in (single, static):
        t.add_row(b.name, str(b.num_requests), f"{b.output_tokens_per_s:.1f}",
                  f"{level.output_tokens_per_s / b.output_tokens_per_s:.2f}x")
    console.print(t)


@bench_app.command("isolation")
def bench_isolation(
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder (default: the bundled demo model)."),
    duration_s: float = typer.Option(20.0, help="Seconds of tenant B's load per run."),
    flood_concurrency: int = typer.Option(64, help="Tenant A's BATCH requests in flight at once."),
    interactive_rps: float = typer.Option(4.0, help="Tenant B's INTERACTIVE requests per second (Poisson)."),
    realtime_rps: float = typer.Option(1.0, help="Tenant B's REALTIME requests per second (Poisson)."),
    max_num_seqs: int = typer.Option(32, help="The worker's batch size, so that the flood contends for it."),
) -> None:
    """Noisy neighbour: tenant B alone, B under A's BATCH flood with SLA scheduling on, and with it off (FIFO)."""
    from cotserve.bench.isolation import RunResult, drive, goals, summarize
    from cotserve.common.procs import free_port, wait_serving

    console = _wide_console()
    worker_common = ("--max-num-seqs", str(max_num_seqs))
    runs = [
        ("B alone", 0, worker_common, ()),
        ("B + flood, SLA on", flood_concurrency, worker_common, ()),
        ("B + flood, FIFO", flood_concurrency, (*worker_common, "--scheduling", "fifo"), ("--no-admission",)),
    ]
    results = []
    for name, flood, wargs, gargs in runs:
        children, _ = _stack(model, free_port(), None, full=False, worker_extra=wargs, gateway_extra=gargs)
        try:
            for child in children:
                child.start()
                wait_serving(child, 120, lambda: None)
            console.print(f"{name}: {duration_s:.0f} s ...", style="dim")
            seconds, records, flood_tokens = asyncio.run(drive(
                children[-1].address, duration_s=duration_s, flood_concurrency=flood,
                interactive_rps=interactive_rps, realtime_rps=realtime_rps))
            results.append(RunResult(name, seconds, records, flood_tokens))
        finally:
            for child in reversed(children):
                child.stop(5.0)
    console.print(summarize(results))
    for line in goals(*results):
        console.print(line)


@bench_app.command("sandbox")
def bench_sandbox(
    runs: int = typer.Option(1000, help="Runs for the latency percentiles and for the throughput pass."),
    threads: int = typer.Option(2, help="Threads running modules at once for the throughput pass."),
) -> None:
    """Sandbox per-run overhead (strip-think, 2 KB input) and runs/s; cot-guard detection and false-positive rates."""
    from rich.table import Table

    from cotserve.bench.sandbox import bench_runs, evaluate_guard

    console = _wide_console()
    b = bench_runs(runs, threads)
    t = Table(title="sandbox: strip-think on 2 KB, fresh store + instance per run")
    for col in ("runs", "p50 ms", "p99 ms", "threads", "runs/s"):
        t.add_column(col, justify="right")
    t.add_row(str(b.runs), f"{b.p50_ms:.3f}", f"{b.p99_ms:.3f}", str(b.threads), f"{b.runs_per_s:.0f}")
    console.print(t)
    g = evaluate_guard()
    console.print(f"cot-guard detection: {g.detected}/{g.attacks} = {g.detected / g.attacks:.1%}; "
                  f"false positives: {g.false_positives}/{g.ordinary} = {g.false_positives / g.ordinary:.1%} "
                  f"(arithmetic prompts rejected: {g.arithmetic_rejected})")
    for a in g.missed:
        console.print(f"  missed: {a!r}", markup=False)
    for p in g.flagged:
        console.print(f"  flagged: {p!r}", markup=False)


@bench_app.command("moe")
def bench_moe(
    workers: int = typer.Option(4, help="Workers following the policy."),
    updates: int = typer.Option(200, help="Policies set through the router."),
) -> None:
    """Policy propagation: SetPolicy returning -> every worker has applied that version (p50/p99)."""
    import tempfile

    from cotserve.bench.moe import make_mixtral, measure_propagation, percentile, stop_all
    from cotserve.common.procs import Child, free_port, grpc_ready, python_cli, redis_child, wait_serving

    console = _wide_console()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_mixtral(Path(tmp) / "moe-bench")
        redis, url = redis_child(free_port())
        children = [redis]
        names = [f"w{i}" for i in range(workers)]
        for name in names:
            addr = f"127.0.0.1:{free_port()}"
            children.append(Child(name, addr, python_cli("serve", "worker", "--model", str(model), "--port", addr.rsplit(":", 1)[1],
                                                         "--redis-url", url, "--worker-id", name, "--torch-threads", "1",
                                                         "--max-num-seqs", "4"), grpc_ready(addr)))
        router_addr = f"127.0.0.1:{free_port()}"
        children.append(Child("router", router_addr, python_cli("serve", "router", "--port", router_addr.rsplit(":", 1)[1],
                                                                "--redis-url", url, "--no-balance"), grpc_ready(router_addr)))
        try:
            for child in children:
                child.start()
                wait_serving(child, 120, lambda: None)
            console.print(f"{workers} workers, {updates} policy updates ...", style="dim")
            times = measure_propagation(router_addr, url, "moe-bench", names, updates,
                                        progress=lambda m: console.print(m, style="dim"))
        finally:
            stop_all([c.proc for c in reversed(children) if c.proc is not None])
    console.print(f"propagation to all {workers} workers over {updates} updates: p50 {percentile(times, 50):.2f} ms, "
                  f"p99 {percentile(times, 99):.2f} ms, max {max(times):.2f} ms (goal: p99 < 50 ms)")


@bench_app.command("moe-balance")
def bench_moe_balance(
    skew: float = typer.Option(1.5, help="How hard the checkpoint's gates favour experts 0 and 1."),
    gamma: float = typer.Option(0.1, help="Bias step of the router's balancing rule."),
    rule: str = typer.Option("sign", help="The router's balancing rule: sign or proportional."),
    timeout_s: float = typer.Option(120.0, help="Give up after this long."),
) -> None:
    """Balancing: a skewed Mixtral under load, the router's loop on; balancedness per layer before and after."""
    import tempfile
    import threading

    import grpc

    from cotserve.bench.moe import make_mixtral, mean_kl, stop_all
    from cotserve.common.procs import Child, free_port, grpc_ready, python_cli, redis_child, wait_serving
    from cotserve.common.v1 import common_pb2
    from cotserve.router import protocol
    from cotserve.router.v1 import router_pb2, router_pb2_grpc
    from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

    console = _wide_console()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_mixtral(Path(tmp) / "moe-skewed", skew=skew)
        redis, url = redis_child(free_port())
        worker_addr, router_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        children = [
            redis,
            Child("worker", worker_addr, python_cli("serve", "worker", "--model", str(model_dir), "--port",
                                                    worker_addr.rsplit(":", 1)[1], "--redis-url", url), grpc_ready(worker_addr)),
            Child("router", router_addr, python_cli("serve", "router", "--port", router_addr.rsplit(":", 1)[1], "--redis-url",
                                                    url, "--balance-interval-s", "1", "--gamma", str(gamma), "--rule", rule),
                  grpc_ready(router_addr)),
        ]
        stop = threading.Event()
        prompts = [[0, *range(3 + i, 35 + i)] for i in range(8)]

        def load_loop() -> None:
            with grpc.insecure_channel(worker_addr) as ch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)
                i = 0
                while not stop.is_set():
                    req = worker_pb2.GenerateRequest(prompt_token_ids=prompts[i % len(prompts)], sampling=common_pb2.SamplingParams(
                        max_new_tokens=32, ignore_eos=True, temperature=1.0, seed=i))
                    for _ in stub.Generate(req):
                        pass
                    i += 1

        try:
            for child in children:
                child.start()
                wait_serving(child, 120, lambda: None)
            loaders = [threading.Thread(target=load_loop, daemon=True) for _ in range(4)]
            for t in loaders:
                t.start()
            with grpc.insecure_channel(router_addr) as ch:
                router = router_pb2_grpc.RouterServiceStub(ch)

                def balance() -> tuple[int, list[float]]:
                    resp = router.GetExpertLoad(router_pb2.GetExpertLoadRequest(model="moe-skewed", window_ms=2000))
                    version = router.GetPolicy(router_pb2.GetPolicyRequest(model="moe-skewed")).policy.version
                    return version, [l.balancedness for l in resp.layers]

                start = time.monotonic()
                history = []
                while time.monotonic() - start < timeout_s:
                    time.sleep(1.0)
                    history.append((time.monotonic() - start, *balance()))
                    t_s, version, b = history[-1]
                    console.print(f"  {t_s:5.1f}s  policy v{version}  balancedness {' '.join(f'{x:.3f}' for x in b)}", style="dim")
                    if len(history) >= 3 and all(min(h[2] or [0]) >= 0.9 for h in history[-3:]):
                        break
                final = router.GetPolicy(router_pb2.GetPolicyRequest(model="moe-skewed")).policy
        finally:
            stop.set()
            stop_all([c.proc for c in reversed(children) if c.proc is not None])
        first = next((h for h in history if h[2]), None)
        converged = next((h for h in history if h[2] and min(h[2]) >= 0.9), None)
        kl = mean_kl(model_dir, protocol.to_routing(final), prompts)
    if first:
        console.print(f"before: balancedness per layer {' '.join(f'{x:.3f}' for x in first[2])} (policy v{first[1]})")
    last = history[-1] if history else None
    if last:
        console.print(f"after:  balancedness per layer {' '.join(f'{x:.3f}' for x in last[2])} (policy v{last[1]}, {last[0]:.0f} s)")
    if converged:
        console.print(f"every layer >= 0.9 first at {converged[0]:.0f} s, policy v{converged[1]} ({converged[1]} balancing windows)")
    else:
        console.print("not every layer reached balancedness 0.9 within the time limit")
    console.print(f"output change, mean KL(unbiased || balanced) per token: {kl:.4f} nats")


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
