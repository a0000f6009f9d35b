"""`cotserve bench slo-routing`: routing by the SLO predictor's TTFT predictions against least-loaded routing.

1. Starts three workers of the same model, one of them slowed (`--max-num-seqs 4`: a quarter of a batch, so
   requests queue there), the SLO predictor, and a gateway routing by its load heuristic (least loaded: fewest
   waiting, then fewest in flight, then most free KV blocks).
2. Drives steady open-loop INTERACTIVE, REALTIME and BATCH traffic for `train_s` so the predictor records request
   observations on all three workers, and trains the latency model on them (held-out MAPE by load level).
3. Replays the same load (the next seed) for `eval_s` through a gateway routing by the heuristic and then through
   one routing by predicted TTFT, and compares each class's TTFT percentiles.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path

from cotserve.bench.isolation import RequestRecord, _one
from cotserve.bench.slo import LoadResult
from cotserve.bench.throughput import prompt_of_tokens
from cotserve.common.sampling import SlaClass
from cotserve.common.stats import percentile
from cotserve.sdk import AsyncClient

NEW_TOKENS = {SlaClass.REALTIME: 16, SlaClass.INTERACTIVE: 32, SlaClass.BATCH: 64}
SHARE = {SlaClass.REALTIME: 0.1, SlaClass.INTERACTIVE: 0.6, SlaClass.BATCH: 0.3}  # of the arrivals
SLOW_MAX_NUM_SEQS = 4


async def drive(address: str, seconds: float, rate: float, prompts: list[str], seed: int) -> LoadResult:
    """Poisson arrivals at `rate` requests/s, classes drawn by `SHARE`, prompts of mixed lengths."""
    rng = random.Random(seed)
    run = LoadResult(seconds)
    tasks = []
    classes, weights = list(SHARE), list(SHARE.values())
    async with AsyncClient(address) as client:
        start = next_at = time.perf_counter()
        while next_at < start + seconds:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            cls = rng.choices(classes, weights)[0]
            rec = RequestRecord()
            run.records.append((cls, rec))
            tasks.append(asyncio.create_task(_one(client, rng.choice(prompts), cls.name.lower(), NEW_TOKENS[cls], rec)))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return run


def run(model: Path | None, train_s: float, eval_s: float, load: float, seed: int, progress) -> dict:
    from cotserve.bench.slo import CAPACITY_CONCURRENCY, capacity, predictor_child
    from cotserve.common.procs import Child, free_port, grpc_ready, python_cli, running

    state = Path(tempfile.mkdtemp(prefix="cotserve-bench-slo-routing-"))
    model_args = ["--model", str(model)] if model else []
    workers = []
    for i in range(3):
        addr = f"127.0.0.1:{free_port()}"
        slow = ["--max-num-seqs", str(SLOW_MAX_NUM_SEQS)] if i == 0 else []
        workers.append(Child(f"worker{i}", addr, python_cli("serve", "worker", "--port", addr.rsplit(":", 1)[1], *model_args,
                                                            *slow), grpc_ready(addr)))
    slo_addr = f"127.0.0.1:{free_port()}"

    slo_child = lambda: predictor_child(slo_addr, state)  # noqa: E731

    def gateway_child(routing: bool) -> Child:
        addr = f"127.0.0.1:{free_port()}"
        worker_args = [a for w in workers for a in ("--worker", w.address)]
        return Child("gateway", addr, python_cli("serve", "gateway", "--port", addr.rsplit(":", 1)[1], *worker_args,
                                                 "--slo", slo_addr, "--no-slo-admission",
                                                 "--slo-routing" if routing else "--no-slo-routing"), grpc_ready(addr))

    out: dict = {"workers": [w.address for w in workers], "slow": workers[0].address, "runs": {}}
    with running(workers):
        with running([slo_child(), gateway_child(routing=False)]) as (_, gw):
            prompts = asyncio.run(_prompts(gw.address))
            out["capacity_rps"] = asyncio.run(capacity(gw.address, prompts[:1], concurrency=3 * CAPACITY_CONCURRENCY))
            rate = out["rate_rps"] = load * out["capacity_rps"]
            progress(f"capacity of the three: {out['capacity_rps']:.1f} INTERACTIVE-sized requests/s; recording {train_s:.0f} s at {rate:.0f} requests/s, least-loaded routing, for the latency model ...")
            out["recorded"] = asyncio.run(drive(gw.address, train_s, rate, prompts, seed))
            time.sleep(2.5)  # the last observations reach the predictor
            if not train_latency(slo_addr, state, out):
                return out
        with running([slo_child()]):  # loads the models just saved
            for name, routing in (("least loaded", False), ("predicted TTFT", True)):
                with running([gateway_child(routing)]) as (gw,):
                    time.sleep(2)  # the first Stats polls and windows
                    progress(f"{eval_s:.0f} s at {rate:.0f} requests/s, routing: {name} ...")
                    out["runs"][name] = asyncio.run(drive(gw.address, eval_s, rate, prompts, seed + 1))
    return out


async def _prompts(address: str) -> list[str]:
    async with AsyncClient(address) as client:
        return [await prompt_of_tokens(client, n) for n in (16, 48, 128)]


def train_latency(slo_addr: str, state: Path, out: dict, train_fraction: float = 0.7) -> bool:
    """Fit the latency model on the first 70% of the recorded requests, its TTFT MAPE (overall and by load level) on
    the rest into `out`, then refit on all of them and save it under `state`; False (and why) when it cannot."""
    import grpc
    import numpy as np

    from cotserve.slo.history import export_all
    from cotserve.slo.model import LatencyModel, Untrained, held_out_latency, latency_data
    from cotserve.slo.v1 import slo_pb2_grpc

    with grpc.insecure_channel(slo_addr) as ch:
        windows, requests, _ = export_all(slo_pb2_grpc.SloServiceStub(ch))
    X, log_ttft, log_tpot, t = latency_data(windows, requests)
    out["observations"] = len(X)
    try:
        _, held = held_out_latency(X, log_ttft, log_tpot, t, np.quantile(t, train_fraction) if len(t) else 0)
        out["ttft_mape"], out["ttft_mape_by_load"] = held.ttft_mape, held.by_load
        lm = LatencyModel()
        lm.fit(X, log_ttft, log_tpot)
    except Untrained as exc:
        out["untrained"] = str(exc)
        return False
    lm.save(state / "models")
    return True


def print_report(out: dict, console) -> bool:
    """The two routings side by side per class, and the goals (p90 TTFT >= 30% better, no class worse)."""
    from rich.table import Table

    if "untrained" in out:
        console.print(f"[red]the latency model could not be trained:[/red] {out['untrained']}")
        return False
    console.print(f"latency model: {out['observations']} request observations; held-out TTFT MAPE "
                  f"{100 * out['ttft_mape']:.1f}% (" + ", ".join(f"{name}: {100 * m:.1f}% of {n}" for name, n, m in
                                                             out["ttft_mape_by_load"]) + ")")
    base, pred = out["runs"]["least loaded"], out["runs"]["predicted TTFT"]
    t = Table(title=f"Three workers (one at --max-num-seqs {SLOW_MAX_NUM_SEQS}), {out['rate_rps']:.1f} requests/s: TTFT ms, "
                    "least loaded vs predicted TTFT")
    for col in ("class", "requests", "p50", "p90", "p99", "failed", "p90 better by"):
        t.add_column(col, justify="right")
    goals = []
    for cls in SlaClass:
        b90, p90 = base.ttft(cls, 90), pred.ttft(cls, 90)
        for name, run in (("least loaded", base), ("predicted TTFT", pred)):
            t.add_row(f"{cls.name} {name}", str(len(run.of(cls))), f"{run.ttft(cls, 50):.0f}",
                      f"{run.ttft(cls, 90):.0f}", f"{run.ttft(cls, 99):.0f}", str(run.failed(cls)),
                      f"{100 * (1 - p90 / b90):.0f}%" if name == "predicted TTFT" and b90 else "")
        goals.append((p90 <= b90, f"{cls.name}: p90 TTFT {p90:.0f} ms with predictions vs {b90:.0f} least loaded (no worse)"))
    console.print(t)
    everything = lambda run: percentile([r.ttft_ms for _, r in run.records if r.ttft_ms is not None], 90)  # noqa: E731
    b_all, p_all = everything(base), everything(pred)
    gain = 1 - p_all / b_all
    goals.insert(0, (p_all <= 0.7 * b_all, f"all classes: p90 TTFT {p_all:.0f} ms vs {b_all:.0f} ms, "
                                            f"{100 * abs(gain):.0f}% {'better' if gain >= 0 else 'worse'} (goal >= 30% better)"))
    for ok, text in goals:
        console.print(f"{'[green]met[/green]' if ok else '[red]NOT met[/red]'}: {text}")
    return True
