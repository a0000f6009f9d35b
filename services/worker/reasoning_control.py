"""The reasoning controller: thinking budgets, early-exit probes and adaptive self-consistency votes, decided from
what each step produced and returned to the engine as typed actions. No torch, no grpc.

The engine core owns the sequences, the scheduler and the outputs; it tells the controller what happened (a sample
took a token, a probe finished, a sample finished) and carries out the actions it gets back, in order:

- `AppendTokens`: tokens join a sample as its own (a budget's forcing text; an early exit's end marker and answer);
- `Fork`: an early-exit probe joins the batch sharing its sample's computed pages (copy-on-write);
- `Cancel`: sequences end now: probes that can no longer matter, or the samples a settled vote no longer needs;
- `StartSamples`: another self-consistency round of samples of the same prompt.
"""

from __future__ import annotations

import json

from dataclasses import dataclass

from cotserve.worker.engine_metrics import EngineMetrics
from cotserve.worker.outputs import VoteResult
from cotserve.worker.reasoning import Ballot, ReasoningFormat, ThinkingTracker, confidence, mean_probability, tally
from cotserve.worker.request_state import RequestState
from cotserve.worker.sequence import SamplingParams, Sequence


def comparable(answer: str, params: SamplingParams) -> str:
    """An answer as votes and early-exit probes compare it: under a JSON format (structured output) the value parsed
    and written canonically, so equal values agree however they were spaced or ordered; any other answer as it is."""
    fmt = params.structured
    if fmt is None or not fmt.is_json:
        return answer
    try:
        return json.dumps(json.loads(answer), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except ValueError:
        return answer


@dataclass(slots=True, frozen=True)
class AppendTokens:
    """Append `token_ids` to sample `seq` as its own; `finish` ends the sample on the last of them (None: as the
    scheduler and the text decide)."""

    seq: Sequence
    token_ids: tuple[int, ...]
    finish: str | None = None


@dataclass(slots=True, frozen=True)
class Fork:
    """Start early-exit `probe` (its parent is `probe.probe_of`), unless no seat or block is free now."""

    probe: Sequence


@dataclass(slots=True, frozen=True)
class Cancel:
    """End `seqs` now: probes are dropped; samples end with a tokenless "cancelled" output."""

    seqs: tuple[Sequence, ...]


@dataclass(slots=True, frozen=True)
class StartSamples:
    """Start `count` more samples of the request (a new self-consistency round)."""

    count: int


Action = AppendTokens | Fork | Cancel | StartSamples


class ReasoningController:
    """Decides the reasoning controls of every request of one engine (engine thread only)."""

    def __init__(self, fmt: ReasoningFormat, tokenizer, max_model_len: int, metrics: EngineMetrics) -> None:
        self.fmt, self.tokenizer, self.max_model_len, self.metrics = fmt, tokenizer, max_model_len, metrics
        self._ids: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> tuple[int, ...]:
        """`text`'s token ids, without special tokens (cached: the same few texts come back every request)."""
        ids = self._ids.get(text)
        if ids is None:
            ids = self._ids[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return ids

    # ---- what a token means --------------------------------------------------------------------
    def observe(self, tracker: ThinkingTracker, token: int, text: str) -> int:
        """Account one output token of a sample; its `reasoning.Part`. A sample that ends its thinking here is counted
        (the early-exit savings estimate)."""
        was_thinking = tracker.is_thinking
        part = int(tracker.observe(token, text))
        if was_thinking and not tracker.is_thinking:
            self.metrics.note_thinking(tracker.num_thinking_tokens, tracker.exited_early, tracker.forced_end)
        return part

    @staticmethod
    def banned_token(req: RequestState, seq: Sequence) -> int | None:
        """A token `seq` may not sample now (the end marker, before its minimum thinking)."""
        return req.trackers[seq.index].banned_token() if req.trackers and not seq.is_probe else None

    @staticmethod
    def wants_logprob(req: RequestState, seq: Sequence) -> bool:
        """A probe's answer and a vote's ballot are weighed by their tokens' probabilities."""
        return seq.is_probe or req.vote is not None

    # ---- budgets and early exit ------------------------------------------------------------------
    def after_token(self, req: RequestState, seq: Sequence) -> list[Action]:
        """Sample `seq` took a sampled token and goes on: end its thinking when a budget is spent, fork a probe at a
        probe point (one step after it, once the point's token is computed), drop probes once it stops thinking."""
        tracker = req.trackers[seq.index]
        if tracker.must_stop_thinking():
            tracker.forced_end = True
            room = seq.params.max_new_tokens - len(seq.output_ids)
            forcing = self.encode(tracker.options.forcing_text or self.fmt.end)[:room]
            return [Cancel(tuple(req.probes_of(seq))), AppendTokens(seq, forcing)]
        actions: list[Action] = []
        if tracker.probe_pending and tracker.is_thinking:
            probe = self._probe(req, seq)
            if probe is not None:
                actions.append(Fork(probe))
        tracker.probe_pending = tracker.take_probe_due()
        if not tracker.is_thinking and req.probes:
            actions.append(Cancel(tuple(req.probes_of(seq))))
        return actions

    def _probe(self, req: RequestState, seq: Sequence) -> Sequence | None:
        """An early-exit probe of `seq` at its probe point: the end marker after the point, decoded greedily up to
        `probe_max_tokens`, computing nothing `seq` has; None when it would not fit the model's length or the point's
        token is not computed yet."""
        end_ids = list(self.encode(self.fmt.end))
        if seq.num_computed_tokens != len(seq) - 1 or len(seq) + len(end_ids) >= self.max_model_len:
            return None
        params = SamplingParams(max_new_tokens=req.reasoning.early_exit.probe_max_tokens,
                                stop_token_ids=seq.params.stop_token_ids, ignore_eos=seq.params.ignore_eos,
                                structured=seq.params.structured)  # its answer as the sample's will be
        return Sequence(seq.request_id, seq.all_token_ids[:-1] + end_ids, params, seq.sla_class, index=seq.index,
                        arrival_time=seq.arrival_time, cache_root=seq.cache_root, probe_of=seq,
                        num_forced_tokens=len(end_ids), tenant=seq.tenant, fair_tag=seq.fair_tag)

    def probe_done(self, req: RequestState, probe: Sequence, answer_ids: list[int]) -> list[Action]:
        """A probe finished with `answer_ids` (its stop token left out): once the last probes agree, its sample stops
        thinking and answers with what the probe decoded."""
        parent = probe.probe_of
        tracker = req.trackers[parent.index]
        if parent.is_finished or not tracker.is_thinking:
            return []
        answer = comparable(self.fmt.answer(self.tokenizer.decode(answer_ids)), probe.params)
        tracker.probe_answers.append((answer, mean_probability(probe.output_logprobs)))
        if tracker.converged() is None:
            return []
        tracker.exited_early = True  # counted as saved thinking when the end marker goes out (`observe`)
        self.metrics.early_exits += 1
        tokens = (*self.encode(self.fmt.end), *answer_ids)
        tokens = tokens[: max(1, parent.params.max_new_tokens - len(parent.output_ids))]
        return [Cancel(tuple(req.probes_of(parent))), AppendTokens(parent, tokens, finish="stop")]

    # ---- adaptive self-consistency ------------------------------------------------------------------
    def sample_finished(self, req: RequestState, seq: Sequence, answer_text: str | None) -> list[Action]:
        """Count a finished sample's ballot. A settled vote cancels the unfinished samples; a round that ends unsettled
        starts the next one."""
        vote = req.vote
        if vote is None:
            return []
        vote.ballots.append(Ballot(comparable(answer_text or "", seq.params), confidence(seq.output_logprobs)))
        reason = vote.settled()
        if reason is None and req.num_unfinished == 0:
            if vote.started < vote.params.max_samples:
                return [StartSamples(min(vote.params.min_samples, vote.params.max_samples - vote.started))]
            reason = "max_samples"
        if reason is None:
            return []
        vote.stop_reason = reason
        unfinished = tuple(s for s in req.samples if not s.is_finished)
        vote.cancelled += len(unfinished)
        return [Cancel(unfinished)] if unfinished else []

    def vote_result(self, req: RequestState) -> VoteResult:
        """How the request's vote ended (at its end; counted in the metrics)."""
        vote = req.vote
        used = len(vote.ballots)
        self.metrics.vote_samples_used += used
        self.metrics.vote_samples_saved += max(0, vote.params.max_samples - used)
        return VoteResult(vote.answer(), tuple(tally(vote.ballots, vote.params)), used, vote.cancelled,
                          tuple(len(s.output_ids) for s in req.samples), vote.stop_reason, vote.params.max_samples - used)
