"""`cotserve bench slo`'s report over one or more seeds: the forecast by episodes with 95% intervals, the replays
under each admission rule against the same seed's replay without, and the goals of issue 21, met or not."""

from __future__ import annotations

import math

from cotserve.bench.slo import BATCH_RULES, FLOOR_MARGIN, NO_BATCH, NOISE_VARIANT, Mode, VariantOutcome, outcomes
from cotserve.common.sampling import SlaClass
from cotserve.common.stats import mean_interval95, mean_pm as _pm
from cotserve.slo.model import pooled_events

MIN_ONSETS = 20  # held-out violation onsets (pooled over seeds) for the share foreseen to mean something


def _pct(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{100 * v:.1f}%"


def verdicts(per_seed: list[dict[str, VariantOutcome]], variant: str) -> tuple[int, list[bool], int | None]:
    """(seeds where `variant` was worse than off; for each seed whose off replay missed >= 5%, whether the variant cut
    misses >= 80% at >= 0.85x the tokens; and, where every seed replayed off twice, the seeds where it was worse by
    more than the two replays without admission differed, else None)."""
    worse, cuts = 0, []
    for seed in per_seed:
        off, on = seed["off"], seed[variant]
        worse += on.worse_than(off)
        if off.misses >= 0.05:
            cuts.append(on.misses <= 0.2 * off.misses and on.tokens_ratio >= 0.85)
    beyond = None
    if all(NOISE_VARIANT in seed for seed in per_seed):
        beyond = sum(seed[variant].worse_than(seed["off"], seed[NOISE_VARIANT]) for seed in per_seed)
    return worse, cuts, beyond


def rules(mode: Mode) -> tuple[str, ...]:
    """The admission rules a run judges: its variants but off, off's second run and the replay without BATCH."""
    return tuple(v for v in mode.variants if v not in ("off", NOISE_VARIANT, NO_BATCH))


def most_cut(seed: dict[str, VariantOutcome]) -> float:
    """The largest share of off's INTERACTIVE misses that any rule acting on BATCH could cut on this seed: those left
    when the replay had no BATCH at all are INTERACTIVE's own (NaN: off missed none)."""
    off = seed["off"].misses
    return (off - seed[NO_BATCH].misses) / off if off else math.nan


def _reachable(per_seed: list[dict[str, VariantOutcome]], floors: list[float], variant: str, mode: Mode) -> str:
    """How many of the seeds where off missed >= 5% left the 80% cut within `variant`'s reach: the fluid floor
    (`miss_floor`, any rule) at most a fifth of off's misses and, for a rule acting on BATCH with the replay without
    BATCH run, that replay's misses too; '' when neither was measured."""
    batch_bound = NO_BATCH in mode.variants and variant in BATCH_RULES
    floored = not all(math.isnan(f) for f in floors)
    if not batch_bound and not floored:
        return ""
    tested = [(s, f) for s, f in zip(per_seed, floors) if s["off"].misses >= 0.05]
    within = sum((math.isnan(f) or f <= 0.2 * s["off"].misses) and (not batch_bound or most_cut(s) >= 0.8) for s, f in tested)
    by = " and ".join(["the fluid floor"] * floored + [NO_BATCH] * batch_bound)
    return f" (within reach, {by} leaving <= 20% of off's misses, on {within})"


def print_report(outs: list[dict], mode: Mode, console) -> bool:
    """Everything the runs measured; False when no seed could train (nothing to report beyond why)."""
    from cotserve.slo.cli import print_evaluation

    trained = [o for o in outs if "evaluation" in o]
    for o in outs:
        rec = o["recorded"]
        causes = ", ".join(f"{n} {cause}" for cause, n in rec.miss_causes(SlaClass.INTERACTIVE).items())
        console.print(f"seed {o['seed']}: recorded {len(rec.records)} requests, {o['windows']} windows; INTERACTIVE "
                      f"missed its target in {100 * rec.miss_rate(SlaClass.INTERACTIVE):.1f}% ({causes})"
                      + (f"; [red]could not train:[/red] {o['untrained']}" if "untrained" in o else ""))
    if not trained:
        return False
    if len(outs) == 1:
        print_evaluation(trained[0]["evaluation"], console)
    _seed_table(trained, mode, console)
    _summary_tables(trained, mode, console)
    _folds_table(trained, console)
    _goals(trained, mode, console)
    return True


def _seed_table(trained: list[dict], mode: Mode, console) -> None:
    from rich.table import Table

    t = Table(title="Per seed: forecast on the held-out stretch, and INTERACTIVE in the replays "
                    "(misses / p99 TTFT ms / tokens vs off)")
    for col in ("seed", "AUC (baseline)", "onsets", ">= 10 s ahead", "median lead", "false alarms / h", "TTFT MAPE",
                *mode.variants):
        t.add_column(col, justify="right")
    for o in trained:
        ev, oc = o["evaluation"], outcomes(o)
        e = ev.events
        t.add_row(str(o["seed"]), f"{ev.auc:.3f} ({ev.baseline_auc:.3f})", str(e.onsets), f"{e.forecast_ahead}",
                  "n/a" if math.isnan(e.median_lead_s) else f"{e.median_lead_s:.0f} s",
                  "n/a" if math.isnan(e.false_alarms_per_hour) else f"{e.false_alarms_per_hour:.0f}", _pct(ev.ttft_mape),
                  *(f"{_pct(oc[v].misses)} / {oc[v].p99_ttft_ms:.0f} / {oc[v].tokens_ratio:.2f}x" for v in mode.variants))
    console.print(t)


def _summary_tables(trained: list[dict], mode: Mode, console) -> None:
    from rich.table import Table

    from cotserve.slo.cli import by_load_text, print_episodes

    evs = [o["evaluation"] for o in trained]
    n = len(trained)
    print_episodes(evs, f"Forecast over {n} seed{'s' * (n > 1)}: onsets pooled (Wilson 95%), the rest mean ± 95% interval",
                   console)
    console.print(f"TTFT MAPE on held-out requests: {_pm([ev.ttft_mape for ev in evs], '{:.1f}%', 100)}; TPOT MAPE "
                  f"{_pm([ev.tpot_mape for ev in evs], '{:.1f}%', 100)}")
    for o in trained:  # by load level (the worker's requests in flight, terciles of each seed's held-out requests)
        console.print(f"  seed {o['seed']}: TTFT MAPE by load: {by_load_text(o['evaluation'].ttft_mape_by_load)}")
    per_seed = [outcomes(o) for o in trained]
    r = Table(title=f"Replays of {mode.replay_s:.0f} s, admission rules (mean ± 95% interval over seeds; shed requests are "
                    "misses, p99 TTFT is over those served)")
    for col in ("admission", "INTERACTIVE missed", "misses by cause (all seeds)", "INTERACTIVE p99 TTFT ms",
                "tokens vs off", "BATCH p50 TTFT ms", "BATCH turned away", "seeds worse than off"):
        r.add_column(col, justify="right")
    for v in mode.variants:
        worse = f"{verdicts(per_seed, v)[0]} of {n}" if v in rules(mode) else ""
        causes: dict[str, int] = {}
        for seed in per_seed:
            for cause, k in seed[v].causes.items():
                causes[cause] = causes.get(cause, 0) + k
        r.add_row(v, _pm([s[v].misses for s in per_seed], "{:.2f}%", 100), ", ".join(f"{k} {c}" for c, k in causes.items()),
                  _pm([s[v].p99_ttft_ms for s in per_seed], "{:.0f}"), _pm([s[v].tokens_ratio for s in per_seed], "{:.2f}x"),
                  _pm([s[v].batch_p50_ttft_ms for s in per_seed], "{:.0f}"), _pm([s[v].deferrals for s in per_seed], "{:.0f}"),
                  worse)
    console.print(r)


def _folds_table(trained: list[dict], console) -> None:
    from cotserve.slo.cli import print_folded

    folded = [o["folds"] for o in trained if "folds" in o]
    if folded:
        print_folded(folded, console)


def _goals(trained: list[dict], mode: Mode, console) -> None:
    evs = [o["evaluation"] for o in trained]
    per_seed = [outcomes(o) for o in trained]
    folded = [o["folds"] for o in trained if "folds" in o]
    onsets = pooled_events(folded, "events")[0] if folded else pooled_events(evs, "events")[0]
    auc, base_auc = mean_interval95([ev.auc for ev in evs])[0], mean_interval95([ev.baseline_auc for ev in evs])[0]
    mape = mean_interval95([ev.ttft_mape for ev in evs])[0]
    goals = [
        (onsets >= MIN_ONSETS, f"{onsets} held-out violation onsets over the seeds{' (cross-validated)' * bool(folded)} "
                               f"(goal >= {MIN_ONSETS})"),
        (auc >= 0.9 and auc > base_auc, f"mean AUC {auc:.3f} >= 0.9 and above the baseline's {base_auc:.3f}"),
        (mape <= 0.2, f"TTFT MAPE {_pct(mape)} <= 20%"),
    ]
    if NOISE_VARIANT in mode.variants:
        gaps = [s[NOISE_VARIANT].gap(s["off"]) for s in per_seed]
        console.print("off replayed twice, the run-to-run gap per seed (INTERACTIVE misses / p99 TTFT): "
                      + ", ".join(f"{100 * m:.1f} points / {p:.0f} ms" for m, p in gaps))
    if NO_BATCH in mode.variants:
        console.print(f"{NO_BATCH} (the same replay without its BATCH arrivals: the misses no BATCH rule can touch), per seed, "
                      "INTERACTIVE misses against off's, and the most of off's misses a BATCH rule could cut: "
                      + ", ".join(f"{_pct(s[NO_BATCH].misses)} vs {_pct(s['off'].misses)}: "
                                  + ("n/a" if math.isnan(most_cut(s)) else f"{100 * max(0.0, most_cut(s)):.0f}%")
                                  for s in per_seed))
    floors = [o.get("miss_floor", math.nan) for o in trained]
    if not all(math.isnan(f) for f in floors):
        console.print(f"the fewest INTERACTIVE misses any rule could leave (`miss_floor`: a fluid queue at {FLOOR_MARGIN:g}x the "
                      "measured capacity, BATCH out of the way), per seed, against off's misses and the 80% cut's bound: "
                      + ", ".join(f"{_pct(f)} vs {_pct(s['off'].misses)} (cut to {_pct(0.2 * s['off'].misses)})"
                                  for f, s in zip(floors, per_seed)))
    for v in rules(mode):
        worse, cuts, beyond = verdicts(per_seed, v)
        goals.append((worse == 0, f"{v}: never worse than off (misses and p99 TTFT): worse on {worse} of {len(trained)} seeds"
                      + ("" if beyond is None else f", by more than off's own run-to-run gap on {beyond}")))
        if cuts:
            reachable = _reachable(per_seed, floors, v, mode)
            goals.append((all(cuts), f"{v}: where off missed >= 5% ({len(cuts)} seeds), misses down >= 80% at >= 0.85x "
                                     f"tokens on {sum(cuts)} of them{reachable}"))
        else:
            console.print(f"{v}: no seed's replay without admission missed >= 5%, so the 80% cut was not put to the test")
    for ok, text in goals:
        console.print(f"{'[green]met[/green]' if ok else '[red]NOT met[/red]'}: {text}")
