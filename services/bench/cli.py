"""`cotserve bench ...`: every benchmark prints a table, with ratios against a baseline run in the same process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from cotserve.common.clitools import int_list, run_loop, wide_console
from cotserve.common.topology import stack


bench_app = typer.Typer(help="Benchmarks: tables, and ratios against a baseline run in the same process.", no_args_is_help=True)


def _levels(text: str) -> list[int]:
    return int_list(text, "1,8,32")


@bench_app.command("throughput")
def bench_throughput(
    address: str = typer.Option("127.0.0.1:50051", envvar="COTSERVE_ADDRESS", help="Gateway address."),
    concurrency: str = typer.Option("1,8,32", help="Comma-separated concurrency levels."),
    prompt_tokens: int = typer.Option(64, help="Tokens per prompt (built with the served tokenizer)."),
    max_new_tokens: int = typer.Option(64, help="Tokens generated per request (end-of-sequence ignored)."),
    requests_per_level: Optional[int] = typer.Option(None, help="Requests per level (default: max(16, 2 x concurrency))."),
    model: str = typer.Option("", help="Model name (empty: the only model served)."),
    http: bool = typer.Option(False, "--http", help="Also run each level through the gateway's OpenAI-compatible HTTP "
                              "API (streamed /v1/completions) and print its output tok/s against gRPC's."),
    http_url: str = typer.Option("http://127.0.0.1:8000/v1", envvar="COTSERVE_HTTP_URL",
                                 help="Base URL of the HTTP API, for --http (what `cotserve up` serves)."),
) -> None:
    """Streaming load through the gateway: req/s, output tok/s, TTFT and inter-token latency percentiles."""
    from cotserve.bench.throughput import run, table

    console = wide_console()
    results = run_loop(run(address, _levels(concurrency), prompt_tokens, max_new_tokens, requests_per_level, model,
                              progress=lambda m: console.print(m, style="dim"), http_url=http_url if http else None))
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
    engine_batches: str = typer.Option("1,8,32", help="Engine-only batch sizes, each run with the C kernels as served, an FP8 KV "
                                       "cache, each operation called from Python, the layers' operations in torch, the torch "
                                       "references compiled and eager (bench/baseline.KERNEL_SETTINGS); empty for none."),
    ttft_rounds: int = typer.Option(50, help="Requests (one at a time) for the gateway-added TTFT, per path; 0: skip."),
    stream_intervals: str = typer.Option("1,8", help="The workers' --stream-interval for the runs through the gateway, "
                                         "one stack started per value (ignored with --address)."),
    session: bool = typer.Option(True, help="The load's client sends its requests as streams of one Session call "
                                 "(AsyncClient(multiplex=True)); --no-session: a GenerateStream call each."),
    compare_per_call: bool = typer.Option(True, help="With --session, also run the first stream interval with a "
                                          "GenerateStream call per request (the client before Session)."),
    internal_tls_runs: int = typer.Option(3, min=0, help="Load runs on two stacks side by side, internal calls in "
                                          "plaintext and over mutual TLS: what mTLS costs (bench/mtls.py); 0: skip."),
) -> None:
    """Same workload through cotserve, through cotserve's engine alone and through transformers' generate; prints
    cotserve's throughput ratios and, for a stack it started, CPU time per generated token of each process (per stream
    interval), the engine alone at several batch sizes (the C kernels, with an FP8 KV cache, per operation, with the layers'
    operations in torch, the torch references compiled and eager) against the ceiling the model's matrix multiplies alone
    set, the TTFT the gateway adds (against a bare gRPC relay, and a gateway calling the worker per request), and what
    mutual TLS between the services costs."""
    import torch

    from cotserve.bench import baseline as b
    from cotserve.worker.config import DEMO_MODEL, WorkerConfig

    console = wide_console()
    say = lambda m: console.print(m, style="dim")  # noqa: E731
    model_dir = model or DEMO_MODEL
    batches = int_list(engine_batches, "1,8,32") if engine_batches.strip() else []
    intervals: list[int | None] = [None] if address is not None else list(int_list(stream_intervals, "1,8"))
    load = b.Load(concurrency, prompt_tokens, max_new_tokens, requests)
    runs = [b.run_through_gateway(model_dir, address, interval, load, ttft_rounds if n == 0 else 0, say, session=s)
            for n, (interval, s) in enumerate(b.gateway_plan(intervals, session, compare_per_call))]
    ids = runs[0].prompt_ids
    b.print_gateway_runs(console, runs)
    if internal_tls_runs and address is None:
        b.mtls_cost(console, model_dir, load, ttft_rounds or 20, internal_tls_runs, say)
    # the engine alone on every core, and on the threads a worker's engine process takes here (all cores but
    # one, left to the serving processes): what the end-to-end rate is compared with
    worker_threads = WorkerConfig().cpu_threads
    say(f"cotserve engine only: {requests} requests, batch {concurrency}, on {torch.get_num_threads()} and on "
        f"{worker_threads} torch threads ...")
    engine_only = b.run_engine_only(model_dir, ids, max_new_tokens, requests, concurrency, torch.get_num_threads())
    engine_as_worker = b.run_engine_only(model_dir, ids, max_new_tokens, requests, concurrency, worker_threads)
    engine_rows = b.engine_batch_rows(model_dir, ids, max_new_tokens, batches, say)
    single, static = b.transformers_rows(model_dir, ids, load, single_requests, say)
    b.print_summary(console, load, model_dir, runs, [engine_only, engine_as_worker, single, static])
    b.print_ratios(console, runs, engine_as_worker, engine_only, static, worker_threads)
    b.print_ceiling(console, model_dir, load, worker_threads, engine_as_worker)
    if engine_rows:
        ceilings = b.linear_ceilings(model_dir, prompt_tokens, max_new_tokens, batches, torch.get_num_threads())
        console.print(b.engine_table(engine_rows, batches, ceilings))


def _isolation_runs(flood_concurrency: int, max_num_seqs: int, session: bool, compare_per_call: bool,
                    compare_batch_interval: bool, compare_batch_yield: bool, compare_stagger: bool) -> list[tuple]:
    """`bench isolation`'s runs: (name, flood concurrency, worker flags, gateway flags, B on a Session)."""
    worker_common = ("--max-num-seqs", str(max_num_seqs))
    runs = [
        ("B alone", 0, worker_common, (), session),
        ("B + flood, SLA on", flood_concurrency, worker_common, (), session),
        ("B + flood, FIFO", flood_concurrency, (*worker_common, "--scheduling", "fifo", "--batch-stream-interval", "1"),
         ("--no-admission",), session),
    ]
    if compare_per_call and session:  # the client before: B's requests a call each
        runs.append(("B + flood, SLA on, B a call per request", flood_concurrency, worker_common, (), False))
    if compare_batch_interval:  # the design before: BATCH streamed token by token as every class
        runs.append(("B + flood, SLA on, BATCH per token", flood_concurrency,
                     (*worker_common, "--batch-stream-interval", "1"), (), session))
    if compare_batch_yield:  # BATCH decodes in the step of an urgent prompt
        runs.append(("B + flood, SLA on, BATCH not yielding", flood_concurrency,
                     (*worker_common, "--scheduling", "priority"), (), session))
    if compare_stagger:
        runs.append(("B + flood, SLA on, writes not spread", flood_concurrency, (*worker_common, "--no-stream-stagger"),
                     (), session))
    return runs


@bench_app.command("isolation")
def bench_isolation(
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder (default: the bundled demo model)."),
    duration_s: float = typer.Option(20.0, help="Seconds of tenant B's load per run."),
    flood_concurrency: int = typer.Option(64, help="Tenant A's BATCH requests in flight at once."),
    interactive_rps: float = typer.Option(4.0, help="Tenant B's INTERACTIVE requests per second (Poisson)."),
    realtime_rps: float = typer.Option(1.0, help="Tenant B's REALTIME requests per second (Poisson)."),
    max_num_seqs: int = typer.Option(32, help="The worker's batch size, so that the flood contends for it."),
    compare_batch_interval: bool = typer.Option(True, help="Also run the flood with BATCH streamed token by token "
                                                "(--batch-stream-interval 1), the design before BATCH's 8-token messages."),
    compare_batch_yield: bool = typer.Option(True, help="Also run the flood with BATCH decoding beside urgent prompts "
                                             "(--scheduling priority: SLA classes without yielding)."),
    compare_stagger: bool = typer.Option(True, help="Also run the flood with held streams writing in step with each "
                                         "other (--no-stream-stagger), the design before their writes were spread."),
    session: bool = typer.Option(True, help="Tenant B's client sends its requests as streams of one Session call "
                                 "(AsyncClient(multiplex=True)); --no-session: a GenerateStream call each. The flood "
                                 "is a call per request either way."),
    compare_per_call: bool = typer.Option(True, help="Also run the flood with SLA on and tenant B a call per request "
                                          "(with --session), the client before Session."),
    tenant_fairness: int = typer.Option(0, min=0, max=64, help="Instead: tenant A floods INTERACTIVE self-consistency "
                                        "votes of this many samples (0: the BATCH flood above); B alone, B under the "
                                        "votes with fair shares (--scheduling tenant-fair, the gateway's fair queues) "
                                        "and without (priority-yield)."),
) -> None:
    """Noisy neighbour: tenant B alone, B under A's BATCH flood with SLA scheduling on, and with it off (FIFO); or,
    with --tenant-fairness N, under A's votes of N samples with fair shares and without."""
    if tenant_fairness:
        _bench_fairness(model, duration_s, flood_concurrency, interactive_rps, realtime_rps, max_num_seqs,
                        tenant_fairness, session)
        return
    from cotserve.bench.baseline import service_pids
    from cotserve.bench.isolation import cpu_table, drive, goals, summarize
    from cotserve.common.procs import free_port
    from cotserve.bench.warm import running

    console = wide_console()
    runs = _isolation_runs(flood_concurrency, max_num_seqs, session, compare_per_call, compare_batch_interval,
                           compare_batch_yield, compare_stagger)
    results = []
    for name, flood, wargs, gargs, b_session in runs:
        children, _ = stack(model, free_port(), None, full=False, worker_extra=wargs, gateway_extra=gargs)
        with running(children):
            console.print(f"{name}: {duration_s:.0f} s ...", style="dim")
            result = run_loop(drive(children[-1].address, duration_s=duration_s, flood_concurrency=flood,
                                       interactive_rps=interactive_rps, realtime_rps=realtime_rps,
                                       pids=service_pids(children), multiplex=b_session))
            result.name = name
            results.append(result)
    console.print(summarize(results))
    console.print(cpu_table(results))
    for line in goals(*results[:3]):
        console.print(line)


def _bench_fairness(model, duration_s: float, flood_concurrency: int, interactive_rps: float, realtime_rps: float,
                    max_num_seqs: int, votes: int, session: bool) -> None:
    """`bench isolation --tenant-fairness N`: two tenants with API keys (a tenants file made for the run)."""
    import tempfile

    from cotserve.bench.baseline import service_pids
    from cotserve.bench.isolation import drive, fairness_goals, summarize
    from cotserve.bench.warm import running
    from cotserve.common.procs import free_port
    from cotserve.common.sampling import SlaClass
    from cotserve.gateway.tenants import add_key

    console = wide_console()
    folder = Path(tempfile.mkdtemp(prefix="cotserve-fairness-"))
    tenants = folder / "tenants.toml"
    keys = (add_key(tenants, "a", frozenset(SlaClass)), add_key(tenants, "b", frozenset(SlaClass)))
    worker_common = ("--max-num-seqs", str(max_num_seqs))
    flood = min(flood_concurrency, 4)
    runs = [("B alone", 0, (*worker_common, "--scheduling", "tenant-fair")),
            (f"B + A's {votes}-sample votes, fair shares", flood, (*worker_common, "--scheduling", "tenant-fair")),
            (f"B + A's {votes}-sample votes, priority-yield", flood, (*worker_common, "--scheduling", "priority-yield"))]
    results = []
    for name, concurrency, wargs in runs:
        children, _ = stack(model, free_port(), None, full=False, worker_extra=wargs,
                            gateway_extra=("--tenants-file", str(tenants)))
        with running(children):
            console.print(f"{name}: {duration_s:.0f} s ...", style="dim")
            result = run_loop(drive(children[-1].address, duration_s=duration_s, flood_concurrency=concurrency,
                                    interactive_rps=interactive_rps, realtime_rps=realtime_rps,
                                    pids=service_pids(children), multiplex=session, flood_votes=votes, keys=keys))
            result.name = name
            results.append(result)
    console.print(summarize(results, f"tenant B under tenant A's INTERACTIVE votes of {votes} samples"))
    for line in fairness_goals(*results):
        console.print(line)


@bench_app.command("families")
def bench_families(
    hidden: int = typer.Option(512, min=64, help="Hidden size of every family's checkpoint."),
    layers: int = typer.Option(8, min=1, help="Decoder layers."),
    heads: int = typer.Option(8, min=1, help="Query heads (head size: hidden / heads)."),
    kv_heads: int = typer.Option(2, min=1, help="Key/value heads."),
    intermediate: int = typer.Option(1536, min=4, help="Dense MLP size (an MoE expert's: a quarter of it, 8 experts, 2 chosen)."),
    batches: str = typer.Option("1,8,32", help="Engine-alone batch sizes; transformers runs static batches of the last."),
    prompt_tokens: int = typer.Option(64, min=1, help="Tokens per prompt."),
    max_new_tokens: int = typer.Option(64, min=1, help="Tokens generated per request."),
    family: list[str] = typer.Option([], help="Only this family (repeatable; the table's names, e.g. gpt-oss); "
                                              "default: every one."),
) -> None:
    """Every architecture the worker loads (random weights, one shape): cotserve's engine alone at several batch
    sizes against transformers' generate in static batches, in the same process."""
    from cotserve.bench.families import Shape, family_configs, measure, table

    console = wide_console()
    if hidden % heads or heads % kv_heads:
        raise typer.BadParameter(f"hidden {hidden} / heads {heads} / kv_heads {kv_heads}: heads must divide hidden and "
                                 "kv_heads divide heads", param_hint="--heads")
    shape = Shape(hidden, layers, heads, kv_heads, intermediate)
    known = list(family_configs(shape))
    unknown = [f for f in family if f not in known]
    if unknown:
        raise typer.BadParameter(f"{', '.join(unknown)}: not a family (allowed: {', '.join(known)})", param_hint="--family")
    sizes = int_list(batches, "1,8,32")
    rows = measure(shape, sizes, prompt_tokens, max_new_tokens, lambda m: console.print(m, style="dim"), family or None)
    console.print(table(rows, sizes, shape, prompt_tokens, max_new_tokens))


@bench_app.command("structured")
def bench_structured(
    model: Path = typer.Option(None, help="Model folder (default: the bundled demo model)."),
    batches: str = typer.Option("1,8,32", help="Engine-alone batch sizes."),
    max_new_tokens: int = typer.Option(200, min=8, help="Tokens every request generates (the schema asks for more)."),
    repeats: int = typer.Option(3, min=1, help="Runs of each mode per batch size, alternated; medians compared."),
    schemas: int = typer.Option(20, min=1, help="Schemas compiled for the compile-time figures."),
    tokenizer: Path = typer.Option(None, help="tokenizer.json for the grammar engines' mask times (default: the "
                                              "model's)."),
    mask_batch: int = typer.Option(32, min=1, help="Sequences whose bitmask is filled together per step."),
) -> None:
    """What a structured-output constraint costs: engine tokens/s under a JSON Schema against unconstrained, grammar
    compile time per schema, and the grammar engines' bitmask time per step (xgrammar, and llguidance if installed)."""
    from rich.table import Table

    from cotserve.bench.structured import compile_times, engine_rates, mask_times
    from cotserve.worker.config import DEMO_MODEL

    console = wide_console()
    folder = model or DEMO_MODEL
    say = lambda m: console.print(m, style="dim")  # noqa: E731
    sizes = int_list(batches, "1,8,32")
    rows = engine_rates(folder, sizes, max_new_tokens, repeats, say)
    t = Table(title=f"engine alone, {folder.name}: {max_new_tokens} tokens a request, output tok/s (median of "
                    f"{repeats})")
    for column in ("batch", "free", "under a JSON Schema", "ratio"):
        t.add_column(column, justify="right")
    for r in rows:
        t.add_row(str(r.batch), f"{r.free:,.0f}", f"{r.constrained:,.0f}", f"{r.constrained / r.free:.2f}x")
    console.print(t)
    cold, warm = compile_times(folder, schemas)
    console.print(f"compile a schema of nested objects: {cold:.2f} ms new, {warm:.3f} ms cached (median of {schemas})")
    t = Table(title=f"bitmask of {mask_batch} sequences per step, each writing its own document of nested objects "
                    f"({(tokenizer or folder / 'tokenizer.json').name})")
    for column in ("engine", "tokenizer prep ms", "compile + matchers ms", "mean ms / step", "p90 ms / step", "tokens"):
        t.add_column(column, justify="right")
    for r in mask_times(tokenizer or folder / "tokenizer.json", mask_batch, say):
        t.add_row(r.library, f"{r.prepare_ms:,.1f}", f"{r.compile_ms:.1f}", f"{r.mean_ms:.3f}", f"{r.p90_ms:.3f}",
                  str(r.tokens))
    console.print(t)


@bench_app.command("sandbox")
def bench_sandbox(
    runs: int = typer.Option(1000, help="Runs for the latency percentiles and for the throughput pass."),
    threads: int = typer.Option(2, help="Threads running modules at once for the throughput pass."),
) -> None:
    """Sandbox per-run overhead (strip-think, 2 KB input) and runs/s; cot-guard detection and false-positive rates."""
    from rich.table import Table

    from cotserve.bench.sandbox import bench_runs, evaluate_guard

    console = wide_console()
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

    from cotserve.bench.moe import make_mixtral, measure_propagation
    from cotserve.common.stats import percentile
    from cotserve.common.procs import Child, free_port, grpc_ready, python_cli, redis_child
    from cotserve.bench.warm import running

    console = wide_console()
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
        with running(children):
            console.print(f"{workers} workers, {updates} policy updates ...", style="dim")
            times = measure_propagation(router_addr, url, "moe-bench", names, updates,
                                        progress=lambda m: console.print(m, style="dim"))
    console.print(f"propagation to all {workers} workers over {updates} updates: p50 {percentile(times, 50):.2f} ms, "
                  f"p99 {percentile(times, 99):.2f} ms, max {max(times):.2f} ms (goal: p99 < 50 ms)")


def _watch_balance(router_addr: str, timeout_s: float, console) -> tuple[list, object]:
    """Poll the router each second for the skewed model's per-layer balancedness until every layer has held
    >= 0.9 for three polls or `timeout_s` passed: [(seconds, policy version, balancedness per layer)], last policy."""
    import grpc

    from cotserve.router.v1 import router_pb2, router_pb2_grpc

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
        return history, router.GetPolicy(router_pb2.GetPolicyRequest(model="moe-skewed")).policy


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

    from cotserve.bench.moe import balance_stack, generate_until, make_mixtral, mean_kl, report_balance
    from cotserve.common import moe_protocol as protocol
    from cotserve.bench.warm import running

    console = wide_console()
    prompts = [[0, *range(3 + i, 35 + i)] for i in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_mixtral(Path(tmp) / "moe-skewed", skew=skew)
        children, worker_addr, router_addr = balance_stack(model_dir, gamma, rule)
        stop = threading.Event()
        with running(children):
            loaders = [threading.Thread(target=generate_until, args=(stop, worker_addr, prompts), daemon=True)
                       for _ in range(4)]
            for t in loaders:
                t.start()
            try:
                history, final = _watch_balance(router_addr, timeout_s, console)
            finally:
                stop.set()
        kl = mean_kl(model_dir, protocol.to_routing(final), prompts)
    report_balance(console, history, kl)


@bench_app.command("telemetry")
def bench_telemetry(
    batches: int = typer.Option(200, min=1, help="Export requests (504 spans each) to send to each receiver."),
    concurrency: int = typer.Option(4, min=1, help="Export calls in flight at once."),
) -> None:
    """Spans/s the telemetry service's OTLP receiver sustains, against a null receiver that only parses (both separate processes)."""
    from rich.table import Table

    from cotserve.bench.telemetry import SPANS_PER_REQUEST, run

    console = wide_console()
    null, tel, stats = run(batches, concurrency, progress=lambda m: console.print(m, style="dim"))
    table = Table(title=f"OTLP receiver: {tel.spans} spans in batches of {tel.spans // batches}, {concurrency} exports in flight "
                        f"({SPANS_PER_REQUEST} spans per request trace)")
    for col in ("receiver", "spans/s", "request traces/s", "vs null receiver"):
        table.add_column(col, justify="right")
    for r in (null, tel):
        table.add_row(r.name, f"{r.spans_per_s:,.0f}", f"{r.spans_per_s / SPANS_PER_REQUEST:,.0f}", f"{r.spans_per_s / null.spans_per_s:.2f}x")
    console.print(table)
    console.print(f"telemetry service counted: {stats}")


@bench_app.command("slo")
def bench_slo(
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder for the worker (default: the bundled demo model)."),
    quick: bool = typer.Option(False, "--quick", help="A short run (under 3 minutes a seed on 2 cores): 100 s recorded in 25 s cycles, 20 s replays, "
                               "admission off and shed and pause only (the gateway's default with the predictor; the full mode: 600 s, "
                               "120 s, 30 s cycles, off twice and every rule)."),
    seeds: int = typer.Option(1, min=1, max=20, help="Independent runs (seeds SEED, SEED+2, ...): figures get 95% intervals "
                              "over them and violation onsets are pooled."),
    duration_s: Optional[float] = typer.Option(None, min=10, help="Seconds of time-varying load to record and learn from "
                                               "(70% train, 30% held out); default 600, 100 with --quick."),
    replay_s: Optional[float] = typer.Option(None, min=5, help="Seconds of bursty load replayed under each admission "
                                             "rule; default 120, 20 with --quick."),
    cycle_s: Optional[float] = typer.Option(None, min=6, help="Seconds of one load cycle (steady third, ramp third, burst, "
                                            "drain); default 30, 25 with --quick."),
    seed: int = typer.Option(0, help="Seed of the first run's arrivals."),
    burst: Optional[float] = typer.Option(None, min=0.1, max=3.0, help="INTERACTIVE's rate in a burst, as a multiple of the "
                                          "measured capacity (streamed requests, as the load sends them; BATCH adds 0.3x); "
                                          "default 1.5, an overload of INTERACTIVE's own; at 0.9 the gateway's admission, "
                                          "which queues BATCH behind INTERACTIVE, left INTERACTIVE no miss; 1.3 is the edge."),
    variants: Optional[str] = typer.Option(None, help="Comma-separated admission rules to replay, off among them: off, off again, "
                                           "no BATCH (the same load without its BATCH arrivals: the misses no BATCH rule can cut), all-or-nothing, "
                                           "proportional, pause (running BATCH paused on the worker), shed (INTERACTIVE that would queue "
                                           "turned away when its predicted TTFT p90 is over 0.8x its target), shed and pause (both); "
                                           "default all of them, off and proportional with --quick."),
) -> None:
    """The SLO predictor on a real stack: forecast quality against a queue-depth baseline, then misses with and without acting on it."""
    import dataclasses

    from cotserve.bench.slo import ADMISSION_VARIANTS, FULL, QUICK, run
    from cotserve.bench.slo_report import print_report

    base = QUICK if quick else FULL
    chosen = base.variants
    if variants is not None:
        chosen = tuple(dict.fromkeys(v.strip() for v in variants.split(",") if v.strip()))
        unknown = [v for v in chosen if v not in ADMISSION_VARIANTS]
        if unknown or "off" not in chosen:
            raise typer.BadParameter(f"{variants!r}: give off and any of {', '.join(ADMISSION_VARIANTS)}",
                                     param_hint="--variants")
    mode = dataclasses.replace(base, duration_s=duration_s or base.duration_s, replay_s=replay_s or base.replay_s,
                               cycle_s=cycle_s or base.cycle_s, variants=chosen, burst=burst or base.burst)
    console = wide_console()
    outs = []
    for n in range(seeds):
        outs.append(run(model, mode, seed + 2 * n, progress=lambda m: console.print(m, style="dim")))
    if not print_report(outs, mode, console):
        raise typer.Exit(1)


@bench_app.command("slo-routing")
def bench_slo_routing(
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder for the workers (default: the bundled demo model)."),
    train_s: float = typer.Option(90.0, min=10, help="Seconds of load recorded (least-loaded routing) to train the latency model on."),
    eval_s: float = typer.Option(60.0, min=5, help="Seconds of the same load's shape under each routing."),
    load: float = typer.Option(0.5, min=0.05, max=2.0, help="Arrival rate as a fraction of the three workers' measured capacity "
                               "(measured with short INTERACTIVE requests, unary calls: the mixed, streamed load is heavier, and at 0.7 "
                               "its queues grew to seconds)."),
    seed: int = typer.Option(0, help="Seed of the arrivals (the replays use SEED+1)."),
    slowed: str = typer.Option("flood", help="How the first worker is slowed: flood (streams sent straight to it, "
                               "not through the gateway) or max-seqs (--max-num-seqs 4: requests queue there)."),
    rounds: int = typer.Option(2, min=1, help="Rounds of the two routings, in alternating order (pooled in the report)."),
    session: bool = typer.Option(True, help="The load's client sends its requests as streams of one Session call "
                                 "(AsyncClient(multiplex=True)); --no-session: a GenerateStream call each."),
) -> None:
    """Routing by predicted TTFT against least-loaded routing, among three workers of which one is slowed."""
    from cotserve.bench.slo_routing import SLOWED, print_report, run

    if slowed not in SLOWED:
        raise typer.BadParameter(f"{slowed!r}: must be one of {', '.join(SLOWED)}", param_hint="--slowed")
    console = wide_console()
    out = run(model, train_s, eval_s, load, seed, progress=lambda m: console.print(m, style="dim"), slowed=slowed,
              rounds=rounds, session=session)
    if not print_report(out, console):
        raise typer.Exit(1)


@bench_app.command("kv")
def bench_kv(
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder (default: the bundled demo model)."),
    kv_cache_bytes: Optional[int] = typer.Option(None, help="KV budget in bytes for every configuration (default: what holds 16 sequences at fp32 at the longest context)."),
    contexts: str = typer.Option("128,256", help="Comma-separated tokens per sequence (prompt + generated)."),
    requests: int = typer.Option(64, min=1, help="Requests submitted at once."),
    prompt_tokens: int = typer.Option(32, min=1, help="Prompt tokens of each request."),
    device: str = typer.Option("auto", help="cpu, cuda, cuda:N or auto."),
) -> None:
    """Sequences held, output tokens/s and inter-token latency of each KV cache configuration under the same memory budget."""
    from rich.table import Table

    from cotserve.bench.kv import budget_for, run_one
    from cotserve.worker.models.loader import load_model
    from cotserve.worker.config import DEMO_MODEL
    from cotserve.worker.sizing import resolve_device

    levels = _levels(contexts)
    loaded = load_model(model or DEMO_MODEL, device=resolve_device(device))
    if max(levels) > loaded.config.max_context or min(levels) <= prompt_tokens:
        raise typer.BadParameter(f"contexts must be within {prompt_tokens + 1}..{loaded.config.max_context}", param_hint="--contexts")
    budget = kv_cache_bytes or budget_for(loaded, 16, max(levels))
    ids = (loaded.tokenizer.encode("12+30-7+5=" * 200).ids * 2)[:prompt_tokens]
    console = wide_console()
    table = Table(title=f"{loaded.name} on {loaded.device}: {requests} requests at once, KV budget {budget:,} bytes")
    for col in ("context", "cache", "blocks", "sequences held", "preemptions", "output tok/s", "ITL ms", "held vs full", "tok/s vs full", "ITL vs full"):
        table.add_column(col, justify="right")
    configs = [("full precision", "auto", 0), ("fp16", "fp16", 0), ("fp8", "fp8_e4m3", 0), ("fp8 + top-4 pages", "fp8_e4m3", 4)]
    for context in levels:
        base = None
        for name, dtype, topk in configs:
            console.print(f"context {context}: {name} ...", style="dim")
            r = run_one(loaded, name, dtype, topk, budget, context, requests, ids)
            base = base or r
            table.add_row(str(context), name, str(r.num_blocks), str(r.fit), str(r.preemptions), f"{r.tokens_per_s:,.0f}", f"{r.itl_ms:.1f}",
                          f"{r.fit / base.fit:.2f}x", f"{r.tokens_per_s / base.tokens_per_s:.2f}x",
                          f"{r.itl_ms / base.itl_ms:.2f}x")
    console.print(table)


@bench_app.command("prefix")
def bench_prefix(
    model: list[Path] = typer.Option([], "--model", help="Checkpoint folder (repeatable; default: the demo model and tests/fixtures/stdlib_llama)."),
    system_tokens: str = typer.Option("", help="Comma-separated system-prompt tokens per model (default: 160 for a context under 1,024, else 1024)."),
    requests: int = typer.Option(32, min=1, help="Requests of the shared-system-prompt workload."),
    concurrency: int = typer.Option(8, min=1, help="Requests in flight at once in that workload."),
    max_new_tokens: int = typer.Option(16, min=1, help="Tokens each request of that workload generates."),
    samples: int = typer.Option(8, min=2, max=16, help="n of the parallel-samples workload."),
    sample_prompt_tokens: Optional[int] = typer.Option(None, min=1, help="Prompt tokens of the parallel-samples workload (default: the model's system-prompt size)."),
    sample_tokens: int = typer.Option(64, min=1, help="Tokens each sample generates."),
) -> None:
    """Prefix cache and parallel samples: TTFT and prompt tokens computed with the cache off and on; n samples vs n requests."""
    from cotserve.bench.prefix import default_models, report_parallel_samples, report_shared_prompt
    from cotserve.worker.models.config import ModelConfig

    console = wide_console()
    models = list(model) or default_models()
    sizes = int_list(system_tokens, "") if system_tokens else []
    goals = []
    for i, folder in enumerate(models):
        context = ModelConfig.from_file(folder / "config.json").max_context
        size = sizes[i] if i < len(sizes) else (1024 if context > 1024 else 160)
        goals += report_shared_prompt(console, folder, size, requests, concurrency, max_new_tokens)
        goals += report_parallel_samples(console, folder, sample_prompt_tokens or size, samples, sample_tokens)
    for ok, text in goals:
        console.print(f"{'[green]met[/green]' if ok else '[red]NOT met[/red]'}: {text}")


@bench_app.command("reasoning")
def bench_reasoning(
    model: Optional[Path] = typer.Option(None, "--model", help="Reasoning checkpoint (default: the bundled testbed, services/worker/demo/testbed)."),
    problems: int = typer.Option(500, min=1, help="Seeded testbed problems every method answers."),
    concurrency: int = typer.Option(16, min=1, help="Problems in flight at once."),
    samples: int = typer.Option(8, min=2, max=16, help="Samples of the maj@N baseline, and the most adaptive self-consistency may draw."),
    temperature: float = typer.Option(1.0, min=0.01, max=2.0, help="Sampling temperature of the sampled methods."),
    seed: int = typer.Option(0, help="Seed of the sampled methods (problem i draws from seed + 1000 i)."),
) -> None:
    """Cost per correct answer: greedy, maj@N, budgets, early exit, adaptive self-consistency (+ early exit)."""
    from rich.table import Table

    from cotserve.bench.prefix import Stack
    from cotserve.bench.reasoning import TESTBED, problem_set, run_all

    console = wide_console()
    log = lambda m: console.print(m, style="dim")  # noqa: E731
    folder = model or TESTBED
    todo = problem_set(problems)
    worker_args = ("--max-num-seqs", str(max(64, concurrency * samples)), "--reasoning-step", ".")
    with Stack(folder, True, log, worker_args) as st:
        results = run_loop(run_all(st.gateway, todo, samples, temperature, concurrency, seed, log))
    by = {r.name: r for r in results}
    base, greedy = results[1], by["greedy"]
    table = Table(title=f"{folder.name}: {problems} problems, concurrency {concurrency}, temperature {temperature:g} for sampled methods")
    for col in ("method", "accuracy", "tokens / problem", "thinking / problem", "probe / problem", "samples / problem",
                "tokens / correct", "vs maj@N", "correct / s", "vs maj@N "):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r.name, f"{r.accuracy:.1%}", f"{r.tokens_per_problem:.1f}", f"{r.thinking_tokens / r.problems:.1f}",
                      f"{r.probe_tokens / r.problems:.1f}", f"{r.samples / r.problems:.2f}", f"{r.tokens_per_correct:.1f}",
                      f"{r.tokens_per_correct / base.tokens_per_correct:.2f}x", f"{r.correct_per_s:.2f}",
                      f"{r.correct_per_s / base.correct_per_s:.2f}x")
    console.print(table)
    console.print(f"per-sample accuracy of {base.name}: {base.samples_correct / base.samples:.1%}")
    both, ee = results[-1], by["early exit"]
    saved = 1 - both.tokens_per_correct / base.tokens_per_correct
    ee_saved = 1 - ee.thinking_tokens / greedy.thinking_tokens
    goals = [
        (saved >= 0.57 and base.accuracy - both.accuracy <= 0.01 + 1e-9,
         f"adaptive SC + early exit: {saved:.0%} fewer tokens per correct answer than {base.name} (goal >= 57%), "
         f"accuracy {both.accuracy:.1%} vs {base.accuracy:.1%} (goal: within 1 point)"),
        (ee_saved >= 0.30 and greedy.accuracy - ee.accuracy <= 0.01 + 1e-9,
         f"early exit: {ee_saved:.0%} fewer thinking tokens than greedy (goal >= 30%), accuracy {ee.accuracy:.1%} vs "
         f"{greedy.accuracy:.1%} (goal: at most 1 point lower)"),
        (both.correct_per_s >= 2 * base.correct_per_s,
         f"adaptive SC + early exit: {both.correct_per_s / base.correct_per_s:.2f}x the correct answers per second of "
         f"{base.name} (goal >= 2x)"),
    ]
    for ok, text in goals:
        console.print(f"{'[green]met[/green]' if ok else '[red]NOT met[/red]'}: {text}")


@bench_app.command("faults")
def bench_faults(
    targets: str = typer.Option(",".join(("worker", "redis", "sandbox", "slo", "router", "telemetry")),
                                help="Services to fault, in order, comma-separated from worker, redis, sandbox, slo, router, telemetry."),
    modes: str = typer.Option("kill,stop", help="Faults, comma-separated: kill (SIGKILL; up restarts it) and stop (SIGSTOP, then SIGCONT)."),
    stop_s: float = typer.Option(5.0, min=0.5, help="Seconds a stopped service stays frozen."),
    settle_s: float = typer.Option(2.0, min=0.5, help="Seconds of steady load before each fault and after recovery."),
    max_new_tokens: int = typer.Option(32, min=1, help="Tokens per request."),
) -> None:
    """Kill and freeze each service of the `up` stack under a steady mixed load; report failures by status code,
    requests never answered, time to serve normally again, and leaked KV pages or quota leases."""
    import tempfile

    from rich.table import Table

    from cotserve.bench.faults import MODES, TARGETS, faults

    chosen = [t.strip() for t in targets.split(",") if t.strip()]
    kinds = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [t for t in chosen if t not in TARGETS] + [m for m in kinds if m not in MODES]
    if bad or not chosen or not kinds:
        raise typer.BadParameter(f"{', '.join(bad) or 'nothing chosen'}: targets are {', '.join(TARGETS)}; modes are {', '.join(MODES)}")
    console = wide_console()
    with tempfile.TemporaryDirectory(prefix="cotserve-faults-") as tmp:
        results = faults(tuple(chosen), tuple(kinds), stop_s, settle_s, max_new_tokens,
                         lambda line: console.print(line, style="dim", markup=False, highlight=False), Path(tmp))
    t = Table(title="faults under a steady mixed load (6 closed-loop clients, all SLA classes)")
    for col in ("target", "fault", "requests", "failed (codes)", "unexpected", "never answered", "serving again (s)",
                "KV blocks leaked", "leases leaked"):
        t.add_column(col, justify="right")
    for r in results:
        codes = ", ".join(f"{c} x{n}" for c, n in sorted(r.failed.items())) or "0"
        unexpected = ", ".join(f"{c} x{n}" for c, n in sorted(r.unexpected.items())) or "0"
        t.add_row(r.target, "SIGKILL" if r.mode == "kill" else f"SIGSTOP {stop_s:.0f}s", str(r.requests), codes, unexpected,
                  str(r.no_answer), "never" if r.recovery_s is None else f"{r.recovery_s:.1f}", str(r.kv_blocks_leaked),
                  str(r.leases_leaked) + (" (" + "; ".join(r.notes) + ")" if r.notes else ""))
    console.print(t)
    worker_back = [r.recovery_s for r in results if r.target == "worker" and r.mode == "kill"]
    console.print(f"goals: never answered = 0: {sum(r.no_answer for r in results) == 0}; unexpected failures = 0: "
                  f"{sum(sum(r.unexpected.values()) for r in results) == 0}; no leaks: "
                  f"{all(r.kv_blocks_leaked == 0 and r.leases_leaked <= 0 for r in results)}"
                  + (f"; killed worker serving again within 10 s: {worker_back[0] is not None and worker_back[0] <= 10} "
                     f"({worker_back[0]:.1f}s)" if worker_back and worker_back[0] is not None else ""))


def mount(root: typer.Typer, serve: typer.Typer) -> None:
    """These commands on the `cotserve` command line."""
    root.add_typer(bench_app, name="bench")
