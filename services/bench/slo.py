"""`cotserve bench slo`: does the SLO predictor see violations coming, and does acting on it help?

1. Starts a worker (the demo model unless told otherwise), the SLO predictor and a gateway that
   reports to it (no intervention yet), and measures the stack's capacity (requests/s, closed loop).
2. Drives a time-varying open-loop load for `duration_s` (`FULL` or `QUICK` sets the lengths): cycles (30 s;
   `--cycle-s`) of a steady stretch, a ramp of INTERACTIVE and BATCH traffic together past capacity, a burst, a
   drain and, every third cycle, a long-prompt surge instead of the burst (see `rates`). The gateway reports its
   windows.
3. Trains on the first 70% of the time and evaluates on the rest (`slo.model.evaluate`): ROC-AUC,
   precision and recall at the threshold, median lead time, against the queue-depth baseline, and
   the TTFT/TPOT prediction MAPE; and judges the forecast by blocked cross-validation over the whole recording
   (`slo.model.evaluate_folds`: each fifth held out in turn), which holds out every violation onset once.
4. Replays the same bursty load (the next seed) against the trained predictor under each admission variant
   (`ADMISSION_VARIANTS`: off, off again for the run-to-run gap, the load without BATCH, all-or-nothing,
   proportional, pause, shed, shed and pause), and reports INTERACTIVE's target-miss rate and p99 TTFT, the output
   tokens served and BATCH's TTFT (the gateway holds BATCH arrivals, pauses running BATCH on the worker, or turns
   away INTERACTIVE predicted to miss; a BATCH request it turns away, when its hold is full, is
   retried after its `retry-after-ms` with jitter, as a client would, until 60 s after the load ends).
5. Does all of it for several seeds (`--seeds`): the figures come with 95% intervals over seeds, and violation
   onsets, the forecast's unit, are pooled over seeds with a Wilson interval on the share foreseen.
6. Bounds what any rule could do on each seed's replay (`miss_floor`): the report says where an 80% cut of off's
   misses was out of every rule's reach.
"""

from __future__ import annotations

import asyncio
import math
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from cotserve.bench.isolation import RequestRecord, _one
from cotserve.bench.throughput import prompt_of_tokens
from cotserve.common.clitools import run_loop
from cotserve.common.stats import percentile
from cotserve.common.sampling import SlaClass
from cotserve.common.sla import DEFAULT_SLA_TARGETS
from cotserve.sdk import AsyncClient, CotserveError, ResourceExhausted

CYCLE_S = 60
INTERACTIVE_NEW_TOKENS = 32
BATCH_NEW_TOKENS = 64


BURST = 1.5  # INTERACTIVE's rate in a burst, as a multiple of the measured capacity (`--burst`)


def rates(t: float, capacity: float, cycle_s: float = CYCLE_S, burst: float = BURST) -> tuple[float, float, bool]:
    """(INTERACTIVE req/s, BATCH req/s, long prompts?) at second t of the load. `capacity` is in
    INTERACTIVE-sized requests (32 new tokens) per second; a BATCH request (64) costs about two.
    Each cycle of `cycle_s` seconds: a steady third, a ramp third (INTERACTIVE up to 0.8 of capacity, or `burst` if
    lower), a burst for the next 13% (INTERACTIVE at `burst` x capacity, BATCH at 0.3 x on top; the second cycle of
    every three a long-prompt surge instead, so a three-cycle recording's first 70%, its training stretch, has seen
    one), then a drain; shorter cycles give more violation onsets (the forecast's unit of evaluation) per second.

    The capacity is measured closed loop (a full batch always waiting) with streamed requests, as the load sends them
    (`capacity`). The default burst, 1.5 x that capacity, puts INTERACTIVE over its own capacity for the burst's
    seconds with a queue of seconds behind it: below about 1.3 the gateway's admission (BATCH queued behind
    INTERACTIVE) leaves INTERACTIVE no miss to forecast or to prevent."""
    cycle, phase = int(t // cycle_s), (t % cycle_s) / cycle_s
    surge = cycle % 3 == 1
    if phase < 1 / 3:
        return 0.3 * capacity, 0.1 * capacity, False
    if phase < 2 / 3:
        f = (phase - 1 / 3) * 3
        return (0.3 + (min(0.8, burst) - 0.3) * f) * capacity, (0.1 + 0.2 * f) * capacity, False
    if phase < 0.8:
        return (0.4 * capacity, 0.3 * capacity, True) if surge else (burst * capacity, 0.3 * capacity, False)
    return 0.1 * capacity, 0.05 * capacity, False


@dataclass
class LoadResult:
    seconds: float
    records: list[tuple[SlaClass, RequestRecord]] = field(default_factory=list)

    def of(self, cls: SlaClass) -> list[RequestRecord]:
        return [r for c, r in self.records if c == cls]

    def miss_rate(self, cls: SlaClass) -> float:
        recs = self.of(cls)
        return sum(r.missed(DEFAULT_SLA_TARGETS[cls]) for r in recs) / len(recs) if recs else math.nan

    def miss_causes(self, cls: SlaClass) -> dict[str, int]:
        """The class's misses by cause: failed (by status code), TTFT over the target, inter-token p95 over the
        target (only)."""
        target, out = DEFAULT_SLA_TARGETS[cls], {"ttft": 0, "inter-token": 0}
        for r in self.of(cls):
            if r.error is not None or r.ttft_ms is None:
                out[f"failed {r.error}"] = out.get(f"failed {r.error}", 0) + 1
            elif r.ttft_ms > target.ttft_ms:
                out["ttft"] += 1
            elif r.missed(target):
                out["inter-token"] += 1
        return out

    def ttft(self, cls: SlaClass, q: float) -> float:
        """The class's `q`th percentile TTFT (ms) of the requests that got a first token (NaN: none did)."""
        return percentile([r.ttft_ms for r in self.of(cls) if r.ttft_ms is not None], q)

    def failed(self, cls: SlaClass) -> int:
        return sum(r.error is not None for r in self.of(cls))

    @property
    def tokens(self) -> int:
        return sum(r.tokens for _, r in self.records)

    @property
    def served_share(self) -> float:
        """Output tokens served over those asked for (every request asks for its class's fixed count, EOS ignored):
        comparable between replays whose loads were scaled to different capacities."""
        asked = sum(BATCH_NEW_TOKENS if c == SlaClass.BATCH else INTERACTIVE_NEW_TOKENS for c, _ in self.records)
        return self.tokens / asked if asked else math.nan

    deferrals: int = 0

    def shed(self, cls: SlaClass) -> int:
        return sum(r.error == "RESOURCE_EXHAUSTED" for r in self.of(cls))


async def _batch(client: AsyncClient, prompt: str, rec: RequestRecord, result: LoadResult, give_up_at: float) -> None:
    """A BATCH request as a well-behaved client sends it: deferred (RESOURCE_EXHAUSTED), it waits
    the `retry-after-ms` the gateway sent (with jitter) and tries again, until `give_up_at`: a retry that would
    come after it is not made (a full queue's retry-after can be minutes: waiting it out held a replay's end 20
    minutes past its last arrival)."""
    start = time.perf_counter()
    while True:
        retry_after_ms = None
        try:
            async for chunk in client.stream(prompt, max_new_tokens=BATCH_NEW_TOKENS, ignore_eos=True, sla="batch", timeout_s=120):
                rec.tokens += len(chunk.token_ids)
                if rec.ttft_ms is None:
                    rec.ttft_ms = (time.perf_counter() - start) * 1000  # from the first try: holds and retries included
        except ResourceExhausted as err:
            retry_after_ms = err.retry_after_ms or 2000
        except CotserveError as err:
            rec.error = err.code.name
            return
        if retry_after_ms is None:
            return
        wait_s = retry_after_ms / 1000 * random.uniform(0.5, 1.5)
        if time.perf_counter() + wait_s > give_up_at:
            rec.error = "RESOURCE_EXHAUSTED"
            return
        result.deferrals += 1
        rec.tokens = 0
        await asyncio.sleep(wait_s)


CAPACITY_CONCURRENCY = 64  # the worker's default --max-num-seqs: a full batch, so the rate is the saturated one


async def capacity(address: str, prompts: list[str], seconds: float = 8.0, concurrency: int = CAPACITY_CONCURRENCY,
                   streamed: bool = True) -> float:
    """Completed INTERACTIVE-sized requests per second with `concurrency` always in flight (a full batch: with fewer,
    the engine had room to spare, and 1.4x that "capacity" was no overload), each sent as the load sends its own:
    streamed (`_one`). Unary calls, as this measured before (`streamed=False`), cost the gateway and the client one
    message where a stream costs one a chunk: on this VM 330-355 requests/s unary against 224 streamed (64 in flight,
    one stack, back to back), so the bursts' "0.9 x capacity" of INTERACTIVE were 1.3-1.5x what the stack serves them,
    the overload of INTERACTIVE's own that the replays without BATCH kept finding."""
    done = 0
    stop_at = time.perf_counter() + seconds
    async with AsyncClient(address) as client:
        async def loop(i: int) -> None:
            nonlocal done
            prompt = prompts[i % len(prompts)]
            while time.perf_counter() < stop_at:
                if streamed:
                    await _one(client, prompt, "interactive", INTERACTIVE_NEW_TOKENS, RequestRecord())
                else:
                    await client.generate(prompt, max_new_tokens=INTERACTIVE_NEW_TOKENS, ignore_eos=True, sla="interactive")
                done += 1
        start = time.perf_counter()
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
        return done / (time.perf_counter() - start)


TICK_S = 0.1  # the load sends its arrivals in ticks of this many seconds (`arrivals`)


def poisson(rng: random.Random, mean: float) -> int:
    """A Poisson(`mean`) count (Knuth's product of uniforms; a tick's mean is at most a few dozen here). Replaces 20
    Bernoulli trials per tick, which capped arrivals at 200 requests/s: on a stack whose capacity measured over 222
    requests/s, the bursts' 0.9 x capacity of INTERACTIVE came out lower, and by how much depended on the run."""
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k


def arrivals(duration_s: float, cap: float, short: list[str], long: list[str], seed: int, cycle_s: float = CYCLE_S,
             batch: bool = True, burst: float = BURST):
    """The load's open-loop Poisson arrivals following `rates`: for every 100 ms tick, (tick, [(class, prompt), ...]),
    a count per tick drawn from `poisson`. Without `batch`, the same arrivals less BATCH's: the random draws are made
    all the same, so INTERACTIVE's arrivals are those of the full load, request for request."""
    rng = random.Random(seed)
    tick = 0
    while tick * TICK_S < duration_s:
        inter, rate_batch, surge = rates(tick * TICK_S, cap, cycle_s, burst)
        sent = []
        for cls, rate in ((SlaClass.INTERACTIVE, inter), (SlaClass.BATCH, rate_batch)):
            for _ in range(poisson(rng, rate * TICK_S)):
                prompt = rng.choice(long if surge and cls == SlaClass.INTERACTIVE else short)
                if batch or cls != SlaClass.BATCH:
                    sent.append((cls, prompt))
        yield tick, sent
        tick += 1


FLOOR_MARGIN = 1.1
"""`miss_floor` serves at this multiple of the measured capacity: closed loop the stack served 4% more with twice the
requests in flight (233.4 against 223.5 requests/s streamed, 128 and 64), and the gateway lets up to twice the seats
run, so the measure is not quite the ceiling; with the margin the floor stays under what any rule can reach."""


def miss_floor(ticks, capacity: float, target_ms: float, margin: float = FLOOR_MARGIN) -> float:
    """The fewest INTERACTIVE target misses any admission rule could leave on these `arrivals` (a share of their
    INTERACTIVE requests): a fluid queue that starts INTERACTIVE requests at `margin` x `capacity` a second, with
    BATCH out of its way throughout, each request costing one short request (a surge's long prompts cost more) and
    each tick's arrivals served within the tick yet timed from its end, in which whatever is queued beyond
    `target_ms` of that rate at a tick's end cannot start in time in any order, so is counted
    missed (turned away or late) and dropped. Every simplification favours the rules: unless the stack starts
    INTERACTIVE faster than `margin` x its measured capacity, no rule leaves fewer misses, and where the floor is over
    a fifth of off's misses the 80% cut is out of any rule's reach on that replay (the bursts carry more than the stack
    can start in time; only capacity helps). NaN without INTERACTIVE arrivals."""
    rate = margin * capacity
    backlog = missed = total = 0.0
    for _, sent in ticks:
        arrived = sum(cls == SlaClass.INTERACTIVE for cls, _ in sent)
        total += arrived
        backlog = max(0.0, backlog + arrived - rate * TICK_S)  # a tick's arrivals start within it and wait from its end
        over = max(0.0, backlog - rate * target_ms / 1000)
        missed, backlog = missed + over, backlog - over
    return missed / total if total else math.nan


async def drive(address: str, duration_s: float, cap: float, short: list[str], long: list[str], seed: int, progress,
                cycle_s: float = CYCLE_S, batch: bool = True, burst: float = BURST) -> LoadResult:
    """Sends `arrivals` on time, each request as a task of its own (BATCH's retried as `_batch` says)."""
    result = LoadResult(duration_s)
    tasks = []
    async with AsyncClient(address) as client:
        start = time.perf_counter()
        last_report = 0
        for tick, sent in arrivals(duration_s, cap, short, long, seed, cycle_s, batch, burst):
            await asyncio.sleep(max(0.0, start + tick * TICK_S - time.perf_counter()))
            for cls, prompt in sent:
                rec = RequestRecord()
                result.records.append((cls, rec))
                if cls == SlaClass.BATCH:
                    tasks.append(asyncio.create_task(_batch(client, prompt, rec, result, start + duration_s + 60)))
                else:
                    tasks.append(asyncio.create_task(_one(client, prompt, "interactive", INTERACTIVE_NEW_TOKENS, rec)))
            if (tick + 1) * TICK_S - last_report >= 30:
                last_report = (tick + 1) * TICK_S
                progress(f"  {last_report:.0f}/{duration_s:.0f} s, {len(result.records)} requests sent")
        await asyncio.gather(*tasks)
    return result


LONG_PROMPT_TOKENS = 512


async def _prompts(address: str) -> tuple[list[str], list[str]]:
    """Short prompts, and the surge's long one: 512 tokens, or as many as the model's context leaves room for
    beside the answer (the demo model's context is 256 tokens: a longer prompt is refused, not slow)."""
    async with AsyncClient(address) as client:
        (info, *_) = await client.list_models()
        short = [await prompt_of_tokens(client, n) for n in (16, 32, 64)]
        room = info.max_context_tokens - INTERACTIVE_NEW_TOKENS
        long = [await prompt_of_tokens(client, min(LONG_PROMPT_TOKENS, room))]
    return short, long


FOLDS = 5  # blocked cross-validation of the recording: every stretch held out once (`slo.model.evaluate_folds`)
_NO_HOLD, _NO_SHED, _NO_PAUSE = ("--no-slo-admission",), ("--slo-shed-over", "0"), ("--no-slo-pause-batch",)
_OFF = (*_NO_HOLD, *_NO_SHED, *_NO_PAUSE)  # every rule named, each off (the gateway's defaults shed and pause)
NO_BATCH = "no BATCH"
ADMISSION_VARIANTS: dict[str, tuple[str, ...]] = {
    "off": _OFF, "off again": _OFF, NO_BATCH: _OFF,
    "all-or-nothing": ("--slo-admission", "--slo-throttle-from", "1.0", *_NO_SHED, *_NO_PAUSE),
    "proportional": ("--slo-admission", "--slo-throttle-from", "0.5", *_NO_SHED, *_NO_PAUSE),
    "pause": (*_NO_HOLD, *_NO_SHED, "--slo-pause-batch"),
    "shed": (*_NO_HOLD, "--slo-shed-over", "0.8", *_NO_PAUSE),
    "shed and pause": (*_NO_HOLD, "--slo-shed-over", "0.8", "--slo-pause-batch"),  # the gateway's defaults
}
"""The replays' admission rules, as the gateway's flags: none; none again (the same replay twice: the run-to-run gap that
any rule's difference from off is to be read against); the same replay with its BATCH arrivals left out (`NO_BATCH`:
INTERACTIVE's misses with nothing left for a BATCH rule to act on, the floor under any rule's: what a rule can cut at
most is off's misses less these); all BATCH arrivals held while the forecast is over the
threshold (`--slo-throttle-from 1`, the default); held in proportion from half the threshold; running BATCH paused on
the worker while the forecast is over the threshold, arrivals let in (`--slo-pause-batch`); and, acting on
INTERACTIVE itself rather than BATCH, an INTERACTIVE request that would queue in the gateway turned away when its
predicted TTFT p90 is over 0.8 of the target (`--slo-shed-over 0.8`: in a 300 s recording's replays, 0.8 left 14 requests late and turned 376 away, 1.0 left 217
late and turned 216 away, of 7,477; the run without admission between them had 708 late); and both of the last two
together (`shed and pause`: in the first full run with the capacity measured as the load sends, 11.0% missed, every
miss a request turned away, p99 815 ms, against shed's 11.5% / 1,094 ms, pause's 21.9% and off's 20.0%)."""
BATCH_RULES = ("all-or-nothing", "proportional", "pause")  # what the replay without BATCH bounds (`most_cut`)
NOISE_VARIANT = "off again"


@dataclass(frozen=True, slots=True)
class Mode:
    """How long a `bench slo` run records and replays, and which admission rules it replays."""

    duration_s: float
    replay_s: float
    cycle_s: float
    variants: tuple[str, ...]
    capacity_s: float = 8.0  # the closed-loop capacity measurement before the recording
    replay_capacity_s: float = 16.0  # the one before the replays (their shared load: longer, so that it moves less)
    burst: float = BURST  # INTERACTIVE's rate in the bursts, x capacity (`rates`)


FULL = Mode(600.0, 120.0, 30.0, tuple(ADMISSION_VARIANTS))  # 30 s cycles: enough violation onsets a recording for the
# evaluation, neighbouring cycles' violations apart
QUICK = Mode(100.0, 20.0, 25.0, ("off", "shed and pause"), capacity_s=4.0, replay_capacity_s=4.0)  # a few minutes on 2
# cores: four cycles recorded (the forecaster needs 120 labelled seconds of the first 70%), a surge in the training
# stretch, replays up to the burst's end


def predictor_child(address: str, state: Path):
    """The SLO predictor on `address`, keeping its history and models under `state`, retraining only when told (the
    benches train it themselves, on the stretch they choose); started again, it loads the models saved there."""
    from cotserve.common.procs import Child, grpc_ready, python_cli

    return Child("slo", address, python_cli("serve", "slo", "--port", address.rsplit(":", 1)[1], "--state-dir", str(state),
                                            "--retrain-interval-s", "100000"), grpc_ready(address))


def run(model: Path | None, mode: Mode, seed: int, progress) -> dict:
    """One seed: record `mode.duration_s` of load, train and evaluate on it, then replay `mode.replay_s` of the same
    load's shape (seed + 1) under each admission variant, each against a fresh gateway, all at one load: scaled to
    the capacity measured just before the replays (`replay_capacity_s`, through a gateway the predictor does not see).
    Not the recording's measurement: on these shared cores the stack's speed drifts over the tens of minutes a seed
    takes (two replays without admission 15 and 17 minutes after it missed INTERACTIVE's target in 20.8% and 42.2% of
    requests). Nor one measurement per replay, as 0a27313 did: back-to-back 8 s measurements differed by up to 30%
    (292.8 and 222.2 requests/s), a difference in load between the variants compared as large as any rule's effect."""
    from cotserve.common.procs import Child, free_port, grpc_ready, python_cli
    from cotserve.bench.warm import running

    state = Path(tempfile.mkdtemp(prefix="cotserve-bench-slo-"))
    worker_addr, slo_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    worker = Child("worker", worker_addr, python_cli("serve", "worker", "--port", worker_addr.rsplit(":", 1)[1],
                                                     *(["--model", str(model)] if model else [])), grpc_ready(worker_addr))

    slo_child = lambda: predictor_child(slo_addr, state)  # noqa: E731

    def gateway_child(rule: tuple[str, ...] | None) -> Child:  # None: one that does not report to the predictor
        addr = f"127.0.0.1:{free_port()}"
        slo = ("--slo", slo_addr, "--no-slo-routing", *rule) if rule is not None else ()
        return Child("gateway", addr, python_cli("serve", "gateway", "--port", addr.rsplit(":", 1)[1], "--worker", worker_addr,
                                                 *slo), grpc_ready(addr))

    out: dict = {"seed": seed, "replays": {}}
    with running([worker]):
        with running([slo_child(), gateway_child(_OFF)]) as (_, gw):
            short, long = run_loop(_prompts(gw.address))
            cap = run_loop(capacity(gw.address, short, mode.capacity_s))
            out["capacity_rps"] = cap
            progress(f"seed {seed}: capacity {cap:.1f} INTERACTIVE requests/s; recording {mode.duration_s:.0f} s of "
                     f"time-varying load, INTERACTIVE's bursts at {mode.burst:g} x capacity ...")
            out["recorded"] = run_loop(drive(gw.address, mode.duration_s, cap, short, long, seed, progress, mode.cycle_s,
                                             burst=mode.burst))
            time.sleep(2.5)  # the last windows reach the predictor
            if not _train(slo_addr, state, out):
                return out
        with running([gateway_child(None)]) as (plain,):  # unseen by the predictor: no forecast moves
            replay_cap = out["replay_capacity_rps"] = run_loop(capacity(plain.address, short, mode.replay_capacity_s))
        out["miss_floor"] = miss_floor(arrivals(mode.replay_s, replay_cap, short, long, seed + 1, mode.cycle_s, burst=mode.burst),
                                       replay_cap, DEFAULT_SLA_TARGETS[SlaClass.INTERACTIVE].ttft_ms)
        with running([slo_child()]):  # loads the models just saved
            for name in mode.variants:
                with running([gateway_child(ADMISSION_VARIANTS[name])]) as (gw,):
                    if ADMISSION_VARIANTS[name] != _OFF:
                        time.sleep(2)  # the gateway's first forecasts (it asks every second), for a rule to act on
                    progress(f"seed {seed}: replaying {mode.replay_s:.0f} s of bursty load at {replay_cap:.1f} requests/s "
                             f"of capacity, admission {name} ...")
                    out["replays"][name] = run_loop(drive(gw.address, mode.replay_s, replay_cap, short, long, seed + 1,
                                                             progress, mode.cycle_s, batch=name != NO_BATCH, burst=mode.burst))
    return out


@dataclass(frozen=True, slots=True)
class VariantOutcome:
    """One replay against the same seed's replay without admission."""

    misses: float             # INTERACTIVE target-miss rate
    p99_ttft_ms: float        # INTERACTIVE p99 TTFT
    tokens_ratio: float       # share of the asked-for output tokens served / that share without admission
    deferrals: int            # BATCH requests turned away (and retried by the client)
    batch_p50_ttft_ms: float  # BATCH's median TTFT from its first try (time held included)
    causes: dict[str, int]    # INTERACTIVE misses by cause

    def gap(self, other: VariantOutcome) -> tuple[float, float]:
        """How far apart two replays are: (INTERACTIVE misses, p99 TTFT ms), absolute differences."""
        return abs(self.misses - other.misses), abs(self.p99_ttft_ms - other.p99_ttft_ms)

    def worse_than(self, off: VariantOutcome, noise: VariantOutcome | None = None) -> bool:
        """More misses, or a higher p99 TTFT, than without admission: strictly, or (given `noise`, the same replay
        without admission run again) by more than the two runs without admission differed."""
        miss_gap, p99_gap = noise.gap(off) if noise else (0.0, 0.0)
        return self.misses > off.misses + miss_gap or self.p99_ttft_ms > off.p99_ttft_ms + p99_gap


def outcomes(out: dict) -> dict[str, VariantOutcome]:
    """Each replay of one seed's run, against that seed's replay without admission."""
    off = out["replays"]["off"]
    i = SlaClass.INTERACTIVE
    return {name: VariantOutcome(r.miss_rate(i), r.ttft(i, 99), r.served_share / off.served_share, r.deferrals,
                                 r.ttft(SlaClass.BATCH, 50), r.miss_causes(i))
            for name, r in out["replays"].items()}


def recorded(slo_addr: str) -> tuple[list, list]:
    """Everything the predictor on `slo_addr` recorded: its metrics windows and request observations."""
    import grpc

    from cotserve.slo.history import export_all
    from cotserve.slo.v1 import slo_pb2_grpc

    with grpc.insecure_channel(slo_addr) as ch:
        windows, requests, _ = export_all(slo_pb2_grpc.SloServiceStub(ch))
    return windows, requests


def _train(slo_addr: str, state: Path, out: dict) -> bool:
    """Export what the predictor recorded, evaluate and train on it, save the models under `state`; into `out` the
    counts and the evaluation (or why it could not train: then False)."""
    from cotserve.slo.model import Untrained, evaluate, evaluate_folds

    windows, requests = recorded(slo_addr)
    out["windows"], out["requests"] = len(windows), len(requests)
    try:
        out["folds"] = evaluate_folds(windows, FOLDS)
    except Untrained as exc:
        out["folds_untrained"] = str(exc)
    try:
        ev, fc, lm = evaluate(windows, requests)
        out["evaluation"] = ev
    except Untrained as exc:
        out["untrained"] = str(exc)
        return False
    fc.save(state / "models")
    if lm.is_trained:
        lm.save(state / "models")
    return True
