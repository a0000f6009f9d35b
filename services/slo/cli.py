"""The SLO predictor's commands: `cotserve serve slo` (generated from `SloConfig`) and `cotserve slo record | train |
forecast`."""

from __future__ import annotations

import math
import time
from pathlib import Path

import typer

from cotserve.common.clitools import rpc_error_exit, wide_console
from cotserve.common.config import serve_service
from cotserve.common.tls import client_channel
from cotserve.slo.config import SloConfig

slo_app = typer.Typer(help="SLO predictor: record windows, train and evaluate offline, read forecasts.", no_args_is_help=True)


@slo_app.command("record")
def slo_record(
    out: Path = typer.Option(..., help="File to append the windows and request observations to."),
    address: str = typer.Option("127.0.0.1:50091", envvar="COTSERVE_SLO_ADDRESS", help="SLO predictor address."),
    duration_s: float = typer.Option(0.0, help="Keep recording new windows this long (0: write what the predictor holds now, then stop)."),
) -> None:
    """Write the windows a running stack reported to the SLO predictor to a file (for `cotserve slo train`)."""
    import grpc

    from cotserve.slo.history import export_all, write_records
    from cotserve.slo.v1 import slo_pb2, slo_pb2_grpc

    since, windows, requests = 0, 0, 0
    end = time.monotonic() + duration_s
    with client_channel(address) as ch:
        stub = slo_pb2_grpc.SloServiceStub(ch)
        while True:
            try:
                new_windows, new_requests, since = export_all(stub, since)
            except grpc.RpcError as err:
                rpc_error_exit(err)
            if new_windows or new_requests:
                write_records(out, [slo_pb2.ReportWindowsRequest(windows=new_windows, requests=new_requests)])
                windows, requests = windows + len(new_windows), requests + len(new_requests)
            if time.monotonic() >= end:
                break
            typer.echo(f"recorded {windows} windows, {requests} requests ...", err=True)
            time.sleep(min(5.0, max(0.0, end - time.monotonic())))
    typer.echo(f"wrote {windows} windows and {requests} request observations to {out}")


def _fmt(v: float, pct: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{100 * v:.1f}%" if pct else f"{v:.3f}"


def print_evaluation(ev, console) -> None:
    from rich.table import Table

    table = Table(title=f"Forecast of a target miss within the horizon, held-out stretch: {ev.test_samples} samples, "
                        f"{ev.test_positives} before a violation, {ev.onsets} violation onsets")
    for col in ("", "ROC-AUC", f"precision @ {ev.threshold}", f"recall @ {ev.threshold}", "median lead time"):
        table.add_column(col, justify="right")
    table.add_row("XGBoost forecast", _fmt(ev.auc), _fmt(ev.precision, True), _fmt(ev.recall, True),
                  "n/a" if math.isnan(ev.median_lead_s) else f"{ev.median_lead_s:.0f} s")
    table.add_row(f"baseline: queue depth >= {ev.baseline_threshold:g}", _fmt(ev.baseline_auc), _fmt(ev.baseline_precision, True),
                  _fmt(ev.baseline_recall, True), "n/a" if math.isnan(ev.baseline_median_lead_s) else f"{ev.baseline_median_lead_s:.0f} s")
    console.print(table)
    if ev.events is not None:
        events = Table(title="The same forecasts by episode: violation onsets, alarms (runs of seconds over the threshold)")
        for col in ("", "onsets", "forecast >= 10 s ahead", "median lead time", "false alarms", "false alarms / hour",
                    "time in alarm"):
            events.add_column(col, justify="right")
        for name, e in (("XGBoost forecast", ev.events), ("baseline", ev.baseline_events)):
            events.add_row(name, str(e.onsets), f"{e.forecast_ahead} ({_fmt(e.share_ahead, True)})",
                           "n/a" if math.isnan(e.median_lead_s) else f"{e.median_lead_s:.0f} s", str(e.false_alarms),
                           "n/a" if math.isnan(e.false_alarms_per_hour) else f"{e.false_alarms_per_hour:.1f}",
                           _fmt(e.alarm_share, True))
        console.print(events)
    console.print(f"latency predictions on {ev.latency_test_requests} held-out requests: TTFT MAPE {_fmt(ev.ttft_mape, True)}"
                  f" ({by_load_text(ev.ttft_mape_by_load)}), TPOT MAPE {_fmt(ev.tpot_mape, True)}")
    for note in ev.notes:
        console.print(f"note: {note}")


def by_load_text(by_load: list[tuple[str, int, float]]) -> str:
    """TTFT MAPE by load level (`slo.model.mape_by_load`) as one line: 'light (0-19 in flight): 27.0% of 6,512, ...'."""
    return ", ".join(f"{name}: {100 * m:.1f}% of {n:,}" for name, n, m in by_load) or "no load levels"


def print_episodes(results: list, title: str, console) -> None:
    """The forecast and the baseline by episode over one or more evaluations (`Evaluation` or `FoldedEvaluation`):
    onsets pooled with a Wilson interval on the share foreseen, the rest as a mean with its 95% interval."""
    from rich.table import Table

    from cotserve.common.stats import mean_pm as pm
    from cotserve.slo.model import pooled_events

    t = Table(title=title)
    for col in ("", "onsets", "foreseen >= 10 s ahead", "median lead s", "false alarms / h", "time in alarm", "ROC-AUC"):
        t.add_column(col, justify="right")
    for name, which, auc in (("XGBoost forecast", "events", "auc"), ("baseline: queue depth", "baseline_events", "baseline_auc")):
        onsets, ahead, share, lo, hi = pooled_events(results, which)
        t.add_row(name, str(onsets), f"{ahead} = {_fmt(share, True)} [{_fmt(lo, True)}, {_fmt(hi, True)}]",
                  pm([getattr(r, which).median_lead_s for r in results], "{:.1f}"),
                  pm([getattr(r, which).false_alarms_per_hour for r in results], "{:.0f}"),
                  pm([getattr(r, which).alarm_share for r in results], "{:.0f}%", 100), pm([getattr(r, auc) for r in results], "{:.3f}"))
    console.print(t)


def print_folded(folded: list, console) -> None:
    """Blocked cross-validations (`slo.model.evaluate_folds`) of one or more recordings."""
    n = len(folded)
    print_episodes(folded, f"Forecast by blocked cross-validation ({folded[0].folds} folds, every stretch held out once), "
                           f"{n} recording{'s' * (n > 1)}: onsets pooled (Wilson 95%), the rest mean"
                           + (" ± 95% interval" if n > 1 else ""), console)
    skipped = sum(f.folds - f.folds_trained for f in folded)
    if skipped:
        console.print(f"note: {skipped} fold(s) had too few violations in their training part to train, and are left out")


@slo_app.command("train")
def slo_train(
    data: Path = typer.Option(..., exists=True, dir_okay=False, help="File from `cotserve slo record` (or the service's history.bin)."),
    horizon_s: int = typer.Option(30, min=1, max=600, help="Seconds ahead the forecast covers."),
    threshold: float = typer.Option(0.7, min=0.0, max=1.0, help="Probability at which precision and recall are read."),
    train_fraction: float = typer.Option(0.7, min=0.1, max=0.95, help="Share of the time span to train on; the rest is held out."),
    out: Path = typer.Option(None, help="Save the fitted models here (XGBoost JSON; a service's STATE_DIR/models)."),
    folds: int = typer.Option(5, min=0, max=20, help="Also judge the forecast by blocked cross-validation over the whole "
                              "recording in this many folds (every onset held out once); 0: skip."),
) -> None:
    """Fit on the first part of the recording and print an evaluation on the later, held-out stretch."""
    from cotserve.slo.history import read_records
    from cotserve.slo.model import Untrained, evaluate, evaluate_folds

    if folds == 1:
        typer.echo("error: folds: 1, allowed 0 (skip) or 2..20", err=True)
        raise typer.Exit(2)
    try:
        windows, requests = read_records(data)
        ev, fc, lm = evaluate(windows, requests, horizon_s, train_fraction, threshold)
    except (ValueError, Untrained) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    console = wide_console()
    print_evaluation(ev, console)
    if folds >= 2:
        try:
            print_folded([evaluate_folds(windows, folds, horizon_s, threshold)], console)
        except Untrained as exc:  # the 70/30 evaluation stands; say why the folds could not be judged
            console.print(f"note: no blocked cross-validation: {exc}")
    if out is not None:
        fc.save(out)
        if lm.is_trained:
            lm.save(out)
        typer.echo(f"saved models to {out}")


@slo_app.command("forecast")
def slo_forecast(
    model: str = typer.Argument(..., help="Model name."),
    sla: str = typer.Option("interactive", help="SLA class: realtime, interactive or batch."),
    address: str = typer.Option("127.0.0.1:50091", envvar="COTSERVE_SLO_ADDRESS", help="SLO predictor address."),
) -> None:
    """Print the forecast for a model and class, and the features that pushed it most."""
    import grpc

    from cotserve.common.sampling import SLA_PB_BY_NAME
    from cotserve.slo.v1 import slo_pb2, slo_pb2_grpc

    cls = SLA_PB_BY_NAME.get(sla.lower())
    if cls is None:
        raise typer.BadParameter(f"want realtime, interactive or batch, got {sla!r}", param_hint="--sla")
    with client_channel(address) as ch:
        try:
            f = slo_pb2_grpc.SloServiceStub(ch).Forecast(slo_pb2.ForecastRequest(model=model, sla_class=cls), timeout=10)
        except grpc.RpcError as err:
            rpc_error_exit(err)
    if not f.is_trained:
        typer.echo(f"untrained: {f.untrained_reason}")
        return
    typer.echo(f"{model} {sla}: P(miss within {f.horizon_ms / 1000:g} s) = {f.violation_probability:.3f} (acts above {f.threshold:g})")
    for c in f.top_features:
        typer.echo(f"  {c.feature:28s} {c.contribution:+.3f}")


def mount(root: typer.Typer, serve: typer.Typer) -> None:
    """The SLO predictor's commands on the `cotserve` command line."""
    serve_service(serve, "slo", SloConfig, "Start the SLO predictor: XGBoost violation forecasts, latency predictions, "
                  "scale advice.")
    root.add_typer(slo_app, name="slo")
