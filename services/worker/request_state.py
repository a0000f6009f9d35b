"""One request's state inside the engine: its samples (sequences), their detokenizers and reasoning trackers, the
early-exit probes in flight and its self-consistency vote. No torch, no grpc.

A request with n > 1 samples is one sequence until its prompt is computed; in the step that samples its first
token, the other n - 1 samples fork from it (they share its KV blocks, copy-on-write) and each draws its first token
from the same logits with its own generator. From then on every sample is a sequence of its own: scheduled,
preempted (recomputed later, its prompt's blocks taken from the prefix cache while they are still there) and
finished on its own; the request ends when its last sample does, and cancelling it ends every sample.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cotserve.common.sampling import ReasoningParams
from cotserve.worker.detokenizer import IncrementalDetokenizer, TokenBytes
from cotserve.worker.outputs import Sink
from cotserve.worker.reasoning import ReasoningFormat, ThinkingTracker, VoteState
from cotserve.worker.sequence import SamplingParams, Sequence, TraceEvent


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of a request draws from seed + index, when the request has a seed."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2**64)


@dataclass(slots=True, eq=False)
class RequestState:
    """One request's samples; `samples[0]` is the sequence the others fork from."""

    sink: Sink
    samples: list[Sequence] = field(default_factory=list)
    detoks: list[IncrementalDetokenizer | None] = field(default_factory=list)  # None: the caller detokenizes
    forks: list[Sequence] = field(default_factory=list)  # samples not yet forked from the round's first
    trackers: list[ThinkingTracker] = field(default_factory=list)  # per sample, for a reasoning model
    reasoning: ReasoningParams = ReasoningParams()
    probes: list[Sequence] = field(default_factory=list)  # early-exit probes in flight
    vote: VoteState | None = None  # adaptive self-consistency
    num_probe_tokens: int = 0
    num_unfinished: int = 0
    num_events_sent: int = 0
    first_sent: bool = False
    detokenize: bool = True

    def new_events(self) -> tuple[tuple[TraceEvent, int], ...]:
        """The request's trace events (those of samples[0]) since the previous call."""
        events = self.samples[0].events
        out = tuple(events[self.num_events_sent:])
        self.num_events_sent = len(events)
        return out

    def tracker(self, seq: Sequence) -> ThinkingTracker | None:
        """The reasoning tracker of sample `seq` (None for a model without reasoning markers)."""
        return self.trackers[seq.index] if self.trackers else None

    def probes_of(self, parent: Sequence | None) -> list[Sequence]:
        """The probes in flight of `parent` (of every sample when None)."""
        return [p for p in self.probes if parent is None or p.probe_of is parent]

    def new_samples(self, head: Sequence, k: int, tokenizer, token_bytes: TokenBytes | None,
                    fmt: ReasoningFormat | None) -> Sequence:
        """Add `k` samples: `head` (or, for a later self-consistency round, a new sequence of the same prompt, which
        the prefix cache admits) and the k - 1 that fork from it once its prompt is computed. Returns the one to
        schedule."""
        first = len(self.samples)
        base = head.params  # the request's own: sample i draws from its seed + i
        if first:
            head = Sequence(head.request_id, head.prompt_ids, sample_params(base, first), head.sla_class,
                            index=first, arrival_time=head.arrival_time, cache_root=head.cache_root, tenant=head.tenant)
        head.group_size = k
        forks = [Sequence(head.request_id, head.prompt_ids, sample_params(base, i), head.sla_class, index=i,
                          arrival_time=head.arrival_time, cache_root=head.cache_root, tenant=head.tenant)
                 for i in range(first + 1, first + k)]
        for s in (head, *forks):
            self.samples.append(s)
            self.detoks.append(IncrementalDetokenizer(tokenizer, s.prompt_ids, s.params.stop, token_bytes,
                                                      fmt.channels(s.prompt_ids) if fmt is not None else None)
                               if self.detokenize else None)
            if fmt is not None:
                self.trackers.append(ThinkingTracker(fmt, self.reasoning, s.prompt_ids))
        self.forks = forks
        self.num_unfinished += k
        if self.vote is not None:
            self.vote.started += k
        return head
