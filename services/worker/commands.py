"""The commands an engine takes between two steps, defined once: the in-thread engine's inbox and the engine
process's pipe carry the same objects, and one table (`HANDLERS`) says which engine method applies each.

Commands are plain frozen dataclasses, so they pickle across the pipe. Two of them answer through the engine rather
than through a callback they carry (a callback cannot cross a process): `AddRequest` sends its outputs to the sink
it was queued with (`Engine.submit`) or, from the pipe, to the engine's `default_sink`; `TakeExpertLoad` answers
with its ticket (`Engine.expert_load_reply`)."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from cotserve.common.sampling import ReasoningParams
from cotserve.worker.sequence import SamplingParams, SlaClass

if TYPE_CHECKING:
    from cotserve.worker.engine import Engine
    from cotserve.worker.outputs import Sink


@dataclass(slots=True, frozen=True)
class AddRequest:
    """Start a request of `params.n` samples (validated by `engine_config.check_submit` before it was queued)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sla_class: SlaClass = SlaClass.INTERACTIVE
    cache_salt: str = ""  # prefix-cache partition: blocks cached under one salt are never found under another
    budget: ReasoningParams = ReasoningParams()
    detokenize: bool = True  # False: the caller makes the text (`front_text.FrontText`)
    tenant: str = ""  # who the request is for (tenant-fair scheduling)
    arrival_time: float = field(default_factory=time.monotonic)  # when the worker took it (one clock per machine)


@dataclass(slots=True, frozen=True)
class AbortRequest:
    """Cancel a request: every sample ends and frees its blocks before the next step."""

    request_id: str


@dataclass(slots=True, frozen=True)
class StopSample:
    """End one sample as stopped: its caller found a stop string in the text it makes."""

    request_id: str
    index: int


@dataclass(slots=True, frozen=True)
class PauseBatch:
    """Pause BATCH for `seconds` (checked by the sender: `scheduler.check_batch_pause`); 0 ends a pause."""

    seconds: float


@dataclass(slots=True, frozen=True)
class SetPolicy:
    """Apply a MoE routing policy to every layer, when it is newer than the one in force."""

    policy: Any  # models.moe.RoutingPolicy (not imported here: it needs torch)


@dataclass(slots=True, frozen=True)
class TakeExpertLoad:
    """Report the tokens routed per expert since the last report, answered with `ticket`."""

    ticket: int


@dataclass(slots=True, frozen=True)
class Shutdown:
    """End the loop after the current step."""


Command = AddRequest | AbortRequest | StopSample | PauseBatch | SetPolicy | TakeExpertLoad | Shutdown


def _add(engine: Engine, cmd: AddRequest, sink: Sink | None) -> None:
    engine.add(cmd, sink)


HANDLERS: dict[type, Callable[[Engine, Any, Sink | None], None]] = {
    AddRequest: _add,
    AbortRequest: lambda engine, cmd, _: engine.abort_now(cmd.request_id),
    StopSample: lambda engine, cmd, _: engine.stop_sample_now(cmd.request_id, cmd.index),
    PauseBatch: lambda engine, cmd, _: engine.scheduler.pause_batch(cmd.seconds),
    SetPolicy: lambda engine, cmd, _: engine.apply_policy(cmd.policy),
    TakeExpertLoad: lambda engine, cmd, _: engine.expert_load_reply(cmd.ticket, engine.loaded.model.take_expert_load()),
    Shutdown: lambda engine, cmd, _: engine.stopping.set(),
}
"""Which engine method applies each command, on the engine thread (`sink`: what `AddRequest` was queued with)."""


def apply(engine: Engine, cmd: Command, sink: Sink | None = None) -> None:
    """Apply one command on the engine thread."""
    HANDLERS[type(cmd)](engine, cmd, sink)


class Inbox:
    """Commands queued from any thread, applied on the engine thread between two steps, in order."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Command | None, Sink | None]] = queue.Queue()

    def post(self, cmd: Command | None, sink: Sink | None = None) -> None:
        """Queue `cmd` (None only wakes a loop that waits for work)."""
        self._queue.put((cmd, sink))

    def drain(self, engine: Engine, block: bool, timeout_s: float = 0.5) -> None:
        """Apply every queued command; with `block`, wait up to `timeout_s` for the first."""
        try:
            cmd, sink = self._queue.get(timeout=timeout_s) if block else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd is not None:
                apply(engine, cmd, sink)
            try:
                cmd, sink = self._queue.get_nowait()
            except queue.Empty:
                return
