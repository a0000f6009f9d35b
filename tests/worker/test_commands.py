"""The engine's commands: one table applies each, in-thread and from the engine process's pipe; each crosses the pipe;
a start failure comes back as a typed kind and is raised as the same exception class in the front."""

from __future__ import annotations

import pickle
import typing

import pytest

from cotserve.common.errors import FailedPrecondition, ModelLoadError
from cotserve.common.sampling import ReasoningParams
from cotserve.worker import commands
from cotserve.worker.commands import AbortRequest, AddRequest, Inbox, PauseBatch, Shutdown, StopSample, TakeExpertLoad
from cotserve.worker.engine_process import EngineFailed, FailureKind
from cotserve.worker.sequence import SamplingParams, SlaClass


def test_every_command_has_one_handler():
    assert set(commands.HANDLERS) == set(typing.get_args(commands.Command))


@pytest.mark.parametrize("cmd", [
    AddRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=4, stop=("\n",)), SlaClass.BATCH, "salt",
               ReasoningParams(max_thinking_tokens=8), detokenize=False),
    AbortRequest("r"), StopSample("r", 2), PauseBatch(1.5), TakeExpertLoad(7), Shutdown(),
])
def test_commands_cross_the_pipe_unchanged(cmd):
    assert pickle.loads(pickle.dumps(cmd)) == cmd


class _Recorder:
    """What the handlers call on an engine, in order (the table's contract with `Engine`)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add(self, cmd, sink):
        self.calls.append(("add", cmd.request_id, sink))

    def abort_now(self, request_id):
        self.calls.append(("abort", request_id))

    def stop_sample_now(self, request_id, index):
        self.calls.append(("stop_sample", request_id, index))


def test_the_inbox_applies_commands_in_order_with_the_sink_each_was_queued_with():
    engine, inbox, sink = _Recorder(), Inbox(), object()
    inbox.post(AddRequest("a", [1], SamplingParams()), sink)
    inbox.post(None)  # a wake-up only
    inbox.post(StopSample("a", 1))
    inbox.post(AbortRequest("a"))
    inbox.drain(engine, block=False)
    assert engine.calls == [("add", "a", sink), ("stop_sample", "a", 1), ("abort", "a")]
    inbox.drain(engine, block=True, timeout_s=0.01)  # nothing queued: returns after the wait
    assert len(engine.calls) == 3


@pytest.mark.parametrize("exc,kind,raised", [
    (ModelLoadError("config.json: no such file"), FailureKind.MODEL_LOAD, ModelLoadError),
    (ValueError("kv_cache_dtype: 'fp4', allowed: auto, fp8_e4m3"), FailureKind.CONFIG, ValueError),
    (FailedPrecondition("torch_threads: 0"), FailureKind.CONFIG, ValueError),
    (FileNotFoundError("model.safetensors"), FailureKind.OS, OSError),
    (KeyError("layers.0"), FailureKind.INTERNAL, RuntimeError),
])
def test_a_start_failure_is_raised_in_the_front_as_its_kind(exc, kind, raised):
    failed = pickle.loads(pickle.dumps(EngineFailed(str(exc), FailureKind.of(exc))))
    assert failed.kind is kind
    err = failed.kind.exception(failed.reason)
    assert type(err) is raised and str(err) == str(exc)
