"""The telemetry service's commands: `cotserve serve telemetry` (generated from `TelemetryConfig`), `cotserve heatmap`
and `cotserve trace check` (read the telemetry service)."""

from __future__ import annotations

from pathlib import Path

import typer

from cotserve.common.clitools import rpc_error_exit, run_loop, wide_console
from cotserve.common.config import serve_service
from cotserve.common.tls import client_channel
from cotserve.telemetry.config import TelemetryConfig

trace_app = typer.Typer(help="Traces: check that every hop arrives, correctly parented.", no_args_is_help=True)


def heatmap_command(
    address: str = typer.Option("127.0.0.1:4317", envvar="COTSERVE_TELEMETRY_ADDRESS", help="Telemetry service address."),
    metric: str = typer.Option("ttft", help="e2e, ttft, tpot (time per output token) or queue."),
    sla: str = typer.Option("all", help="Only this SLA class: all, realtime, interactive or batch."),
    tenant: str = typer.Option("", help="Only this tenant (empty: all)."),
    window_s: float = typer.Option(0.0, help="Only the last N seconds (0: the whole retention)."),
    model_version: str = typer.Option("", help="Only this model version, name@revision (empty: all)."),
    out: Path = typer.Option(None, help="Write the heatmap to FILE.png (matplotlib) or FILE.html (self-contained page)."),
) -> None:
    """Print the model-version x KV-occupancy matrix of one latency metric; optionally render both views to a file."""
    import grpc

    from cotserve.telemetry.page import heatmap_json, heatmap_request, page_html
    from cotserve.telemetry.v1 import telemetry_pb2_grpc

    if out is not None and out.suffix.lower() not in (".png", ".html"):
        raise typer.BadParameter(f"want a .png or .html file, got {out.name!r}", param_hint="--out")
    try:
        req = heatmap_request(metric, "" if sla == "all" else sla, tenant, window_s, model_version)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    with client_channel(address) as ch:
        try:
            resp = telemetry_pb2_grpc.TelemetryServiceStub(ch).GetHeatmap(req, timeout=10)
        except grpc.RpcError as err:
            rpc_error_exit(err)
    data = heatmap_json(resp, {"sla": "" if sla == "all" else sla, "tenant": tenant, "window_s": window_s})
    from rich.table import Table

    table = Table(title=f"{data['title']} (ms): P50 / P95 / P99, count, by model version x KV occupancy at admission")
    table.add_column("model version")
    for k in (0, 25, 50, 75):
        table.add_column(f"{k}-{k + 25} %", justify="right")
    for version in sorted({c["model_version"] for c in data["cells"]}):
        row = []
        for k in (0, 25, 50, 75):
            c = next((c for c in data["cells"] if c["model_version"] == version and c["kv_pct"] == k), None)
            row.append("-" if c is None else f"{c['p50']:.1f} / {c['p95']:.1f} / {c['p99']:.1f}  n={c['count']}")
        table.add_row(version, *row)
    wide_console().print(table)
    if out is not None:
        if out.suffix.lower() == ".html":
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(page_html(data))
        else:
            from cotserve.telemetry.render import render_png

            render_png(data, out)
        typer.echo(f"wrote {out}")


@trace_app.command("check")
def trace_check(
    address: str = typer.Option("127.0.0.1:50051", envvar="COTSERVE_ADDRESS", help="Gateway address."),
    telemetry: str = typer.Option("127.0.0.1:4317", envvar="COTSERVE_TELEMETRY_ADDRESS", help="Telemetry service the stack exports to."),
    n: int = typer.Option(100, min=1, help="Requests to send."),
    concurrency: int = typer.Option(4, min=1, help="Requests in flight at once."),
    max_new_tokens: int = typer.Option(32, min=1, help="Tokens per request at most."),
    post_processor: str = typer.Option("", help="Also run this sandbox module (e.g. strip-think) and expect its span."),
    wait_s: float = typer.Option(20.0, help="Seconds to wait for late spans after the last request."),
) -> None:
    """Send N requests under trace ids of our own; report the share of traces that arrived complete and correctly parented."""
    from cotserve.telemetry.tracecheck import check_traces

    try:
        verdicts = run_loop(check_traces(address, telemetry, n, concurrency, max_new_tokens=max_new_tokens,
                                            post_processor=post_processor, wait_s=wait_s,
                                            progress=lambda msg: typer.echo(msg, err=True)))
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    complete = sum(v.complete for v in verdicts)
    typer.echo(f"complete and correctly parented: {complete}/{len(verdicts)} = {100 * complete / len(verdicts):.1f}%")
    for v in [v for v in verdicts if not v.complete][:5]:
        typer.echo(f"  trace {v.trace_id.hex()}: {'; '.join(v.problems)}")
    if complete != len(verdicts):
        raise typer.Exit(1)


def mount(root: typer.Typer, serve: typer.Typer) -> None:
    """The telemetry service's commands on the `cotserve` command line."""
    serve_service(serve, "telemetry", TelemetryConfig, "Start the telemetry service: OTLP trace receiver, latency "
                  "heatmaps, recent traces.")
    root.add_typer(trace_app, name="trace")
    root.command("heatmap")(heatmap_command)
