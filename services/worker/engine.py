"""The engine core: schedule -> run -> sample -> update, on its own thread.

The thread-safe API (`submit`, `abort`, `stop_sample`, `pause_batch`, the MoE policy and load) queues typed
commands (`commands.py`) that the engine thread applies between two steps; the engine process feeds the same
commands from its pipe (`post`). Each request's outputs go to the sink it was submitted with, called on the engine
thread. The parts beside the core: `Requests` (each request's samples, outputs and ending: `requests.py`), the
reasoning controller (budgets, probes, votes: `reasoning_control.py`, whose actions `Requests` carries out),
`EngineMetrics` (the counters and the stats snapshot) and the scheduling policy (`scheduling.py`).
"""

from __future__ import annotations

import dataclasses

import logging
import threading
import time
from typing import Callable

from cotserve.worker.block_manager import BlockManager
from cotserve.worker.commands import AddRequest, Command, Inbox
from cotserve.worker.detokenizer import TokenBytes
from cotserve.worker.engine_client import EngineClient
from cotserve.worker.engine_config import EngineConfig, kv_spec_of
from cotserve.worker.engine_metrics import EngineMetrics, EngineStats
from cotserve.worker.grammar import fill_masks
from cotserve.worker.model_runner import ModelRunner
from cotserve.worker.models.loader import LoadedModel
from cotserve.worker.models.moe import RoutingPolicy
from cotserve.worker.outputs import RequestOutput, Sink
from cotserve.worker.reasoning import ReasoningFormat
from cotserve.worker.reasoning_control import ReasoningController
from cotserve.worker.requests import Requests
from cotserve.worker.sampler import SampleResult, Sampler
from cotserve.worker.scheduler import ScheduledBatch, Scheduler
from cotserve.worker.scheduling import make_policy
from cotserve.worker.sequence import Sequence, SequenceStatus, TraceEvent

log = logging.getLogger(__name__)


class Engine(EngineClient):
    """One model's engine core (see the module docstring); `run` is its loop."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, reasoning: ReasoningFormat | None = None) -> None:
        self.loaded, self.config = loaded, config
        self.reasoning = reasoning  # the model's reasoning markers; None: budgets are refused upstream
        self.kv_spec = kv_spec_of(config, loaded)
        if config.kv_group_windows != self.kv_spec.windows:  # the pool's shape decides what a request may hold
            config = self.config = dataclasses.replace(config, kv_group_windows=self.kv_spec.windows)
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.kv_spec.windows)
        policy = make_policy(config.scheduling, config.batch_min_share, config.max_batch_tokens_when_urgent)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, policy,
                                   max_model_len=config.max_model_len, eos_token_ids=loaded.eos_token_ids,
                                   long_rope_after=loaded.config.rope_long_after)
        self.runner = ModelRunner(loaded, config.num_blocks, self.kv_spec)
        self.kernels = f"{self.runner.kernels.name} kernels, {loaded.model.layer_ops.name} layer ops"
        """What runs the KV-cache kernels and the layers' small operations (logged when the worker starts serving)."""
        self.sampler = Sampler(loaded.device)
        self.metrics = EngineMetrics()
        self.control = None if reasoning is None else ReasoningController(reasoning, loaded.tokenizer,
                                                                          config.max_model_len, self.metrics)
        # everything besides tokens and salt that decides a KV block's contents (the MoE policy
        # version joins it per sequence): blocks of another format or model never match
        cache_identity = (loaded.revision, self.kv_spec.dtype_name, tuple(sorted(self.kv_spec.skip_layers)),
                          config.block_size)
        self.requests = Requests(self.scheduler, self.sampler, self.metrics, self.control, loaded.tokenizer, reasoning,
                                 TokenBytes.of(loaded.tokenizer), cache_identity)
        self.inbox = Inbox()
        self.policy_version = 0
        self.policy_listeners: list[Callable[[int], None]] = []  # called on the engine thread after each apply
        self._stats = EngineStats(kv_blocks_free=config.num_blocks, kernels_ready=self.runner.warmed.is_set())
        self._thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.after_iteration: Callable[[], None] | None = None
        """Called on the engine thread after each pass of the loop (inbox drained, a step run): the engine
        process flushes the outputs and stats of that pass to its front in one message."""
        self.default_sink: Sink | None = None  # where an AddRequest queued without a sink (from a pipe) sends outputs
        self.expert_load_reply: Callable[[int, dict[int, list[int]]], None] = self.answer_expert_load
        self._init_client()

    # ---- thread-safe API (EngineClient's, with:) -------------------------------------------
    def _send(self, cmd: Command, sink: Sink | None = None) -> None:
        self.inbox.post(cmd, sink)

    def post(self, cmd: Command) -> None:
        """Queue a command as it came (the engine process's pipe): an AddRequest's outputs go to `default_sink`."""
        self.inbox.post(cmd)

    def start(self) -> None:
        """Run the loop on a thread of its own (the in-process engine; the engine process uses `run`)."""
        self._thread = threading.Thread(target=self.run, name="cotserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the loop after its current step (from any thread); joins the thread `start` made."""
        self.stopping.set()
        self.inbox.post(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # ---- engine thread: commands -------------------------------------------------------------
    def run(self) -> None:
        """The engine loop, on the calling thread, until `stop`. Run it on the thread that built the engine when you
        can: torch's CPU kernels keep one OpenMP thread team per calling thread, and two teams on the same cores (the
        builder's, idle, and the loop's) slow every step."""
        while not self.stopping.is_set():
            self.drain_inbox(block=not self.scheduler.has_work())
            if self.scheduler.has_work():
                self.step()
            elif not self._stats.kernels_ready and self.runner.warmed.is_set():
                self._publish_stats()  # (an idle engine says so within one inbox wait)
            if self.after_iteration is not None:
                self.after_iteration()

    def drain_inbox(self, block: bool) -> None:
        """Apply the queued commands (with `block`, waiting a moment for the first)."""
        self.inbox.drain(self, block)

    def apply_policy(self, policy: RoutingPolicy) -> None:
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

    def add(self, cmd: AddRequest, sink: Sink | None) -> None:
        sink = sink or self.default_sink
        try:
            self.check(cmd)
        except ValueError as exc:  # checked before it was queued; should it still happen: report, do not die
            sink(RequestOutput(cmd.request_id, 0, "", None, error=str(exc)))
            return
        self.requests.add(cmd, sink, self.policy_version)

    def abort_now(self, request_id: str) -> None:
        if self.requests.abort(request_id):
            self._publish_stats()

    def stop_sample_now(self, request_id: str, index: int) -> None:
        self.requests.stop_sample(request_id, index)

    # ---- engine thread: the step -------------------------------------------------------------
    def step(self) -> None:
        """One iteration for the whole batch. A failure fails that batch's requests, not the engine."""
        start = time.monotonic()
        batch = self.scheduler.schedule()
        for victim in batch.preempted:
            if victim.is_probe and victim.request_id in self.requests:  # a probe is not worth recomputing: drop it
                self.requests.end_probe(self.requests[victim.request_id], victim, SequenceStatus.FINISHED_ABORTED)
        if not batch:
            time.sleep(0.001)  # nothing fits right now (cannot persist: running work frees blocks)
            self._publish_stats()
            return
        self.metrics.kv_blocks_peak = max(self.metrics.kv_blocks_peak, self.block_manager.num_used_blocks)
        for item in batch.items:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = start
        try:
            logits = self.runner.execute(batch)
            rows, sampling = self._sampling_rows([i.seq for i in batch.items if i.samples])
            if len(rows) != logits.shape[0]:
                logits = logits[rows]  # a prompt's samples all draw from its last row
            reqs = [self.requests[s.request_id] for s in sampling]
            result = self.sampler.sample(
                logits, [s.seq_id for s in sampling], [s.params for s in sampling],
                [ReasoningController.banned_token(r, s) for r, s in zip(reqs, sampling)],
                [s.params.logprobs or ReasoningController.wants_logprob(r, s) for r, s in zip(reqs, sampling)],
                self._grammar_masks(sampling),
                [(s.prompt_ids, s.output_ids) for s in sampling] if any(s.params.penalizes for s in sampling) else None)
        except Exception as exc:  # noqa: BLE001 - the engine must keep serving other requests
            log.exception("engine step failed; failing %d requests", len(batch.items))
            for item in batch.items:
                self.requests.fail(item.seq, f"engine step failed: {exc}")
            self._publish_stats()
            return
        self._update(batch, sampling, result)
        self.metrics.step_done(time.monotonic() - start)
        self._publish_stats()

    def _grammar_masks(self, sampling: list[Sequence]) -> tuple | None:
        """Structured output: the step's token bitmask and the rows it constrains, or None when no row is (a
        sequence's grammar state is made when it first samples, from the tokens it has: forks and probes too)."""
        if all(s.params.structured is None for s in sampling):
            return None
        grammars = self.grammar_compiler()
        for s in sampling:
            if s.params.structured is not None and s.grammar is None:
                s.grammar = grammars.state(s.params.structured, self.reasoning, s.prompt_ids, s.output_ids)
        mask, rows = fill_masks(grammars, [s.grammar for s in sampling])
        return (mask, rows) if rows else None

    def _sampling_rows(self, sampling: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """Logits row and sequence of each token to sample: a sequence whose samples fork now
        brings them along, on its own row."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for row, seq in enumerate(sampling):
            group = [seq, *self.requests[seq.request_id].forks] if seq.group_size > 1 else [seq]
            rows.extend([row] * len(group))
            seqs.extend(group)
        return rows, seqs

    def _update(self, batch: ScheduledBatch, sampling: list[Sequence], result: SampleResult) -> None:
        """After the forward pass: tokens computed, samples forked, each sampled token appended and sent out, and the
        reasoning controller's actions for it carried out."""
        now = time.monotonic()
        tops = result.top or [None] * len(sampling)
        for item in batch.items:
            if not item.seq.is_probe:
                start, prompt_len = item.seq.num_computed_tokens, len(item.seq.prompt_ids)
                self.metrics.prompt_tokens_computed += max(0, min(start + item.num_tokens, prompt_len) - start)
        self.scheduler.advance(batch)
        for seq in sampling:
            if seq.group_size > 1:  # its prompt is computed: the other samples fork from it now
                req = self.requests[seq.request_id]
                self.scheduler.fork(seq, req.forks)
                req.forks = []
        generated = 0
        for seq, token, lp, top in zip(sampling, result.token_ids, result.logprobs, tops):
            if seq.is_finished:  # cancelled earlier in this loop (a settled vote, an early exit)
                continue
            if seq.is_probe:
                self.requests.probe_token(seq, token, lp, now)
                continue
            generated += 1
            ended = self.scheduler.append_token(seq, token, lp)  # finished here on a stop token or at its length
            if seq.first_token_time is None:
                seq.first_token_time = now
                seq.record(TraceEvent.FIRST_TOKEN)
            if self.requests.emit(seq, token, lp if seq.params.logprobs else None, now, finish=ended, top=top):
                continue
            req = self.requests[seq.request_id]
            if req.trackers:
                self.requests.carry_out(req, self.control.after_token(req, seq), now)
        self.metrics.tokens_generated(now, generated)

    def _publish_stats(self) -> None:
        self._stats = self.metrics.snapshot(self.scheduler, self.policy_version, self.runner.warmed.is_set())
