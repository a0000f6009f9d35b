"""`cotserve bench slo-routing`: routing by the SLO predictor's TTFT predictions against least-loaded routing.

1. Starts three workers of the same model, one of them slowed, the SLO predictor, and a gateway routing by its
   load heuristic (least loaded: fewest waiting, then fewest of its own requests in flight, then most free KV
   blocks). The slowed worker either serves a background flood that does not pass through this gateway
   (`flood`, the default: `FLOOD_STREAMS` streams of long generations sent straight to the worker, as another
   gateway's or a batch job's traffic would be; they run in the worker's batch, not its waiting queue, so the
   heuristic sees only fewer free blocks) or runs a quarter of a batch (`max-seqs`: `--max-num-seqs 4`, so
   requests queue there, which the heuristic sees in the worker's waiting count).
2. Drives steady open-loop INTERACTIVE, REALTIME and BATCH traffic for `train_s` so the predictor records request
   observations on all three workers, and trains the latency model on them (held-out MAPE by load level).
3. Replays the same load's shape (seed + 1 + round) for `eval_s` through a gateway routing by the heuristic and
   through one routing by predicted TTFT, in `rounds` rounds of alternating order (A B, B A, ...: this shared VM's
   speed drifts over minutes, and one pair of runs has differed by tens of percent either way), and compares each
   class's TTFT percentiles over the rounds pooled, with each round's figure beside them.
4. Splits each routing's requests by the worker that served them, with their TTFT as the gateway timed it (the
   predictor's observations): where each routing sent the load, what each worker gave it, and how much of the
   client's p90 lies outside the workers (the load generator shares these cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
import time
from pathlib import Path

from cotserve.bench.isolation import RequestRecord, _one
from cotserve.bench.slo import LoadResult, recorded
from cotserve.bench.throughput import prompt_of_tokens
from cotserve.common.clitools import run_loop
from cotserve.common.sampling import SlaClass
from cotserve.common.stats import percentile
from cotserve.sdk import AsyncClient

NEW_TOKENS = {SlaClass.REALTIME: 16, SlaClass.INTERACTIVE: 32, SlaClass.BATCH: 64}
SHARE = {SlaClass.REALTIME: 0.1, SlaClass.INTERACTIVE: 0.6, SlaClass.BATCH: 0.3}  # of the arrivals
SLOW_MAX_NUM_SEQS = 4
FLOOD_STREAMS, FLOOD_PROMPT_TOKENS, FLOOD_NEW_TOKENS = 16, 64, 128
SLOWED = ("flood", "max-seqs")


def flood(worker: str, streams: int, prompt_ids: list[int], stop, served) -> None:
    """`streams` closed-loop greedy generations sent straight to `worker` until `stop` (a multiprocessing Event) is
    set; the tokens they got are added to `served` (a multiprocessing Value). Run in a process of its own, so its
    gRPC work does not share the measuring client's interpreter."""
    import grpc

    from cotserve.common.v1 import common_pb2
    from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

    async def one_stream(stub) -> None:
        while not stop.is_set():
            req = worker_pb2.GenerateRequest(prompt_token_ids=prompt_ids, sampling=common_pb2.SamplingParams(
                max_new_tokens=FLOOD_NEW_TOKENS, ignore_eos=True))
            try:
                async for chunk in stub.Generate(req, timeout=120):
                    with served.get_lock():
                        served.value += len(chunk.token_ids)
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)

    async def main() -> None:
        async with grpc.aio.insecure_channel(worker) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            await asyncio.gather(*(one_stream(stub) for _ in range(streams)))

    run_loop(main())


async def drive(address: str, seconds: float, rate: float, prompts: list[str], seed: int,
                multiplex: bool = True) -> LoadResult:
    """Poisson arrivals at `rate` requests/s, classes drawn by `SHARE`, prompts of mixed lengths; each a stream of
    one Session call (`multiplex`) or a call of its own."""
    rng = random.Random(seed)
    run = LoadResult(seconds)
    tasks = []
    classes, weights = list(SHARE), list(SHARE.values())
    async with AsyncClient(address, multiplex=multiplex) as client:
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


def run(model: Path | None, train_s: float, eval_s: float, load: float, seed: int, progress, slowed: str = "flood",
        rounds: int = 2, session: bool = True) -> dict:
    from cotserve.bench.slo import ADMISSION_VARIANTS, CAPACITY_CONCURRENCY, capacity, predictor_child
    from cotserve.common.procs import Child, free_port, grpc_ready, python_cli
    from cotserve.bench.warm import running

    if slowed not in SLOWED:
        raise ValueError(f"slowed: {slowed!r}, must be one of {', '.join(SLOWED)}")
    state = Path(tempfile.mkdtemp(prefix="cotserve-bench-slo-routing-"))
    model_args = ["--model", str(model)] if model else []
    workers = []
    for i in range(3):
        addr = f"127.0.0.1:{free_port()}"
        slow = ["--max-num-seqs", str(SLOW_MAX_NUM_SEQS)] if i == 0 and slowed == "max-seqs" else []
        workers.append(Child(f"worker{i}", addr, python_cli("serve", "worker", "--port", addr.rsplit(":", 1)[1], *model_args,
                                                            *slow), grpc_ready(addr)))
    slo_addr = f"127.0.0.1:{free_port()}"

    slo_child = lambda: predictor_child(slo_addr, state)  # noqa: E731

    metrics_port = free_port()

    def gateway_child(routing: bool) -> Child:
        addr = f"127.0.0.1:{free_port()}"
        worker_args = [a for w in workers for a in ("--worker", w.address)]
        return Child("gateway", addr, python_cli("serve", "gateway", "--port", addr.rsplit(":", 1)[1], *worker_args,
                                                 "--slo", slo_addr, "--metrics-port", str(metrics_port),
                                                 *ADMISSION_VARIANTS["off"],  # routing alone, no admission rule
                                                 "--slo-routing" if routing else "--no-slo-routing"), grpc_ready(addr))

    out: dict = {"workers": [w.address for w in workers], "slow": workers[0].address, "slowed": slowed, "runs": {}}
    with running(workers), contextlib.closing(_Flood(workers[0].address if slowed == "flood" else None, progress)) as flooded:
        with running([slo_child(), gateway_child(routing=False)]) as (_, gw):
            prompts, flood_ids = run_loop(_prompts(gw.address))
            flooded.start(flood_ids)
            # unary, as every recorded run of this bench measured it: its `--load` is a share of that figure, which
            # is higher than what the stack serves the load's streams (1.5x on bench slo's one worker)
            out["capacity_rps"] = run_loop(capacity(gw.address, prompts[:1], concurrency=3 * CAPACITY_CONCURRENCY,
                                                    streamed=False))
            rate = out["rate_rps"] = load * out["capacity_rps"]
            progress(f"capacity of the three: {out['capacity_rps']:.1f} INTERACTIVE-sized requests/s; recording {train_s:.0f} s at {rate:.0f} requests/s, least-loaded routing, for the latency model ...")
            out["recorded"] = run_loop(drive(gw.address, train_s, rate, prompts, seed, session))
            time.sleep(2.5)  # the last observations reach the predictor
            if not train_latency(slo_addr, state, out):
                return out
        with running([slo_child()]):  # loads the models just saved
            for r in range(rounds):
                for name, routing in ROUTINGS if r % 2 == 0 else ROUTINGS[::-1]:  # A B, B A: a drift falls on both
                    with running([gateway_child(routing)]) as (gw,):
                        time.sleep(2)  # the first Stats polls and windows
                        progress(f"round {r + 1} of {rounds}: {eval_s:.0f} s at {rate:.0f} requests/s, routing: {name} ...")
                        flooded.mark()
                        began = time.time()
                        result = run_loop(drive(gw.address, eval_s, rate, prompts, seed + 1 + r, session))
                        out.setdefault("spans", {}).setdefault(name, []).append((began * 1000, time.time() * 1000))
                        _pool(out, r, name, result, flooded.rate(), routed_by(metrics_port))
                        time.sleep(2.5)  # its last observations reach the predictor before it stops
            out["by_worker"] = by_worker(recorded(slo_addr)[1], out["spans"], out["workers"])
    return out


def by_worker(requests, spans: dict[str, list[tuple[float, float]]], workers: list[str]) -> dict[str, list[tuple]]:
    """Per routing, each worker's share of the requests started in that routing's replays and their TTFT p50 and p90
    as the gateway timed them (the predictor's request observations): where the requests went and what each worker
    gave them, before the client's own share of the latency (its process shares these cores)."""
    out = {}
    for name, windows in spans.items():
        mine = [r for r in requests if any(a <= r.start_unix_ms < b for a, b in windows)]
        rows = []
        for i, w in enumerate(workers):
            ttft = [r.ttft_ms for r in mine if r.worker == w]
            rows.append((f"worker {i}" + (" (slowed)" if i == 0 else ""), len(ttft), len(ttft) / max(1, len(mine)),
                         percentile(ttft, 50, empty=0.0), percentile(ttft, 90, empty=0.0)))
        out[name] = rows
    return out


ROUTINGS = (("least loaded", False), ("predicted TTFT", True))


def _pool(out: dict, r: int, name: str, result: LoadResult, flood_tok_s: float, routed: dict[str, int]) -> None:
    """One routing's run of round `r` into `out`: kept by round, pooled over rounds (records, seconds, picks, the
    flood's tok/s averaged over its rounds)."""
    out.setdefault("rounds", []).extend({} for _ in range(r + 1 - len(out.get("rounds", []))))
    out["rounds"][r][name] = result
    pooled = out["runs"].setdefault(name, LoadResult(0.0))
    pooled.seconds += result.seconds
    pooled.records += result.records
    picks = out.setdefault("routed_by", {}).setdefault(name, {})
    for by, n in routed.items():
        picks[by] = picks.get(by, 0) + n
    flood = out.setdefault("flood_tok_s", {})
    flood[name] = flood.get(name, 0.0) + (flood_tok_s - flood.get(name, 0.0)) / (r + 1)


def routed_by(metrics_port: int) -> dict[str, int]:
    """The gateway's worker picks by what decided them (`cotserve_gateway_routed_total`), from its /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "cotserve_gateway_routed_total":
                counts[sample.labels["by"]] = counts.get(sample.labels["by"], 0) + int(sample.value)
    return counts


class _Flood:
    """The background flood's process (nothing when `worker` is None) and the tokens it was served."""

    def __init__(self, worker: str | None, progress) -> None:
        import multiprocessing

        self.worker, self.progress = worker, progress
        ctx = multiprocessing.get_context("spawn")
        self.stop, self.served, self.ctx = ctx.Event(), ctx.Value("q", 0), ctx
        self.proc = None
        self.since = (0, time.perf_counter())

    def start(self, prompt_ids: list[int]) -> None:
        if self.worker is None:
            return
        self.progress(f"flooding {self.worker} with {FLOOD_STREAMS} streams of {FLOOD_PROMPT_TOKENS} + {FLOOD_NEW_TOKENS} "
                      "tokens sent straight to it (not through the gateway) ...")
        self.proc = self.ctx.Process(target=flood, args=(self.worker, FLOOD_STREAMS, prompt_ids, self.stop, self.served),
                                     daemon=True)
        self.proc.start()

    def mark(self) -> None:
        self.since = (self.served.value, time.perf_counter())

    def rate(self) -> float:
        """Tokens per second the flood was served since `mark`."""
        tokens, at = self.since
        return (self.served.value - tokens) / max(1e-9, time.perf_counter() - at)

    def close(self) -> None:
        if self.proc is not None:
            self.stop.set()
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


async def _prompts(address: str) -> tuple[list[str], list[int]]:
    """The load's prompts (16, 48 and 128 tokens) and the flood's prompt as token ids."""
    async with AsyncClient(address) as client:
        prompts = [await prompt_of_tokens(client, n) for n in (16, 48, 128)]
        return prompts, list(await client.tokenize(await prompt_of_tokens(client, FLOOD_PROMPT_TOKENS)))


def train_latency(slo_addr: str, state: Path, out: dict, train_fraction: float = 0.7) -> bool:
    """Fit the latency model on the first 70% of the recorded requests, its TTFT MAPE (overall and by load level) on
    the rest into `out`, then refit on all of them and save it under `state`; False (and why) when it cannot."""
    import numpy as np

    from cotserve.slo.model import LatencyModel, Untrained, held_out_latency, latency_data

    windows, requests = recorded(slo_addr)
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

    from cotserve.slo.cli import by_load_text

    if "untrained" in out:
        console.print(f"[red]the latency model could not be trained:[/red] {out['untrained']}")
        return False
    console.print(f"latency model: {out['observations']} request observations; held-out TTFT MAPE "
                  f"{100 * out['ttft_mape']:.1f}% ({by_load_text(out['ttft_mape_by_load'])})")
    base, pred = out["runs"]["least loaded"], out["runs"]["predicted TTFT"]
    slow = (f"one flooded by {FLOOD_STREAMS} streams not through the gateway" if out["slowed"] == "flood"
            else f"one at --max-num-seqs {SLOW_MAX_NUM_SEQS}")
    t = Table(title=f"Three workers ({slow}), {out['rate_rps']:.1f} requests/s: TTFT ms, least loaded vs predicted TTFT")
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
    for name, counts in out.get("routed_by", {}).items():
        console.print(f"{name}: worker picks by predicted TTFT {counts.get('predicted_ttft', 0):,}, by the load heuristic "
                      f"{counts.get('load', 0):,}")
    if out.get("flood_tok_s"):
        console.print("the flood was served " + ", ".join(f"{v:,.0f} tok/s under {k}" for k, v in out["flood_tok_s"].items()))
    everything = lambda run: percentile([r.ttft_ms for _, r in run.records if r.ttft_ms is not None], 90)  # noqa: E731
    b_all, p_all = everything(base), everything(pred)
    gain = 1 - p_all / b_all
    goals.insert(0, (p_all <= 0.7 * b_all, f"all classes: p90 TTFT {p_all:.0f} ms vs {b_all:.0f} ms, "
                                            f"{100 * abs(gain):.0f}% {'better' if gain >= 0 else 'worse'} (goal >= 30% better)"))
    for r, runs in enumerate(out.get("rounds", [])):
        b, p = everything(runs["least loaded"]), everything(runs["predicted TTFT"])
        console.print(f"round {r + 1}: all classes p90 TTFT {p:.0f} ms with predictions vs {b:.0f} ms least loaded "
                      f"({100 * abs(1 - p / b):.0f}% {'better' if p <= b else 'worse'})")
    if out.get("by_worker"):
        console.print(_worker_table(out["by_worker"], {name: everything(run) for name, run in out["runs"].items()}))
    for ok, text in goals:
        console.print(f"{'[green]met[/green]' if ok else '[red]NOT met[/red]'}: {text}")
    return True


def _worker_table(rows: dict[str, list[tuple]], client_p90: dict[str, float]):
    from rich.table import Table

    t = Table(title="Where the requests went: TTFT ms at the gateway by worker (its observations), against the "
                    "client's p90 over all classes")
    for col in ("routing", "worker", "requests", "share", "p50", "p90", "client p90"):
        t.add_column(col, justify="right")
    for name, workers in rows.items():
        for k, (label, n, share, p50, p90) in enumerate(workers):
            t.add_row(name if k == 0 else "", label, f"{n:,}", f"{100 * share:.0f}%", f"{p50:.0f}", f"{p90:.0f}",
                      f"{client_p90.get(name, 0.0):.0f}" if k == 0 else "")
    return t
