"""The engine: schedule -> run -> sample -> postprocess, on its own thread.

`submit` and `abort` are thread-safe and return at once; they queue work that the engine thread
applies between two steps. Each request's outputs go to the `sink` it was submitted with, called
on the engine thread (the servicer's sink hops onto its asyncio loop).

A request with n > 1 samples is one sequence until its prompt is computed; in the step that
samples its first token, the other n - 1 samples fork from it (they share its KV blocks,
copy-on-write) and each draws its first token from the same logits with its own generator. From
then on every sample is a sequence of its own: scheduled, preempted (recomputed later, its
prompt's blocks taken from the prefix cache while they are still there) and finished on its own;
the request ends when its last sample does, and cancelling it ends every sample.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from cotserve.common.sampling import ReasoningParams
from cotserve.common.stats import percentile
from cotserve.worker.block_manager import BlockManager, cache_root
from cotserve.worker.config import WorkerConfig
from cotserve.worker.detokenizer import IncrementalDetokenizer, TokenBytes
from cotserve.worker.kv_spec import KvCacheSpec
from cotserve.worker.model_runner import ModelRunner
from cotserve.worker.models.loader import LoadedModel
from cotserve.worker.models.moe import RoutingPolicy
from cotserve.worker.reasoning import (
    Ballot, ReasoningFormat, ThinkingTracker, VoteEntry, VoteState, confidence, mean_probability, tally,
)
from cotserve.worker.sampler import SampleResult, Sampler
from cotserve.worker.scheduler import ScheduledBatch, Scheduler, check_batch_pause
from cotserve.worker.sequence import SamplingParams, Sequence, SequenceStatus, SlaClass

log = logging.getLogger(__name__)


_WORKER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """What the engine runs with, resolved for one loaded model (`sizing.engine_config`). Every setting but the
    pool's size and the context length is a WorkerConfig field, whose default and help are the only ones."""

    num_blocks: int
    block_size: int = _WORKER_DEFAULTS["block_size"]
    max_num_seqs: int = _WORKER_DEFAULTS["max_num_seqs"]
    max_num_batched_tokens: int = _WORKER_DEFAULTS["max_num_batched_tokens"]
    max_model_len: int = 2048  # resolved: the worker's max_model_len, or the model's context when that is none
    batch_min_share: float = _WORKER_DEFAULTS["batch_min_share"]
    scheduling: str = _WORKER_DEFAULTS["scheduling"]
    max_batch_tokens_when_urgent: int = _WORKER_DEFAULTS["max_batch_tokens_when_urgent"]
    batch_yields_to_urgent_prompts: bool = _WORKER_DEFAULTS["batch_yields_to_urgent_prompts"]
    kv_cache_dtype: str = _WORKER_DEFAULTS["kv_cache_dtype"]
    kv_topk_pages: int = _WORKER_DEFAULTS["kv_topk_pages"]
    kv_skip_layers: tuple[int, ...] = _WORKER_DEFAULTS["kv_skip_layers"]
    kv_topk_dense_layers: tuple[int, ...] = _WORKER_DEFAULTS["kv_topk_dense_layers"]
    enable_prefix_caching: bool = _WORKER_DEFAULTS["enable_prefix_caching"]


@dataclass(slots=True, frozen=True)
class Timing:
    queue_ms: float
    ttft_ms: float
    total_ms: float
    kv_used_fraction_at_admission: float = 0.0


STEP_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds of the engine-step latency histogram's buckets, in seconds."""


@dataclass(slots=True)
class RequestOutput:
    """One generated token of one sample (`index`) of a request. `finish_reason` ("stop"/"length")
    is set on each sample's last token; `is_last` on the request's last output, which carries the
    usage (the prompt once, completion tokens summed over the samples) and the timing.

    Not frozen, but never changed once a sink has it (`dataclasses.replace` makes another; the front's `FrontText`
    fills in the text of one it has just unpickled, before its sink sees it): one is made per token in the engine
    and again in the worker front (unpickled), and a frozen dataclass's `__init__` (a `object.__setattr__` per
    field) took 3.3 us to this one's 0.45."""

    request_id: str
    token_id: int
    text: str
    logprob: float | None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timing: Timing | None = None
    error: str | None = None  # set when the request failed inside the engine
    events: tuple[tuple[str, int], ...] = ()  # engine events since the previous output: (name, wall ns)
    index: int = 0
    cached_prompt_tokens: int = 0  # on the last output: prompt tokens found in the prefix cache
    is_last: bool = False
    part: int = 0  # reasoning.Part of the token; 0 for a model without reasoning markers
    reasoning_text: str | None = None  # on each sample's last output, for a reasoning model
    answer_text: str | None = None  # likewise
    reasoning_tokens: int = 0  # on the last output: reasoning tokens of every sample
    probe_tokens: int = 0  # on the last output: tokens early-exit probes computed
    early_exits: int = 0  # on the last output: samples whose thinking an early exit ended
    vote: "VoteResult | None" = None  # on the last output, with self-consistency
    top_logprobs: tuple[tuple[int, ...], tuple[float, ...]] | None = None  # with sampling.top_logprobs: (ids, logprobs)

    def __reduce__(self) -> tuple:
        # crosses the engine process's pipe once per token: positional fields pickle in a third less time
        # than the slot-state dict a slots dataclass gets by default
        return (RequestOutput, tuple([getattr(self, f) for f in _OUTPUT_FIELDS]))


_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutput))


@dataclass(slots=True, frozen=True)
class VoteResult:
    """How a request's self-consistency vote ended."""

    answer: str
    votes: tuple[VoteEntry, ...]
    samples_used: int
    samples_cancelled: int
    sample_tokens: tuple[int, ...]
    stop_reason: str
    samples_saved: int = 0  # max_samples minus samples used


NO_TOKEN = -1  # token_id of a cancelled sample's last output: it carries no token


Sink = Callable[[RequestOutput], None]


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running_requests: int = 0  # requests with a sequence in the running batch
    num_waiting_requests: int = 0  # requests with no sequence running (waiting or preempted)
    step_latency_counts: tuple[int, ...] = ()  # steps per STEP_LATENCY_BUCKETS_S bucket (the last: above them), since start
    step_latency_sum_s: float = 0.0  # seconds all steps took, since start
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    step_latency_p50_ms: float = 0.0
    step_latency_p95_ms: float = 0.0
    generated_tokens_per_s: float = 0.0
    num_preemptions_total: int = 0
    num_batch_yields_total: int = 0  # steps BATCH sat out for an urgent prompt
    num_batch_paused_steps_total: int = 0  # steps BATCH sat out while paused (`pause_batch`)
    num_requests_finished_total: int = 0
    num_waiting_urgent_seqs: int = 0
    num_generated_tokens_total: int = 0
    moe_policy_version: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_blocks: int = 0
    prefix_cache_evictions: int = 0
    num_prompt_tokens_computed_total: int = 0
    kv_blocks_used_peak: int = 0
    num_reasoning_tokens_total: int = 0
    num_probe_tokens_total: int = 0
    num_early_exits_total: int = 0
    num_thinking_tokens_saved_total: int = 0  # estimated: see Engine._note_thinking
    num_vote_samples_used_total: int = 0
    num_vote_samples_saved_total: int = 0  # max_samples minus samples used, over finished votes
    kernels_ready: bool = True  # the runner's CPU kernels are compiled (see ModelRunner.warmed)


@dataclass(slots=True, eq=False)
class _Request:
    """One request's samples; `samples[0]` is the sequence the others fork from."""

    sink: Sink
    samples: list[Sequence]
    detoks: list[IncrementalDetokenizer | None]  # None per sample when the caller detokenizes (`needs_engine_text`)
    forks: list[Sequence] = field(default_factory=list)  # samples not yet forked from samples[0]
    trackers: list[ThinkingTracker] = field(default_factory=list)  # per sample, for a reasoning model
    reasoning: ReasoningParams = ReasoningParams()
    probes: list[Sequence] = field(default_factory=list)  # early-exit probes in flight
    vote: VoteState | None = None  # adaptive self-consistency
    num_probe_tokens: int = 0
    num_unfinished: int = 1
    num_events_sent: int = 0
    first_sent: bool = False
    detokenize: bool = True

    def new_events(self) -> tuple[tuple[str, int], ...]:
        """The request's trace events (those of samples[0]) since the previous call."""
        events = self.samples[0].events
        out = tuple(events[self.num_events_sent :])
        self.num_events_sent = len(events)
        return out


@dataclass(slots=True, frozen=True)
class _Add:
    seq: Sequence
    sink: Sink
    cache_salt: str
    budget: ReasoningParams
    detokenize: bool = True


@dataclass(slots=True, frozen=True)
class _Abort:
    request_id: str


@dataclass(slots=True, frozen=True)
class _StopSample:
    request_id: str
    index: int


@dataclass(slots=True, frozen=True)
class _PauseBatch:
    seconds: float


@dataclass(slots=True, frozen=True)
class _Policy:
    policy: RoutingPolicy


@dataclass(slots=True, frozen=True)
class _TakeLoad:
    callback: Callable[[dict[int, list[int]]], None]


_Command = _Add | _Abort | _StopSample | _PauseBatch | _Policy | _TakeLoad | None  # None only wakes the loop (stop)


def kv_spec_of(config: EngineConfig, loaded: LoadedModel) -> KvCacheSpec:
    """The KV cache format `config`'s settings describe for this model."""
    return KvCacheSpec.resolve(loaded.config, loaded.dtype, config.kv_cache_dtype, config.block_size, config.kv_skip_layers,
                               config.kv_topk_pages, config.kv_topk_dense_layers)


def check_submit(config: EngineConfig, has_reasoning: bool, prompt_len: int, params: SamplingParams,
                 budget: ReasoningParams) -> None:
    """ValueError for a request this engine can never serve: longer than the whole KV pool, more samples than a
    batch holds, or budgets for a model without reasoning markers. (The engine process's front calls it too, so
    that a submit fails at once, not one round trip later.)"""
    capacity = config.num_blocks * config.block_size
    if prompt_len + params.max_new_tokens > capacity:
        raise ValueError(f"prompt_tokens + max_new_tokens = {prompt_len + params.max_new_tokens} exceeds the KV cache "
                         f"({capacity} tokens)")
    if params.n > config.max_num_seqs:
        raise ValueError(f"sampling.n: {params.n} samples, this worker batches at most {config.max_num_seqs} "
                         f"sequences (--max-num-seqs)")
    vote = budget.self_consistency
    if vote is not None and vote.min_samples > config.max_num_seqs:
        raise ValueError(f"reasoning.self_consistency.min_samples: {vote.min_samples} samples run together, this "
                         f"worker batches at most {config.max_num_seqs} sequences (--max-num-seqs)")
    if budget.is_set and not has_reasoning:
        raise ValueError("reasoning: this model has no reasoning markers (start the worker with "
                         "--reasoning-start and --reasoning-end)")


def needs_engine_text(params: SamplingParams, budget: ReasoningParams) -> bool:
    """Whether the engine must detokenize this request as it runs: a vote counts answers (and must see a sample
    end on its stop string at once), and a budget or early exit by reasoning steps counts the step delimiter in the
    text. Any other request's text, reasoning/answer split and stop strings can be handled by the caller from the
    token ids (`FrontText`, with `stop_sample`)."""
    ee = budget.early_exit
    return budget.self_consistency is not None or budget.max_thinking_steps is not None or (
        ee is not None and ee.probe_every_steps is not None)


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, reasoning: ReasoningFormat | None = None) -> None:
        self.loaded = loaded
        self.config = config
        self.reasoning = reasoning  # the model's reasoning markers; None: budgets are refused upstream
        self._forcing_ids: dict[str, list[int]] = {}
        self._token_bytes = TokenBytes.of(loaded.tokenizer)  # the detokenizers' per-token bytes, where they stand alone
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.batch_min_share, by_class=config.scheduling == "priority",
                                   max_batch_tokens_when_urgent=config.max_batch_tokens_when_urgent,
                                   batch_yields_to_urgent_prompts=config.batch_yields_to_urgent_prompts,
                                   max_model_len=config.max_model_len, eos_token_ids=loaded.eos_token_ids)
        self.kv_spec = kv_spec_of(config, loaded)
        self.runner = ModelRunner(loaded, config.num_blocks, self.kv_spec)
        self.kernels = f"{self.runner.kernels.name} kernels, {loaded.model.layer_ops.name} layer ops"
        """What runs the KV-cache kernels and the layers' small operations (logged when the worker starts serving)."""
        self.sampler = Sampler(loaded.device)
        # everything besides tokens and salt that decides a KV block's contents (the MoE policy
        # version joins it per sequence): blocks of another format or model never match
        self._cache_identity = (loaded.revision, self.kv_spec.dtype_name, tuple(sorted(self.kv_spec.skip_layers)),
                                config.block_size)
        self._prompt_tokens_computed = 0
        self._kv_blocks_peak = 0
        self._inbox: queue.Queue[_Command] = queue.Queue()
        self._requests: dict[str, _Request] = {}
        self._step_ms: deque[float] = deque(maxlen=256)
        self._step_counts = [0] * (len(STEP_LATENCY_BUCKETS_S) + 1)
        self._step_sum_s = 0.0
        self._tokens: deque[tuple[float, int]] = deque()
        self._tokens_in_window = 0  # the sum of `_tokens`' counts, kept as they come and go (stats every step)
        self._finished_total = 0
        self._generated_total = 0
        self._reasoning_tokens_total = 0
        self._probe_tokens_total = 0
        self._early_exits_total = 0
        self._thinking_saved_total = 0
        self._natural_thinking = (0, 0)  # (samples, thinking tokens) of samples that ended thinking on their own
        self._vote_used_total = 0
        self._vote_saved_total = 0
        self.policy_version = 0
        self.policy_listeners: list[Callable[[int], None]] = []  # called on the engine thread after each apply
        self._stats = EngineStats(kv_blocks_free=config.num_blocks, kernels_ready=self.runner.warmed.is_set())
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.after_iteration: Callable[[], None] | None = None
        """Called on the engine thread after each pass of the loop (inbox drained, a step run): the engine
        process flushes the outputs and stats of that pass to its front in one message."""

    # ---- thread-safe API -------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink,
               sla_class: SlaClass = SlaClass.INTERACTIVE, cache_salt: str = "",
               budget: ReasoningParams = ReasoningParams(), detokenize: bool = True) -> None:
        """Queue a validated request of `params.n` samples. `cache_salt` separates prefix-cache
        users: blocks cached under one salt are never found under another. Raises ValueError when
        it can never fit the KV pool or the batch, or when `budget` is set for a model without
        reasoning markers. `detokenize=False` (only where `needs_engine_text` is False): outputs carry no text
        and no reasoning/answer split, and a stop string does not end a sample here: the caller makes the text from
        the token ids and ends a sample on its stop string with `stop_sample` (`FrontText`)."""
        check_submit(self.config, self.reasoning is not None, len(prompt_ids), params, budget)
        if not detokenize and needs_engine_text(params, budget):
            raise ValueError("detokenize=False: this request's reasoning controls need its text here")
        vote = budget.self_consistency
        group = vote.min_samples if vote is not None else params.n
        seq = Sequence(request_id, list(prompt_ids), params, sla_class, group_size=group)
        self._inbox.put(_Add(seq, sink, cache_salt, budget, detokenize))

    def set_routing_policy(self, policy: RoutingPolicy) -> None:
        """Queue a routing policy; the engine thread applies it to all layers together between two
        steps, and only when it is newer than the one in force."""
        self._inbox.put(_Policy(policy))

    def request_expert_load(self, callback: Callable[[dict[int, list[int]]], None]) -> None:
        """Ask for the tokens routed per expert since the last ask; `callback` runs on the engine thread."""
        self._inbox.put(_TakeLoad(callback))

    def abort(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are freed before the next step."""
        self._inbox.put(_Abort(request_id))

    def stop_sample(self, request_id: str, index: int) -> None:
        """End sample `index` of a request as stopped ("stop") before the next step: its caller found a stop string
        in the text it makes (`FrontText`). Its last output carries no token; tokens the engine generated after the
        stop string, before this arrived, count in the usage (the caller drops them and their count)."""
        self._inbox.put(_StopSample(request_id, index))

    def pause_batch(self, seconds: float) -> None:
        """Pause BATCH for `seconds` from the next step (`Scheduler.pause_batch`: it sits out every step with
        urgent work; 0 ends a pause). Raises ValueError, naming the allowed range, before anything is queued."""
        check_batch_pause(seconds)
        self._inbox.put(_PauseBatch(seconds))

    def stats(self) -> EngineStats:
        return self._stats

    def start(self) -> None:
        """Run the loop on a thread of its own (the in-process engine; the engine process uses `run`)."""
        self._thread = threading.Thread(target=self.run, name="cotserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the loop after its current step (from any thread); joins the thread `start` made."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # ---- engine thread ---------------------------------------------------------------------
    def run(self) -> None:
        """The engine loop, on the calling thread, until `stop`. Run it on the thread that built the engine
        when you can: torch's CPU kernels keep one OpenMP thread team per calling thread, and two teams on
        the same cores (the builder's, idle, and the loop's) made a step up to twice as slow."""
        while not self._stopping.is_set():
            self._drain_inbox(block=not self.scheduler.has_work())
            if self.scheduler.has_work():
                self.step()
            elif not self._stats.kernels_ready and self.runner.warmed.is_set():
                self._publish_stats()  # (an idle engine says so within one inbox wait)
            if self.after_iteration is not None:
                self.after_iteration()

    def _drain_inbox(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, _Add):
                self._add(cmd.seq, cmd.sink, cmd.cache_salt, cmd.budget, cmd.detokenize)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
            elif isinstance(cmd, _StopSample):
                self._stop_sample(cmd.request_id, cmd.index)
            elif isinstance(cmd, _PauseBatch):
                self.scheduler.pause_batch(cmd.seconds)
            elif isinstance(cmd, _Policy):
                self._apply_policy(cmd.policy)
            elif isinstance(cmd, _TakeLoad):
                cmd.callback(self.loaded.model.take_expert_load())
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply_policy(self, policy: RoutingPolicy) -> None:
        if policy.version <= self.policy_version:
            log.info("routing policy v%d ignored: v%d is in force", policy.version, self.policy_version)
            return
        self.loaded.model.set_routing_policy(policy)
        self.policy_version = policy.version
        # blocks computed under the old routing hold other values: new sequences root their hash
        # chains in the new version, and the old cached blocks are the first to be reused
        self.block_manager.reset_prefix_cache()
        self._publish_stats()
        for listener in tuple(self.policy_listeners):  # a snapshot: listeners may be added meanwhile
            listener(policy.version)

    def _add(self, seq: Sequence, sink: Sink, cache_salt: str = "", budget: ReasoningParams = ReasoningParams(),
             detokenize: bool = True) -> None:
        if seq.request_id in self._requests:
            sink(RequestOutput(seq.request_id, 0, "", None, error=f"request_id {seq.request_id!r} is already running"))
            return
        seq.cache_root = cache_root(self._cache_identity, self.policy_version, cache_salt)
        vote = VoteState(budget.self_consistency) if budget.self_consistency is not None else None
        req = _Request(sink, [], [], reasoning=budget, vote=vote, num_unfinished=0, detokenize=detokenize)
        self._requests[seq.request_id] = req
        self._start_samples(req, seq, seq.group_size)

    def _start_samples(self, req: _Request, head: Sequence, k: int) -> None:
        """Start `k` samples of the request: `head` (or, for a later self-consistency round, a new
        sequence of the same prompt, admitted from the prefix cache) and the k - 1 that fork from it
        once its prompt is computed."""
        first = len(req.samples)
        base = head.params  # the request's own: sample i draws from its seed + i
        if first:
            head = Sequence(head.request_id, head.prompt_ids, self._sample_params(base, first), head.sla_class,
                            index=first, arrival_time=head.arrival_time, cache_root=head.cache_root)
        head.group_size = k
        forks = [Sequence(head.request_id, head.prompt_ids, self._sample_params(base, i), head.sla_class, index=i,
                          arrival_time=head.arrival_time, cache_root=head.cache_root) for i in range(first + 1, first + k)]
        for s in (head, *forks):
            req.samples.append(s)
            req.detoks.append(IncrementalDetokenizer(self.loaded.tokenizer, s.prompt_ids, s.params.stop, self._token_bytes)
                              if req.detokenize else None)
            if self.reasoning is not None:
                req.trackers.append(ThinkingTracker(self.reasoning, req.reasoning, s.prompt_ids))
        req.forks = forks
        req.num_unfinished += k
        if req.vote is not None:
            req.vote.started += k
        self.scheduler.add(head)

    @staticmethod
    def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
        """Sample `index` of a request draws from seed + index, when the request has a seed."""
        if params.seed is None:
            return params
        return dataclasses.replace(params, seed=(params.seed + index) % 2**64)

    def _abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            for seq in req.samples:
                self.scheduler.abort(seq)
                self.sampler.forget(seq.seq_id)
            self._drop_probes(req)
            self._finished_total += 1
            self._publish_stats()

    def step(self) -> None:
        """One iteration for the whole batch. A failure fails that batch's requests, not the engine."""
        start = time.monotonic()
        batch = self.scheduler.schedule()
        for victim in batch.preempted:
            if victim.is_probe and victim.request_id in self._requests:  # a probe is not worth recomputing: drop it
                self._end_probe(self._requests[victim.request_id], victim, SequenceStatus.FINISHED_ABORTED)
        if not batch:
            time.sleep(0.001)  # nothing fits right now (cannot persist: running work frees blocks)
            self._publish_stats()
            return
        self._kv_blocks_peak = max(self._kv_blocks_peak, self.block_manager.num_used_blocks)
        for item in batch.items:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = start
        try:
            logits = self.runner.execute(batch)
            rows, sampling = self._sampling_rows([i.seq for i in batch.items if i.samples])
            if len(rows) != logits.shape[0]:
                logits = logits[rows]  # a prompt's samples all draw from its last row
            result = self.sampler.sample(logits, [s.seq_id for s in sampling], [s.params for s in sampling],
                                         [self._banned_token(s) for s in sampling],
                                         [self._wants_logprob(s) for s in sampling])
        except Exception as exc:  # noqa: BLE001 - the engine must keep serving other requests
            log.exception("engine step failed; failing %d requests", len(batch.items))
            for item in batch.items:
                self._fail(item.seq, f"engine step failed: {exc}")
            self._publish_stats()
            return
        self._postprocess(batch, sampling, result)
        now = time.monotonic()
        self._step_ms.append((now - start) * 1000)
        self._step_counts[bisect.bisect_left(STEP_LATENCY_BUCKETS_S, now - start)] += 1
        self._step_sum_s += now - start
        self._publish_stats()

    def _sampling_rows(self, sampling: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """Logits row and sequence of each token to sample: a sequence whose samples fork now
        brings them along, on its own row."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for row, seq in enumerate(sampling):
            group = [seq, *self._requests[seq.request_id].forks] if seq.group_size > 1 else [seq]
            rows.extend([row] * len(group))
            seqs.extend(group)
        return rows, seqs

    def _banned_token(self, seq: Sequence) -> int | None:
        """A token `seq` may not sample now (the end marker, before its minimum thinking)."""
        req = self._requests[seq.request_id]
        return req.trackers[seq.index].banned_token() if req.trackers and not seq.is_probe else None

    def _wants_logprob(self, seq: Sequence) -> bool:
        """The client asked for logprobs, or a probe or a self-consistency vote needs the confidence."""
        return seq.params.logprobs or seq.is_probe or self._requests[seq.request_id].vote is not None

    def _encode(self, text: str) -> list[int]:
        ids = self._forcing_ids.get(text)
        if ids is None:
            ids = self._forcing_ids[text] = self.loaded.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    # ---- early exit --------------------------------------------------------------------------
    def _launch_probe(self, req: _Request, seq: Sequence) -> None:
        """Fork an early-exit probe of `seq` at the probe point, one step after it, once the point's
        token is computed: the probe shares every computed page (copy-on-write), gets the end marker
        and decodes greedily, in the same batches as everything else; it computes nothing `seq` has.
        Skipped when no seat or block is free now (the next probe point tries again)."""
        ee = req.reasoning.early_exit
        end_ids = self._encode(self.reasoning.end)
        if seq.num_computed_tokens != len(seq) - 1 or len(seq) + len(end_ids) >= self.config.max_model_len:
            return
        probe_params = SamplingParams(max_new_tokens=ee.probe_max_tokens, stop_token_ids=seq.params.stop_token_ids,
                                      ignore_eos=seq.params.ignore_eos)  # greedy, ending where its sample would
        probe = Sequence(seq.request_id, seq.all_token_ids[:-1] + end_ids, probe_params,
                         seq.sla_class, index=seq.index, arrival_time=seq.arrival_time, cache_root=seq.cache_root,
                         probe_of=seq, num_forced_tokens=len(end_ids))
        if self.scheduler.fork_probe(seq, probe):
            req.probes.append(probe)

    def _end_probe(self, req: _Request, probe: Sequence, status: SequenceStatus, computed: int | None = None) -> None:
        """Retire a probe and count the tokens it computed (its forced end marker and decoded tokens); `computed`:
        its computed tokens when the scheduler has finished it already (freeing its blocks resets the count)."""
        shared = len(probe.prompt_ids) - probe.num_forced_tokens  # the parent's computed tokens when it forked
        n = max(0, (probe.num_computed_tokens if computed is None else computed) - shared)
        req.num_probe_tokens += n
        self._probe_tokens_total += n
        if status == SequenceStatus.FINISHED_ABORTED:
            self.scheduler.abort(probe)
        else:
            self.scheduler.finish(probe, status)
        self.sampler.forget(probe.seq_id)
        req.probes.remove(probe)

    def _drop_probes(self, req: _Request, parent: Sequence | None = None) -> None:
        """Cancel the probes in flight of `parent` (of every sample when None): they can no longer matter."""
        for probe in [p for p in req.probes if parent is None or p.probe_of is parent]:
            self._end_probe(req, probe, SequenceStatus.FINISHED_ABORTED)

    def _probe_token(self, probe: Sequence, token: int, logprob: float | None, now: float) -> None:
        req = self._requests[probe.request_id]
        computed = probe.num_computed_tokens
        if self.scheduler.append_token(probe, token, logprob) is None:
            return
        self._end_probe(req, probe, SequenceStatus.FINISHED_STOPPED, computed)
        parent = probe.probe_of
        tracker = req.trackers[parent.index]
        if parent.is_finished or not tracker.is_thinking:
            return
        answer_ids = [t for t in probe.output_ids if not self.scheduler.is_stop_token(probe, t)]
        answer = self.reasoning.answer(self.loaded.tokenizer.decode(answer_ids))
        tracker.probe_answers.append((answer, mean_probability(probe.output_logprobs)))
        if tracker.converged() is None:
            return
        # converged: the sample stops thinking and answers with what its probe decoded
        tracker.exited_early = True  # _emit counts the thinking it saved when the end marker goes out
        self._early_exits_total += 1
        self._drop_probes(req, parent)
        tokens = self._encode(self.reasoning.end) + answer_ids
        tokens = tokens[: max(1, parent.params.max_new_tokens - len(parent.output_ids))]
        for i, t in enumerate(tokens):
            ended = self.scheduler.append_token(parent, t)
            if self._emit(parent, t, None, now, finish="stop" if i == len(tokens) - 1 else ended):
                return

    def _note_thinking(self, tracker: ThinkingTracker) -> None:
        """Thinking tokens saved by early exit are estimated against the mean thinking length of the
        samples that ended their thinking on their own, on this worker so far."""
        n, total = self._natural_thinking
        if tracker.exited_early:
            if n:
                self._thinking_saved_total += max(0, round(total / n) - tracker.num_thinking_tokens)
        elif not tracker.forced_end:
            self._natural_thinking = (n + 1, total + tracker.num_thinking_tokens)

    def _force_end_of_thinking(self, seq: Sequence, now: float) -> None:
        """A thinking budget is spent: append the forcing text as the sample's own tokens (computed
        in the next step, with the next token sampled after them), within max_new_tokens."""
        req = self._requests[seq.request_id]
        self._drop_probes(req, seq)
        req.trackers[seq.index].forced_end = True
        ids = self._encode(req.trackers[seq.index].options.forcing_text or self.reasoning.end)
        for token in ids[: seq.params.max_new_tokens - len(seq.output_ids)]:
            if self._emit(seq, token, None, now, finish=self.scheduler.append_token(seq, token)):
                return

    def _postprocess(self, batch: ScheduledBatch, sampling: list[Sequence], result: SampleResult) -> None:
        now = time.monotonic()
        tops = result.top or [None] * len(sampling)
        for item in batch.items:
            if item.seq.is_probe:
                continue
            start, prompt_len = item.seq.num_computed_tokens, len(item.seq.prompt_ids)
            self._prompt_tokens_computed += max(0, min(start + item.num_tokens, prompt_len) - start)
        self.scheduler.advance(batch)
        for seq in sampling:
            if seq.group_size > 1:  # its prompt is computed: the other samples fork from it now
                req = self._requests[seq.request_id]
                self.scheduler.fork(seq, req.forks)
                req.forks = []
        generated = 0
        for seq, token, lp, top in zip(sampling, result.token_ids, result.logprobs, tops):
            if seq.is_finished:  # cancelled earlier in this loop (a settled vote, an early exit)
                continue
            if seq.is_probe:
                self._probe_token(seq, token, lp, now)
                continue
            generated += 1
            ended = self.scheduler.append_token(seq, token, lp)  # finished here on a stop token or at its length
            if seq.first_token_time is None:
                seq.first_token_time = now
                seq.record("first_token")
            if self._emit(seq, token, lp if seq.params.logprobs else None, now, finish=ended, top=top):
                continue
            req = self._requests[seq.request_id]
            if not req.trackers:
                continue
            tracker = req.trackers[seq.index]
            if tracker.must_stop_thinking():
                self._force_end_of_thinking(seq, now)
                continue
            if tracker.probe_pending and tracker.is_thinking:
                self._launch_probe(req, seq)  # the probe point's token was computed in this step
            tracker.probe_pending = tracker.take_probe_due()
            if not tracker.is_thinking and req.probes:
                self._drop_probes(req, seq)
        self._tokens.append((now, generated))
        self._tokens_in_window += generated
        self._generated_total += generated

    def _emit(self, seq: Sequence, token: int, logprob: float | None, now: float, finish: str | None = None,
              top: tuple[tuple[int, ...], tuple[float, ...]] | None = None) -> bool:
        """Send one output token of `seq` (appended already, `Scheduler.append_token`) to its request's sink; True
        when it finished the sample: `finish` is how the scheduler ended it ("stop", "length") or how a reasoning
        control ends it on this token, and a stop string in the text ends it too."""
        req = self._requests[seq.request_id]
        detok = req.detoks[seq.index]
        tracker = req.trackers[seq.index] if req.trackers else None
        if self.scheduler.is_stop_token(seq, token):
            finish, text = "stop", ""
        elif detok is None:  # the caller makes the text
            text = ""
        else:
            text = detok.add_token(token)
            if detok.stopped_by_string:
                finish = "stop"
        was_thinking = tracker is not None and tracker.is_thinking
        part = int(tracker.observe(token, text)) if tracker is not None else 0
        if was_thinking and not tracker.is_thinking:
            self._note_thinking(tracker)
        first = None if req.first_sent else self._timing(req.samples[0])
        req.first_sent = True
        if finish is None:
            req.sink(RequestOutput(seq.request_id, token, text, logprob, timing=first, events=req.new_events(), index=seq.index,
                                   part=part, top_logprobs=top))
            return False
        if detok is not None:
            text += detok.flush()
        reasoning_text = answer_text = None
        if tracker is not None and detok is not None:
            reasoning_text, answer_text = tracker.fmt.split(detok.text, tracker.thinking_at_start)
        self._finish_sample(req, seq, RequestOutput(seq.request_id, token, text, logprob, finish_reason=finish, timing=first,
                                                    events=req.new_events(), index=seq.index, part=part,
                                                    reasoning_text=reasoning_text, answer_text=answer_text, top_logprobs=top),
                            now)
        return True

    def _finish_sample(self, req: _Request, seq: Sequence, out: RequestOutput, now: float) -> None:
        """End sample `seq` with its last output `out` (finish_reason "stop" or "length"): its blocks freed, a vote's
        ballot counted, and on the request's last sample the usage and timing added and the request retired."""
        self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED if out.finish_reason == "stop" else SequenceStatus.FINISHED_LENGTH)
        self.sampler.forget(seq.seq_id)
        self._drop_probes(req, seq)
        seq.finish_time = now
        req.num_unfinished -= 1
        outs = [out]
        if req.vote is not None:
            outs += self._vote(req, Ballot(out.answer_text or "", confidence(seq.output_logprobs)))
        if req.num_unfinished:
            for o in outs:
                req.sink(o)
            return
        del self._requests[seq.request_id]
        self._finished_total += 1
        head = req.samples[0]
        head.record("finished")
        reasoning_tokens = sum(t.num_reasoning_tokens for t in req.trackers)
        self._reasoning_tokens_total += reasoning_tokens
        outs[-1] = dataclasses.replace(
            outs[-1], prompt_tokens=len(head.prompt_ids), completion_tokens=sum(len(s.output_ids) for s in req.samples),
            timing=self._timing(head, end=now), events=outs[-1].events + req.new_events(),
            cached_prompt_tokens=head.num_cached_tokens, is_last=True, reasoning_tokens=reasoning_tokens,
            probe_tokens=req.num_probe_tokens, early_exits=sum(t.exited_early for t in req.trackers),
            vote=self._vote_result(req) if req.vote is not None else None)
        for o in outs:
            req.sink(o)

    def _stop_sample(self, request_id: str, index: int) -> None:
        """End sample `index` as stopped, its caller having found a stop string in its text (`stop_sample`); nothing
        when the request or the sample has ended already. Its last output carries no token."""
        req = self._requests.get(request_id)
        if req is None or index >= len(req.samples) or req.samples[index].is_finished:
            return
        out = RequestOutput(request_id, NO_TOKEN, "", None, finish_reason="stop", events=req.new_events(), index=index)
        self._finish_sample(req, req.samples[index], out, time.monotonic())

    # ---- adaptive self-consistency -----------------------------------------------------------
    def _vote(self, req: _Request, ballot: Ballot) -> list[RequestOutput]:
        """Count a finished sample's ballot. Once the vote is settled the unfinished samples are
        cancelled (their pages freed) and their last outputs returned; when a round ends unsettled
        the next one starts."""
        vote = req.vote
        vote.ballots.append(ballot)
        reason = vote.settled()
        if reason is None and req.num_unfinished == 0:
            if vote.started < vote.params.max_samples:
                self._start_samples(req, req.samples[0], min(vote.params.min_samples, vote.params.max_samples - vote.started))
                return []
            reason = "max_samples"
        if reason is None:
            return []
        vote.stop_reason = reason
        cancelled = []
        for s in req.samples:
            if s.is_finished:
                continue
            self.scheduler.abort(s)
            self.sampler.forget(s.seq_id)
            self._drop_probes(req, s)
            req.num_unfinished -= 1
            vote.cancelled += 1
            cancelled.append(RequestOutput(s.request_id, NO_TOKEN, req.detoks[s.index].flush(), None,
                                           finish_reason="cancelled", index=s.index))
        req.forks = []
        return cancelled

    def _vote_result(self, req: _Request) -> VoteResult:
        vote = req.vote
        used = len(vote.ballots)
        self._vote_used_total += used
        self._vote_saved_total += max(0, vote.params.max_samples - used)
        return VoteResult(vote.answer(), tuple(tally(vote.ballots, vote.params)), used, vote.cancelled,
                          tuple(len(s.output_ids) for s in req.samples), vote.stop_reason, vote.params.max_samples - used)

    @staticmethod
    def _timing(seq: Sequence, end: float | None = None) -> Timing:
        def ms(t: float | None) -> float:
            return 0.0 if t is None else (t - seq.arrival_time) * 1000

        return Timing(queue_ms=ms(seq.first_scheduled_time), ttft_ms=ms(seq.first_token_time), total_ms=ms(end),
                      kv_used_fraction_at_admission=seq.kv_used_fraction_at_admission)

    def _fail(self, seq: Sequence, message: str) -> None:
        """Fail `seq`'s whole request: every sample ends and frees its blocks."""
        req = self._requests.pop(seq.request_id, None)
        for s in [*req.samples, *req.probes] if req is not None else [seq]:
            if not s.is_finished:
                self.scheduler.finish(s, SequenceStatus.FINISHED_ERROR)
            self.sampler.forget(s.seq_id)
        if req is not None:
            self._finished_total += 1
            req.sink(RequestOutput(seq.request_id, 0, "", None, error=message))

    def _publish_stats(self) -> None:
        now = time.monotonic()
        while self._tokens and now - self._tokens[0][0] > 10.0:
            self._tokens_in_window -= self._tokens.popleft()[1]
        span = max(1e-3, now - self._tokens[0][0]) if len(self._tokens) > 1 else 1.0
        steps = sorted(self._step_ms)  # once for both percentiles
        bm = self.block_manager
        sched = self.scheduler
        running = {s.request_id for s in sched.running if not s.is_probe}  # the batch, not the queue: no O(waiting) work
        waiting = sched.waiting_requests
        self._stats = EngineStats(
            num_running_requests=len(running),
            num_waiting_requests=len(waiting) - sum(r in waiting for r in running),
            step_latency_counts=tuple(self._step_counts), step_latency_sum_s=self._step_sum_s,
            num_running_seqs=len(self.scheduler.running),
            num_waiting_seqs=len(self.scheduler.waiting),
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_free=self.block_manager.num_free_blocks,
            step_latency_p50_ms=percentile(steps, 50, empty=0.0),
            step_latency_p95_ms=percentile(steps, 95, empty=0.0),
            generated_tokens_per_s=self._tokens_in_window / span if self._tokens else 0.0,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_batch_yields_total=self.scheduler.num_batch_yields_total,
            num_batch_paused_steps_total=self.scheduler.num_batch_paused_steps_total,
            num_requests_finished_total=self._finished_total,
            num_generated_tokens_total=self._generated_total,
            moe_policy_version=self.policy_version,
            num_waiting_urgent_seqs=sched.num_waiting_urgent,
            prefix_cache_queried_tokens=bm.num_queried_tokens, prefix_cache_hit_tokens=bm.num_hit_tokens,
            prefix_cache_blocks=bm.num_cached_blocks, prefix_cache_evictions=bm.num_evictions,
            num_prompt_tokens_computed_total=self._prompt_tokens_computed, kv_blocks_used_peak=self._kv_blocks_peak,
            num_reasoning_tokens_total=self._reasoning_tokens_total, num_probe_tokens_total=self._probe_tokens_total,
            num_early_exits_total=self._early_exits_total, num_thinking_tokens_saved_total=self._thinking_saved_total,
            num_vote_samples_used_total=self._vote_used_total, num_vote_samples_saved_total=self._vote_saved_total,
            kernels_ready=self.runner.warmed.is_set(),
        )
