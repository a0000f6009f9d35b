"""Latency prediction's features and a dependency-free evaluator of its trained trees.

The SLO predictor trains the latency model (XGBoost) on request observations; the gateway routes by it. Asking
the predictor over gRPC for every request put a round trip on every pick, and on a busy host most of them missed
their few-millisecond budget (bench slo-routing: 55 of 4,538 picks decided by a prediction, the rest by the load
heuristic, which a timeout falls back to). So the gateway fetches the trained trees (`GetLatencyModel`, XGBoost's
JSON) when they change and evaluates them itself: `TreeEnsemble`, pure Python, no XGBoost or numpy in the gateway,
the same numbers as XGBoost's predict (float32 features and thresholds, as XGBoost compares them).

Both sides build a request's feature row with `latency_row`, so what the trees were fit on and what they are asked
about cannot drift apart; the fetched model names its features and a gateway whose list differs does not use it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from cotserve.common.v1 import common_pb2
from cotserve.common.sampling import SLA_PB

CLASS_INDEX = {pb: i for i, pb in enumerate(SLA_PB.values())}

# The worker's last window, with in_flight and queue_depth replaced by what the gateway counts at the
# moment of the request (its own requests in flight on the worker and in its queues for it), and the
# request's place in line for prefill: requests sent before it still without a first token, their prompt
# tokens, and the prefill work before its own first token (theirs and its own prompt). The worker's own
# Stats say what this gateway cannot count: its running batch and tokens/s from every client (another
# gateway's, a direct caller's) and how long its steps take; `steps_ahead_ms` is the step time times the
# requests ahead of this one (this gateway's without a first token and the worker's own waiting), the
# first-order estimate of the wait that the trees refine (they cannot form a product from two splits). A
# worker's seats (the most sequences it runs at once) turn counts into how full it is: four of this gateway's
# requests in flight fill a worker of four seats and not one of 32 (`in_flight_per_seat`; `busy_per_seat`
# from its own running and waiting, every client's). What no count shows: a worker stalled right now (a long step,
# another client's burst, a process starved of its core), which the requests sent in the next 100 ms all pay for;
# `oldest_wait_ms` (how long the oldest of this gateway's requests without a first token has waited) and `silent_ms`
# (how long since it last read anything from the worker while it has requests there) see it as it happens. And
# when this gateway's requests fill the worker's seats, a new one waits for a seat: `seat_wait_tokens`, the decode
# tokens left of the one whose end frees it (the gateway's `seat_wait_tokens`), which no count of requests shows.
#
# The TTFT models predict TTFT as a multiple of `estimate_ms` (the last feature), not in milliseconds: a queueing
# estimate of the wait (`ttft_estimate_ms`). Trees predict a constant per leaf: fit to milliseconds they cannot
# follow a queue deeper than their training stretch's, nor form the product of a queue and a rate; as a multiple of
# the estimate the prediction grows with the line ahead, and the trees learn the correction (bench slo's 600 s
# recording, seed 0, held-out TTFT MAPE 50.1% fit to milliseconds, 37.0% so).
LATENCY_FEATURES = ("prompt_tokens", "max_new_tokens", "is_realtime", "is_interactive", "is_batch",
                    "w_in_flight", "w_queue", "w_waiting", "w_kv_used", "w_arrivals", "w_tokens_per_s",
                    "w_utilization", "w_ttft_p50", "w_itl_p50", "waiting_ahead", "prefill_tokens_ahead",
                    "prefill_tokens_to_first", "w_running", "w_step_ms", "w_gen_tokens_per_s", "steps_ahead_ms",
                    "w_seats", "in_flight_per_seat", "busy_per_seat", "w_first_tokens", "queued_ahead", "oldest_wait_ms",
                    "silent_ms", "seat_wait_tokens", "estimate_ms")
ESTIMATE = len(LATENCY_FEATURES) - 1  # the row's `estimate_ms`
TTFT_TARGET = "TTFT / estimate_ms"
"""What the TTFT models predict (the saved model and `GetLatencyModel` name it; a gateway or predictor of another
build, whose trees predict something else, does not use them): TTFT in ms is their output times the row's
`estimate_ms`."""


def ttft_estimate_ms(step_ms: float, waiting_ahead: float, queued: float, first_tokens: float) -> float:
    """The wait before a new request's first token, to first order: a step (`step_ms`, the worker's median) for each of
    the `waiting_ahead` requests sent before it that have no first token yet and one for its own prefill, plus the
    `queued` requests ahead of it in the gateway's queues for the worker (its class's, and INTERACTIVE's for BATCH),
    each leaving as fast as the worker gave first tokens in its last second (`first_tokens` of them; a step each
    without any). At least 1 ms."""
    step_ms = max(step_ms, 1.0)
    per_first_ms = 1000.0 / first_tokens if first_tokens > 0 else step_ms
    return step_ms * (1 + waiting_ahead) + queued * per_first_ms


def latency_row(prompt_tokens: float, max_new_tokens: float, sla_class: int, state: common_pb2.MetricsWindow) -> list[float]:
    c = CLASS_INDEX.get(sla_class, 1)
    seats = state.worker_max_num_seqs
    per_seat = 1.0 / seats if seats else 0.0  # unknown seats: no such signal
    return [prompt_tokens, max_new_tokens, float(c == 0), float(c == 1), float(c == 2),
            state.in_flight, state.queue_depth, state.worker_waiting, state.kv_used_fraction, state.arrivals,
            state.output_tokens_per_s, state.utilization, state.ttft_p50_ms, state.itl_p50_ms,
            state.waiting_for_first_token, state.prefill_tokens_ahead, state.prefill_tokens_ahead + prompt_tokens,
            state.worker_running, state.worker_step_ms, state.worker_tokens_per_s,
            state.worker_step_ms * (1 + state.waiting_for_first_token + state.worker_waiting),
            seats, state.in_flight * per_seat, (state.worker_running + state.worker_waiting) * per_seat,
            state.first_tokens, state.queued_ahead, state.oldest_wait_ms, state.silent_ms, state.seat_wait_tokens,
            ttft_estimate_ms(state.worker_step_ms, state.waiting_for_first_token, state.queued_ahead, state.first_tokens)]


# Objectives whose prediction is the trees' sum plus the base score, untransformed (the latency model's kind).
IDENTITY_OBJECTIVES = frozenset({"reg:squarederror", "reg:absoluteerror", "reg:quantileerror", "reg:pseudohubererror"})


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True, slots=True)
class _Tree:
    left: tuple[int, ...]
    right: tuple[int, ...]
    feature: tuple[int, ...]
    value: tuple[float, ...]  # a split's threshold (float32) or a leaf's value
    default_left: tuple[bool, ...]


class TreeEnsemble:
    """An XGBoost regression model (gbtree, numeric splits, an identity-link objective) read from its JSON; `predict`
    gives what `Booster.predict` gives for the same row, within float32 rounding of the sum."""

    def __init__(self, model_json: bytes | str) -> None:
        try:
            learner = json.loads(model_json)["learner"]
            objective = learner["objective"]["name"]
            booster = learner["gradient_booster"]
            trees = booster["model"]["trees"]
            self.features = tuple(learner.get("feature_names", ()))
            self.base_score = float(learner["learner_model_param"]["base_score"].strip("[]"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not an XGBoost model's JSON: {exc!r}") from None
        if booster.get("name") != "gbtree":
            raise ValueError(f"gradient_booster: {booster.get('name')!r}, only gbtree is supported")
        if objective not in IDENTITY_OBJECTIVES:
            raise ValueError(f"objective: {objective!r}, must be one of {', '.join(sorted(IDENTITY_OBJECTIVES))}")
        self.objective = objective
        self.trees = [self._tree(t, i) for i, t in enumerate(trees)]

    @staticmethod
    def _tree(t: dict, i: int) -> _Tree:
        if any(t.get("split_type", ())):
            raise ValueError(f"trees[{i}]: categorical splits are not supported")
        return _Tree(tuple(t["left_children"]), tuple(t["right_children"]), tuple(t["split_indices"]),
                     tuple(_f32(v) for v in t["split_conditions"]), tuple(bool(d) for d in t["default_left"]))

    def predict(self, row: list[float]) -> float:
        """The model's output for one row of features (NaN: missing, which takes each split's default branch)."""
        x = [_f32(v) for v in row]
        total = self.base_score
        for t in self.trees:
            left, right, feature, value, default_left = t.left, t.right, t.feature, t.value, t.default_left
            i = 0
            while left[i] != -1:
                v = x[feature[i]]
                if v != v:  # NaN
                    i = left[i] if default_left[i] else right[i]
                else:
                    i = left[i] if v < value[i] else right[i]
            total += value[i]
        return total


def predicted_ttft_ms(trees: TreeEnsemble, row: list[float]) -> float:
    """TTFT in milliseconds from fetched TTFT trees (which predict `TTFT_TARGET`) for one `latency_row`."""
    return trees.predict(row) * row[ESTIMATE]
