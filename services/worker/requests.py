"""Every request inside the engine: its state (`RequestState`), its outputs to its sink, and the reasoning
controller's actions on it (`reasoning_control.py`). Engine thread only; no torch, no grpc.

The engine core calls it with what each step produced (`emit` a sampled token, `probe_token` a probe's); this is where
a sample's text is made (when the engine makes it), where a sample ends (a stop token or string, its length, a
reasoning control, a settled vote) and where a request's last output gets its usage and timing.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from cotserve.worker.block_manager import cache_root, long_rope_root
from cotserve.worker.commands import AddRequest
from cotserve.worker.engine_metrics import EngineMetrics
from cotserve.worker.outputs import NO_TOKEN, RequestOutput, Sink, timing_of
from cotserve.worker.reasoning import ReasoningFormat, VoteState
from cotserve.worker.reasoning_control import Action, AppendTokens, Cancel, Fork, ReasoningController, StartSamples
from cotserve.worker.request_state import RequestState
from cotserve.worker.sampler import Sampler
from cotserve.worker.scheduler import Scheduler
from cotserve.worker.sequence import Sequence, SequenceStatus, TraceEvent


class Requests:
    """The engine's requests by id, and everything that ends or extends their samples."""

    def __init__(self, scheduler: Scheduler, sampler: Sampler, metrics: EngineMetrics,
                 control: ReasoningController | None, tokenizer, fmt: ReasoningFormat | None, token_bytes,
                 cache_identity: tuple) -> None:
        self.scheduler, self.sampler, self.metrics, self.control = scheduler, sampler, metrics, control
        self.tokenizer, self.fmt, self.token_bytes = tokenizer, fmt, token_bytes
        self.cache_identity = cache_identity  # what besides tokens and salt decides a KV block's contents
        self.by_id: dict[str, RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def __getitem__(self, request_id: str) -> RequestState:
        return self.by_id[request_id]

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def add(self, cmd: AddRequest, sink: Sink, policy_version: int) -> None:
        """Start a request (checked already): its first sample joins the waiting queue; a request id that is running
        already fails at once."""
        if cmd.request_id in self.by_id:
            sink(RequestOutput(cmd.request_id, 0, "", None, error=f"request_id {cmd.request_id!r} is already running"))
            return
        vote = cmd.budget.self_consistency
        seq = Sequence(cmd.request_id, list(cmd.prompt_ids), cmd.params, cmd.sla_class, arrival_time=cmd.arrival_time,
                       tenant=cmd.tenant, group_size=vote.min_samples if vote is not None else cmd.params.n)
        seq.cache_root = cache_root(self.cache_identity, policy_version, cmd.cache_salt)
        if self.scheduler.long_rope_after is not None and len(seq) > self.scheduler.long_rope_after:
            seq.cache_root = long_rope_root(seq.cache_root)
        req = RequestState(sink, reasoning=cmd.budget, vote=VoteState(vote) if vote is not None else None,
                           detokenize=cmd.detokenize)
        self.by_id[seq.request_id] = req
        self._start_samples(req, seq, seq.group_size)

    def _start_samples(self, req: RequestState, head: Sequence, k: int) -> None:
        self.scheduler.add(req.new_samples(head, k, self.tokenizer, self.token_bytes, self.fmt))

    def abort(self, request_id: str) -> bool:
        """Cancel a request: every sample and probe ends, its blocks freed; False when it is not running."""
        req = self.by_id.pop(request_id, None)
        if req is not None:
            for seq in req.samples:
                self.scheduler.abort(seq)
                self.sampler.forget(seq.seq_id)
            self.drop_probes(req)
            self.metrics.requests_finished += 1
        return req is not None

    def stop_sample(self, request_id: str, index: int) -> None:
        """End sample `index` as stopped, its caller having found a stop string in its text
        (`EngineClient.stop_sample`); nothing when the request or the sample has ended already. Its last output
        carries no token."""
        req = self.by_id.get(request_id)
        if req is None or index >= len(req.samples) or req.samples[index].is_finished:
            return
        out = RequestOutput(request_id, NO_TOKEN, "", None, finish_reason="stop", events=req.new_events(), index=index)
        self._finish_sample(req, req.samples[index], out, time.monotonic())

    def probe_token(self, probe: Sequence, token: int, logprob: float | None, now: float) -> None:
        """An early-exit probe's sampled token; a probe that ends here is retired and its answer weighed."""
        req = self.by_id[probe.request_id]
        computed = probe.num_computed_tokens
        if self.scheduler.append_token(probe, token, logprob) is None:
            return
        self.end_probe(req, probe, SequenceStatus.FINISHED_STOPPED, computed)
        answer_ids = [t for t in probe.output_ids if not self.scheduler.is_stop_token(probe, t)]
        self.carry_out(req, self.control.probe_done(req, probe, answer_ids), now)

    # ---- the reasoning controller's actions ----------------------------------------------------
    def carry_out(self, req: RequestState, actions: list[Action], now: float) -> list[RequestOutput]:
        """Carry out `actions` in order; the last outputs of the samples they cancelled (for the caller to send)."""
        outs: list[RequestOutput] = []
        for action in actions:
            _ACTIONS[type(action)](self, req, action, now, outs)
        return outs

    def _append(self, req: RequestState, action: AppendTokens, now: float, outs: list[RequestOutput]) -> None:
        seq, last = action.seq, len(action.token_ids) - 1
        for i, token in enumerate(action.token_ids):
            ended = self.scheduler.append_token(seq, token)
            if self.emit(seq, token, None, now, finish=action.finish if i == last and action.finish else ended):
                return

    def _fork(self, req: RequestState, action: Fork, now: float, outs: list[RequestOutput]) -> None:
        if self.scheduler.fork_probe(action.probe.probe_of, action.probe):
            req.probes.append(action.probe)

    def _cancel(self, req: RequestState, action: Cancel, now: float, outs: list[RequestOutput]) -> None:
        for s in action.seqs:
            if s.is_probe:
                if s in req.probes:
                    self.end_probe(req, s, SequenceStatus.FINISHED_ABORTED)
                continue
            if s.is_finished:
                continue
            self.scheduler.abort(s)
            self.sampler.forget(s.seq_id)
            self.drop_probes(req, s)
            req.num_unfinished -= 1
            detok = req.detoks[s.index]
            outs.append(RequestOutput(s.request_id, NO_TOKEN, detok.flush() if detok is not None else "", None,
                                      finish_reason="cancelled", index=s.index))
            req.forks = []

    def _start_more(self, req: RequestState, action: StartSamples, now: float, outs: list[RequestOutput]) -> None:
        self._start_samples(req, req.samples[0], action.count)

    def end_probe(self, req: RequestState, probe: Sequence, status: SequenceStatus, computed: int | None = None) -> None:
        """Retire a probe and count the tokens it computed (its forced end marker and decoded tokens); `computed`:
        its computed tokens when the scheduler has finished it already (freeing its blocks resets the count)."""
        shared = len(probe.prompt_ids) - probe.num_forced_tokens  # the parent's computed tokens when it forked
        n = max(0, (probe.num_computed_tokens if computed is None else computed) - shared)
        req.num_probe_tokens += n
        self.metrics.probe_tokens += n
        if status == SequenceStatus.FINISHED_ABORTED:
            self.scheduler.abort(probe)
        else:
            self.scheduler.finish(probe, status)
        self.sampler.forget(probe.seq_id)
        req.probes.remove(probe)

    def drop_probes(self, req: RequestState, parent: Sequence | None = None) -> None:
        """Cancel the probes in flight of `parent` (of every sample when None): they can no longer matter."""
        for probe in req.probes_of(parent):
            self.end_probe(req, probe, SequenceStatus.FINISHED_ABORTED)

    # ---- outputs -----------------------------------------------------------------------------------
    def emit(self, seq: Sequence, token: int, logprob: float | None, now: float, finish: str | None = None,
              top: tuple[tuple[int, ...], tuple[float, ...]] | None = None) -> bool:
        """Send one output token of `seq` (appended already, `Scheduler.append_token`) to its request's sink; True
        when it finished the sample: `finish` is how the scheduler ended it ("stop", "length") or how a reasoning
        control ends it on this token, and a stop string in the text ends it too."""
        req = self.by_id[seq.request_id]
        detok, tracker = req.detoks[seq.index], req.tracker(seq)
        if self.scheduler.is_stop_token(seq, token):
            finish, text = "stop", ""
        elif detok is None:  # the caller makes the text
            text = ""
        else:
            text = detok.add_token(token)
            if detok.stopped_by_string:
                finish = "stop"
        part = self.control.observe(tracker, token, text) if tracker is not None else 0
        first = None if req.first_sent else timing_of(req.samples[0])
        req.first_sent = True
        if finish is None:
            req.sink(RequestOutput(seq.request_id, token, text, logprob, timing=first, events=req.new_events(),
                                   index=seq.index, part=part, top_logprobs=top))
            return False
        if detok is not None:
            text += detok.flush()
        reasoning_text = answer_text = None
        if tracker is not None and detok is not None:
            reasoning_text, answer_text = tracker.fmt.split_sample(detok, tracker.thinking_at_start)
        self._finish_sample(req, seq, RequestOutput(seq.request_id, token, text, logprob, finish_reason=finish,
                                                    timing=first, events=req.new_events(), index=seq.index, part=part,
                                                    reasoning_text=reasoning_text, answer_text=answer_text,
                                                    top_logprobs=top), now)
        return True

    def _finish_sample(self, req: RequestState, seq: Sequence, out: RequestOutput, now: float) -> None:
        """End sample `seq` with its last output `out` (finish_reason "stop" or "length"): its blocks freed, a vote's
        ballot counted, and on the request's last sample the usage and timing added and the request retired."""
        status = SequenceStatus.FINISHED_STOPPED if out.finish_reason == "stop" else SequenceStatus.FINISHED_LENGTH
        self.scheduler.finish(seq, status)
        self.sampler.forget(seq.seq_id)
        self.drop_probes(req, seq)
        seq.finish_time = now
        req.num_unfinished -= 1
        outs = [out]
        if req.vote is not None:
            outs += self.carry_out(req, self.control.sample_finished(req, seq, out.answer_text), now)
        if not req.num_unfinished:
            del self.by_id[seq.request_id]
            self.metrics.requests_finished += 1
            outs[-1] = self._last_output(req, outs[-1], now)
        for o in outs:
            req.sink(o)

    def _last_output(self, req: RequestState, out: RequestOutput, now: float) -> RequestOutput:
        """The request's last output: `out` with the usage, the timing and the reasoning controls' tallies."""
        head = req.samples[0]
        head.record(TraceEvent.FINISHED)
        reasoning_tokens = sum(t.num_reasoning_tokens for t in req.trackers)
        self.metrics.reasoning_tokens += reasoning_tokens
        return dataclasses.replace(
            out, prompt_tokens=len(head.prompt_ids), completion_tokens=sum(len(s.output_ids) for s in req.samples),
            timing=timing_of(head, end=now), events=out.events + req.new_events(),
            cached_prompt_tokens=head.num_cached_tokens, is_last=True, reasoning_tokens=reasoning_tokens,
            probe_tokens=req.num_probe_tokens, early_exits=sum(t.exited_early for t in req.trackers),
            vote=self.control.vote_result(req) if req.vote is not None else None)

    def fail(self, seq: Sequence, message: str) -> None:
        """Fail `seq`'s whole request: every sample ends and frees its blocks."""
        req = self.by_id.pop(seq.request_id, None)
        for s in [*req.samples, *req.probes] if req is not None else [seq]:
            if not s.is_finished:
                self.scheduler.finish(s, SequenceStatus.FINISHED_ERROR)
            self.sampler.forget(s.seq_id)
        if req is not None:
            self.metrics.requests_finished += 1
            req.sink(RequestOutput(seq.request_id, 0, "", None, error=message))


_ACTIONS: dict[type, Callable[..., None]] = {
    AppendTokens: Requests._append, Fork: Requests._fork, Cancel: Requests._cancel, StartSamples: Requests._start_more,
}
"""The method that carries out each kind of reasoning action."""
