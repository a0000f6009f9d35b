"""The engine's thread-safe API, written once as commands (`commands.py`): the in-thread `Engine` queues them in its
inbox, the engine process's front (`EngineProcess`) sends them down its pipe. Each checks what it can at once, so
that a request the engine can never serve fails in the caller, not a step later."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

from cotserve.common.sampling import ReasoningParams
from cotserve.worker.commands import (
    AbortRequest, AddRequest, Command, PauseBatch, SetPolicy, StopSample, TakeExpertLoad,
)
from cotserve.worker.engine_config import EngineConfig, check_submit, needs_engine_text
from cotserve.worker.engine_metrics import EngineStats
from cotserve.worker.grammar import Grammars, grammars_for
from cotserve.worker.outputs import Sink
from cotserve.worker.reasoning import ReasoningFormat
from cotserve.worker.scheduler import check_batch_pause
from cotserve.worker.sequence import SamplingParams, SlaClass

ExpertLoadCallback = Callable[[dict[int, list[int]]], None]


class EngineClient:
    """Subclasses set `config`, `reasoning` and `_stats`, and say how a command travels (`_send`)."""

    config: EngineConfig | None
    reasoning: ReasoningFormat | None  # the model's reasoning markers; None: budgets are refused
    _stats: EngineStats
    loaded: Any = None  # the model (its tokenizer compiles structured-output formats here: `grammar.Grammars`)
    grammars: Grammars | None = None

    def _send(self, cmd: Command, sink: Sink | None = None) -> None:
        """Deliver `cmd` to the engine thread (`sink`: where an AddRequest's outputs go)."""
        raise NotImplementedError

    def _init_client(self) -> None:
        """Call once from the subclass's constructor."""
        self._load_callbacks: dict[int, ExpertLoadCallback] = {}  # request_expert_load's callbacks by ticket
        self._tickets = itertools.count(1)
        self._load_lock = threading.Lock()

    def check(self, cmd: AddRequest) -> None:
        """ValueError for a request this engine can never serve (`engine_config.check_submit`), or whose text it must
        make itself when told not to."""
        assert self.config is not None, "start() first"
        check_submit(self.config, self.reasoning is not None, len(cmd.prompt_ids), cmd.params, cmd.budget)
        if cmd.params.structured is not None and self.loaded is not None:  # compiled (and cached) before any compute
            self.grammar_compiler().compile(cmd.params.structured)
        if not cmd.detokenize and needs_engine_text(cmd.params, cmd.budget):
            raise ValueError("detokenize=False: this request's reasoning controls need its text here")

    def grammar_compiler(self) -> Grammars:
        """The model's structured-output compiler (`grammar.Grammars`), made on first use."""
        if self.grammars is None:
            self.grammars = grammars_for(self.loaded, self.reasoning)
        return self.grammars

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink,
               sla_class: SlaClass = SlaClass.INTERACTIVE, cache_salt: str = "",
               budget: ReasoningParams = ReasoningParams(), detokenize: bool = True, tenant: str = "") -> None:
        """Queue a request of `params.n` samples for `tenant`. `cache_salt` separates prefix-cache users: blocks cached under one
        salt are never found under another. Raises ValueError when it can never fit the KV pool or the batch, or when
        `budget` is set for a model without reasoning markers. `detokenize=False` (only where `needs_engine_text` is
        False): outputs carry no text and no reasoning/answer split, and a stop string does not end a sample in the
        engine: the caller makes the text from the token ids and ends a sample on its stop string with
        `stop_sample` (`FrontText`)."""
        cmd = AddRequest(request_id, list(prompt_ids), params, sla_class, cache_salt, budget, detokenize, tenant)
        self.check(cmd)
        self._send(cmd, sink)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are freed before the next step."""
        self._send(AbortRequest(request_id))

    def stop_sample(self, request_id: str, index: int) -> None:
        """End sample `index` of a request as stopped ("stop") before the next step: its caller found a stop string
        in the text it makes (`FrontText`). Its last output carries no token; tokens the engine generated after the
        stop string, before this arrived, count in the usage (the caller drops them and their count)."""
        self._send(StopSample(request_id, index))

    def pause_batch(self, seconds: float) -> None:
        """Pause BATCH for `seconds` from the next step (`Scheduler.pause_batch`: it sits out every step with urgent
        work; 0 ends a pause). Raises ValueError, naming the allowed range, before anything is sent."""
        check_batch_pause(seconds)
        self._send(PauseBatch(seconds))

    def set_routing_policy(self, policy) -> None:
        """Send a MoE routing policy (`models.moe.RoutingPolicy`); the engine applies it to all layers together
        between two steps, and only when it is newer than the one in force."""
        self._send(SetPolicy(policy))

    def request_expert_load(self, callback: ExpertLoadCallback) -> None:
        """Ask for the tokens routed per expert since the last ask; `callback` gets them (on the engine's thread, or
        the front's reader thread)."""
        with self._load_lock:
            ticket = next(self._tickets)
            self._load_callbacks[ticket] = callback
        self._send(TakeExpertLoad(ticket))

    def answer_expert_load(self, ticket: int, load: dict[int, list[int]]) -> None:
        """The engine's answer to `request_expert_load`'s `ticket`."""
        with self._load_lock:
            callback = self._load_callbacks.pop(ticket, None)
        if callback is not None:
            callback(load)

    def stats(self) -> EngineStats:
        """The latest stats snapshot (immutable: any thread may read it)."""
        return self._stats
