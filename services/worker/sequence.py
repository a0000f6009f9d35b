"""Per-request state inside the engine. No torch, no grpc."""

# SamplingParams and SlaClass are shared with the gateway; re-exported here for the engine.

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from cotserve.common.sampling import SamplingParams, SlaClass


class TraceEvent(enum.StrEnum):
    """What happened to a request in the engine, as its trace records it (the worker's span events; the telemetry
    service's trace check looks for them by these names)."""

    SCHEDULED = "scheduled"  # admitted to the running batch (again after a preemption)
    FIRST_TOKEN = "first_token"  # its first output token was sampled
    PREEMPTED = "preempted"  # its blocks were freed for more urgent work; it waits to be recomputed
    FINISHED = "finished"  # its last sample ended


class SequenceStatus(enum.IntEnum):
    """Ordered: everything past PREEMPTED is finished, so `status > PREEMPTED` says done."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED


_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens and progress.

    Invariant: `num_computed_tokens <= len(self)`; the KV cache holds exactly the first
    `num_computed_tokens` tokens, in the blocks of `block_table`, in order (and of each of `group_tables` where the
    cache keeps layer groups apart: `kv_spec.KvGroup`; a sliding-window group's pages out of every future query's window
    are given back and read `block_manager.RELEASED`).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sla_class: SlaClass = SlaClass.INTERACTIVE
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # the first KV group's pages (every layer's with one group)
    group_tables: list[list[int]] = field(default_factory=list)  # the other KV groups' pages, a table each
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    kv_used_fraction_at_admission: float = 0.0  # of the KV pool, when first admitted (before its own blocks)
    first_token_time: float | None = None
    finish_time: float | None = None
    events: list[tuple[TraceEvent, int]] = field(default_factory=list)  # (event, wall-clock ns) for the trace
    index: int = 0  # which of its request's samples this is (n > 1)
    group_size: int = 1  # batch seats it will take: 1 + the samples that fork from it once its prompt is computed
    cache_root: bytes = b""  # root of its block-hash chain: model, KV format and salt (see BlockManager)
    block_hashes: list[bytes] = field(default_factory=list)  # hash of each full block of its tokens, computed lazily
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    probe_of: "Sequence | None" = None  # an early-exit probe: the sample it forked from (never in the output)
    num_forced_tokens: int = 0  # a probe: the end-marker tokens it was given
    tenant: str = ""  # who the request is for (tenant-fair scheduling)
    fair_tag: float = 0.0  # tenant-fair scheduling's virtual start time, fixed when it first joins the queue
    grammar: Any = None  # structured output: its place in the format's grammar (`grammar.GrammarState`), once sampled

    @property
    def is_probe(self) -> bool:
        return self.probe_of is not None

    def append(self, token: int, logprob: float | None = None) -> None:
        """One output token joins the sequence (and its grammar state, if it has one)."""
        self.output_ids.append(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.grammar is not None:
            self.grammar.accept(token)

    def record(self, event: TraceEvent) -> None:
        self.events.append((event, time.time_ns()))

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, i: int) -> int:
        """`all_token_ids[i]` without building the list."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_len(self) -> int:
        """Length the sequence may reach at most (prompt + max_new_tokens)."""
        return len(self.prompt_ids) + self.params.max_new_tokens
