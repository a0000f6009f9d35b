"""The engine in a process of its own, and the front the worker's gRPC process talks to.

Why a process: the engine's loop and the serving side's Python work (the gRPC servicer, protobuf conversion,
tokenization, tracing) would otherwise share one GIL, and every token's work on one side would take time from the
other. The child process owns the model, the KV cache (it is sized there) and the scheduler, and runs the engine's
loop: apply commands → step → send what that pass produced. The front (`EngineProcess`, in the gRPC process) has
the engine's API (`EngineClient`: submit, abort, stats, pause_batch, MoE policy and load), tokenizes, streams and
converts; it detokenizes and applies stop strings for every request whose text the engine itself does not read
(`FrontText`; votes and step-counted reasoning controls keep both in the engine).

IPC: two socket pairs wrapped in `multiprocessing.connection.Connection` (length-prefixed pickles). Commands in are the
engine's own (`commands.py`), applied by the same table as in-thread; out goes one `StepOutputs` message per loop
pass that produced anything: every output of that pass and the stats snapshot. A pass's message is a few hundred bytes
to a few KB, and its round trip is small against an engine step on the CPU (`python -m
cotserve.worker.engine_process --measure` times it), so the standard library's pipe is enough; at GPU step times well
under a millisecond a shared-memory ring would matter, and the message types would stay.

Lifecycle: the child is a fresh interpreter (`python -m cotserve.worker.engine_process`, the pipes' ends passed as
file descriptors): a fork of a process running gRPC threads is unsafe, and multiprocessing's `spawn` would re-import
the caller's main module (a script without a `__main__` guard would start itself again) and add a resource-tracker
process. It gets its config as the first message, asks the kernel to SIGTERM it when its parent dies, and also ends
when its command pipe closes. With nothing to do it blocks on the engine's inbox: an idle worker uses no CPU. If it
dies, the front's reader sees the pipe close: every request in flight ends with an error naming the exit, `on_death`
tells the server (health NOT_SERVING), and later submits fail at once with the same reason.
"""

from __future__ import annotations

import argparse
import enum
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable

from cotserve.common.heap import freeze_startup_heap
from cotserve.common.lifetime import follow_parent
from cotserve.common.errors import FailedPrecondition, InvalidArgument, ModelLoadError
from cotserve.common.sampling import ReasoningParams
from cotserve.worker.commands import AddRequest, Command, Shutdown
from cotserve.worker.detokenizer import TokenBytes
from cotserve.worker.engine_client import EngineClient
from cotserve.worker.engine_config import EngineConfig, needs_engine_text
from cotserve.worker.engine_metrics import EngineStats
from cotserve.worker.front_text import FrontText
from cotserve.worker.outputs import RequestOutput, Sink
from cotserve.worker.sequence import SamplingParams, SlaClass

log = logging.getLogger("cotserve.worker.engine")


# ---- messages (engine -> front) -----------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class EngineReady:
    config: EngineConfig
    kv_spec: Any  # KvCacheSpec (kept a forward reference: the front imports no torch-heavy modules eagerly)
    revision: str
    dtype: Any  # torch.dtype of the weights
    device: str
    stats: EngineStats
    kernels: str = ""  # Engine.kernels


@dataclass(slots=True, frozen=True)
class StepOutputs:
    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass(slots=True, frozen=True)
class PolicyApplied:
    version: int


@dataclass(slots=True, frozen=True)
class ExpertLoad:
    ticket: int
    load: dict[int, list[int]]


class FailureKind(enum.Enum):
    """Why the engine process could not start, as the front raises it again (`raise_in_front`)."""

    MODEL_LOAD = "model_load"  # the model folder cannot be served (ModelLoadError)
    CONFIG = "config"  # a setting or the model's config is out of range (ValueError)
    OS = "os"  # a file or device could not be used (OSError)
    INTERNAL = "internal"  # a bug: the message has the traceback (RuntimeError)

    @classmethod
    def of(cls, exc: BaseException) -> FailureKind:
        if isinstance(exc, ModelLoadError):
            return cls.MODEL_LOAD
        if isinstance(exc, (ValueError, FailedPrecondition, InvalidArgument)):
            return cls.CONFIG
        if isinstance(exc, OSError):
            return cls.OS
        return cls.INTERNAL

    def exception(self, message: str) -> Exception:
        return {FailureKind.MODEL_LOAD: ModelLoadError, FailureKind.CONFIG: ValueError, FailureKind.OS: OSError,
                FailureKind.INTERNAL: RuntimeError}[self](message)


@dataclass(slots=True, frozen=True)
class EngineFailed:
    reason: str  # the child could not start: the message names the problem (a ModelLoadError's, say)
    kind: FailureKind = FailureKind.CONFIG


# ---- the child --------------------------------------------------------------------------------
def _build_engine(cfg: Any, send: Callable[[object], None]) -> tuple[Any, Any] | None:
    """The engine and its loaded model, on this (the loop's) thread; None after reporting EngineFailed."""
    from cotserve.common.errors import CotserveError
    from cotserve.worker.engine import Engine
    from cotserve.worker.models.loader import DTYPES, load_model
    from cotserve.worker.reasoning import ReasoningFormat
    from cotserve.worker.sizing import engine_config, resolve_device, set_torch_threads

    try:
        device = resolve_device(cfg.device)
        set_torch_threads(cfg, device)
        dtype = None if cfg.dtype == "auto" else DTYPES[cfg.dtype]
        loaded = load_model(cfg.model, device=device, dtype=dtype, **cfg.model_names)
        reasoning = ReasoningFormat.for_tokenizer(loaded.tokenizer, cfg.reasoning_start, cfg.reasoning_end,
                                                  cfg.reasoning_step, cfg.answer_regex, cfg.reasoning_parser)
        return Engine(loaded, engine_config(cfg, loaded), reasoning), loaded
    except (CotserveError, ValueError, OSError) as exc:
        send(EngineFailed(getattr(exc, "message", str(exc)), FailureKind.of(exc)))
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        send(EngineFailed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}", FailureKind.INTERNAL))
    return None


class _Outbox:
    """What the engine produced since the last pass of its loop, sent as one StepOutputs after each pass (called on
    the engine's thread only)."""

    def __init__(self, engine: Any, send: Callable[[object], None]) -> None:
        self.engine, self.send = engine, send
        self.pending: list[RequestOutput] = []
        self.last_stats: EngineStats = engine.stats()

    def flush(self) -> None:
        stats = self.engine.stats()
        if not self.pending and stats is self.last_stats:
            return
        batch = self.pending[:]  # the same list stays: requests' sinks are its `append`
        self.pending.clear()
        self.last_stats = stats
        self.send(StepOutputs(batch, stats))


def run_engine(parent: int, commands: Connection, outputs: Connection) -> None:
    """The engine process: take the config, load the model, size the KV pool, serve commands until Shutdown or the
    pipe closes."""
    follow_parent(parent)
    try:
        cfg = commands.recv()
    except (EOFError, OSError):
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the front stops us
    send_lock = threading.Lock()

    def send(message: object) -> None:
        with send_lock:
            outputs.send(message)

    built = _build_engine(cfg, send)
    if built is None:
        return
    engine, loaded = built
    outbox = _Outbox(engine, send)
    engine.after_iteration = outbox.flush
    engine.default_sink = outbox.pending.append
    engine.expert_load_reply = lambda ticket, load: send(ExpertLoad(ticket, load))
    engine.policy_listeners.append(lambda version: send(PolicyApplied(version)))
    send(EngineReady(engine.config, engine.kv_spec, loaded.revision, loaded.dtype, str(loaded.device), engine.stats(),
                     engine.kernels))
    freeze_startup_heap("engine process")
    threading.Thread(target=lambda: engine.runner.warmed.wait() and freeze_startup_heap("engine process, kernels compiled"),
                     name="cotserve-freeze-after-compile", daemon=True).start()

    def read_commands() -> None:
        try:
            while True:
                try:
                    cmd = commands.recv()
                except (EOFError, OSError):
                    break  # the front is gone
                engine.post(cmd)  # applied on the engine's thread, by the same table as in-thread commands
                if isinstance(cmd, Shutdown):
                    break
        finally:
            engine.stop()

    # commands are read on a helper thread (pure Python: it only queues them) and the loop runs here, on the
    # thread that built the engine (see Engine.run)
    threading.Thread(target=read_commands, name="cotserve-engine-commands", daemon=True).start()
    code = 0
    try:
        engine.run()
    except BaseException:  # noqa: BLE001 - a bug in the loop: on stderr, and the front reports the exit code
        traceback.print_exc()
        code = 1
    finally:
        # nothing left to flush or close: skip the interpreter's (torch's) slow teardown
        logging.shutdown()
        os._exit(code)


# ---- the front --------------------------------------------------------------------------------
class EngineDied(RuntimeError):
    """The engine process is gone; the message says how."""


@dataclass
class EngineProcess(EngineClient):
    """The engine's API (`EngineClient`), served by a child process (see the module docstring). `start()` blocks
    until the model is loaded and the pool sized there, raising what the child reported when it could not."""

    cfg: Any  # WorkerConfig
    reasoning: Any = None  # the front's ReasoningFormat (the same markers the child uses)
    on_death: Callable[[str], None] | None = None
    loaded: Any = None  # the front's LoadedModel (config and tokenizer, no weights), set by the server
    config: EngineConfig | None = None
    kv_spec: Any = None  # KvCacheSpec, from the engine process
    policy_version: int = 0
    policy_listeners: list[Callable[[int], None]] = field(default_factory=list)
    revision: str = ""
    dtype: Any = None
    device: str = "cpu"
    kernels: str = ""  # Engine.kernels, from the engine process
    dead: str | None = None
    _stats: EngineStats = field(default_factory=EngineStats)
    _sinks: dict[str, Sink] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _send_lock: threading.Lock = field(default_factory=threading.Lock)
    _proc: Any = None
    _commands: Any = None
    _outputs: Any = None
    _reader: threading.Thread | None = None
    _token_bytes: tuple[TokenBytes | None] | None = None  # FrontText's per-token bytes, made on first use

    def __post_init__(self) -> None:
        self._init_client()

    def start(self, timeout_s: float = 600.0) -> None:
        commands, child_commands = socket.socketpair()
        outputs, child_outputs = socket.socketpair()
        fds = (child_commands.fileno(), child_outputs.fileno())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "cotserve.worker.engine_process", "--commands-fd", str(fds[0]),
             "--outputs-fd", str(fds[1]), "--parent", str(os.getpid())],
            pass_fds=fds, close_fds=True)
        child_commands.close()
        child_outputs.close()
        self._commands, self._outputs = Connection(commands.detach()), Connection(outputs.detach())
        self._pipe(self.cfg)
        if not self._outputs.poll(timeout_s):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not load the model within {timeout_s:.0f}s")
        try:
            first = self._outputs.recv()
        except EOFError:
            self._proc.wait(5)
            raise RuntimeError(f"the engine process exited while starting (exit code {self._proc.returncode})") from None
        if isinstance(first, EngineFailed):
            self._proc.wait(5)
            raise first.kind.exception(first.reason)
        assert isinstance(first, EngineReady)
        self.config, self._stats = first.config, first.stats
        self.kv_spec = first.kv_spec
        self.revision, self.dtype, self.device = first.revision, first.dtype, first.device
        self.kernels = first.kernels
        self._reader = threading.Thread(target=self._read, name="cotserve-engine-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- the engine's API (EngineClient's, with:) ---------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink,
               sla_class: SlaClass = SlaClass.INTERACTIVE, cache_salt: str = "",
               budget: ReasoningParams = ReasoningParams(), detokenize: bool = True, tenant: str = "") -> None:
        """`EngineClient.submit`; the text is made here (`FrontText`) unless the engine must read it."""
        if self.dead is not None:
            raise EngineDied(self.dead)
        detokenize = self.loaded is None or needs_engine_text(params, budget)
        if not detokenize:
            if self._token_bytes is None:
                self._token_bytes = (TokenBytes.of(self.loaded.tokenizer),)
            sink = FrontText(sink, self.loaded.tokenizer, self._token_bytes[0], prompt_ids, params,
                             self.loaded.eos_token_ids, self.reasoning, lambda index: self._stop_sample(request_id, index))
        super().submit(request_id, prompt_ids, params, sink, sla_class, cache_salt, budget, detokenize, tenant)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._sinks.pop(request_id, None)
        if self.dead is None:
            super().abort(request_id)

    def _stop_sample(self, request_id: str, index: int) -> None:
        """FrontText found a stop string (on the reader thread): the engine ends the sample before its next step."""
        try:
            self.stop_sample(request_id, index)
        except EngineDied:
            pass  # the reader is about to report the death to every request in flight

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._proc is None:
            return
        if self.dead is None:
            self.dead = "the worker is stopping"
            try:
                self._send(Shutdown())
            except EngineDied:
                pass
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(2)
        if self._reader is not None:
            self._reader.join(2)

    # -- plumbing -------------------------------------------------------------------------------------
    def _send(self, cmd: Command, sink: Sink | None = None) -> None:
        if isinstance(cmd, AddRequest):
            with self._lock:
                self._sinks[cmd.request_id] = sink
        self._pipe(cmd)

    def _pipe(self, cmd: object) -> None:
        try:
            with self._send_lock:
                self._commands.send(cmd)
        except (OSError, ValueError) as exc:  # the pipe is closed: the reader reports the death
            raise EngineDied(self.dead or f"the engine process is gone ({exc})") from None

    def _read(self) -> None:
        while True:
            try:
                msg = self._outputs.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, StepOutputs):
                self._stats = msg.stats
                for out in msg.outputs:
                    with self._lock:
                        sink = self._sinks.get(out.request_id)
                        if sink is not None and (out.is_last or out.error is not None):
                            del self._sinks[out.request_id]
                    if sink is not None:
                        sink(out)
            elif isinstance(msg, PolicyApplied):
                self.policy_version = msg.version
                for listener in tuple(self.policy_listeners):  # a snapshot: listeners may be added meanwhile
                    listener(msg.version)
            elif isinstance(msg, ExpertLoad):
                self.answer_expert_load(msg.ticket, msg.load)
        self._died()

    def _died(self) -> None:
        stopping = self.dead is not None
        try:
            code = self._proc.wait(2)
        except subprocess.TimeoutExpired:  # the pipe closed but the process lingers: make it go
            self._proc.kill()
            code = self._proc.wait(2)
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        reason = self.dead if stopping else f"the engine process died ({how})"
        self.dead = reason
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink(RequestOutput(request_id, 0, "", None, error=reason))
        if not stopping:
            log.error("%s; %d requests in flight failed", reason, len(sinks))
            if self.on_death is not None:
                self.on_death(reason)


def _measure(n_outputs: int = 32, rounds: int = 2000) -> None:
    """Round trip of one step's message through a socket pair (pickle + write + read + unpickle)."""
    a, b = socket.socketpair()
    recv, send = Connection(a.detach()), Connection(b.detach())
    outs = [RequestOutput(f"req-{i:04d}", 1000 + i, " 73", None, part=1) for i in range(n_outputs)]
    msg = StepOutputs(outs, EngineStats())
    start = time.perf_counter()
    for _ in range(rounds):
        send.send(msg)
        recv.recv()
    per = (time.perf_counter() - start) / rounds
    import pickle

    print(f"{n_outputs} outputs, {len(pickle.dumps(msg))} bytes: {per * 1e6:.1f} µs per message (pickle, pipe, unpickle)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cotserve.worker.engine_process",
                                     description="A worker's engine process (started by the worker), or --measure the IPC.")
    parser.add_argument("--commands-fd", type=int, help="File descriptor of the command socket (from the worker).")
    parser.add_argument("--outputs-fd", type=int, help="File descriptor of the output socket (to the worker).")
    parser.add_argument("--parent", type=int, help="The worker's pid: the engine ends with it.")
    parser.add_argument("--measure", action="store_true", help="Time one step's message through a socket pair and exit.")
    args = parser.parse_args(argv)
    if args.measure:
        _measure()
        return
    if args.commands_fd is None or args.outputs_fd is None or args.parent is None:
        parser.error("--commands-fd, --outputs-fd and --parent are given by the worker that starts this process")
    run_engine(args.parent, Connection(args.commands_fd), Connection(args.outputs_fd))


if __name__ == "__main__":
    # run as the importable module, not as __main__: the messages it pickles must name their real module
    from cotserve.worker import engine_process

    engine_process.main()
