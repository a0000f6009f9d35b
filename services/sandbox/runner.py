"""Run WASI (preview 1) command modules under wasmtime with hard limits. No grpc.

Module contract: a WASI command (`_start`); input on stdin, output on stdout, arguments in argv;
no environment, no preopened directories (so no filesystem), no network. Each run gets a fresh
store with its own fuel, linear-memory cap and wall-time deadline (epoch interruption, ticked
every millisecond by one background thread per engine); stdout and stderr are collected in
memory and cut at their limits.
"""

from __future__ import annotations

import enum
import os
import tempfile
import threading
import time
from dataclasses import dataclass

import wasmtime

WASI_MODULE = "wasi_snapshot_preview1"
PAGE_BYTES = 64 * 1024
EPOCH_TICK_S = 0.001
MAX_STDERR_BYTES = 64 * 1024


class Outcome(enum.Enum):
    OK = "OK"
    EXIT_NONZERO = "EXIT_NONZERO"
    OUT_OF_FUEL = "OUT_OF_FUEL"
    MEMORY_LIMIT = "MEMORY_LIMIT"
    TIMEOUT = "TIMEOUT"
    OUTPUT_LIMIT = "OUTPUT_LIMIT"
    TRAP = "TRAP"


class ModuleRejected(ValueError):
    """The bytes are not a module this sandbox will run; the message says why."""


@dataclass(slots=True, frozen=True)
class Limits:
    fuel: int
    memory_bytes: int
    timeout_ms: int
    max_output_bytes: int


@dataclass(slots=True, frozen=True)
class RunResult:
    outcome: Outcome
    output: bytes
    stderr: bytes
    exit_code: int
    fuel_used: int
    wall_ms: float
    message: str = ""


class _Capped:
    """Collects a stream up to `limit` bytes; past it, writes fail (EIO) and `overflowed` is set."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0
        self.overflowed = False

    def write(self, data: bytes) -> int:
        room = self.limit - self.size
        if len(data) > room:
            self.overflowed = True
            if room > 0:
                self.parts.append(data[:room])
                self.size += room
            return -5  # -EIO: the guest's write fails
        self.parts.append(data)
        self.size += len(data)
        return len(data)

    def value(self) -> bytes:
        return b"".join(self.parts)


class SandboxEngine:
    """One wasmtime engine (fuel + epochs on) and its epoch ticker."""

    def __init__(self) -> None:
        config = wasmtime.Config()
        config.consume_fuel = True
        config.epoch_interruption = True
        self.engine = wasmtime.Engine(config)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="cotserve-sandbox-epoch", daemon=True)
        self._ticker.start()
        self._shm = "/dev/shm" if os.path.isdir("/dev/shm") else None

    def _tick(self) -> None:
        while not self._stop.wait(EPOCH_TICK_S):
            self.engine.increment_epoch()

    def close(self) -> None:
        self._stop.set()
        self._ticker.join(1.0)

    def compile(self, wasm: bytes) -> wasmtime.Module:
        """Validate and compile; only WASI preview 1 imports are allowed, and `_start` must exist."""
        try:
            module = wasmtime.Module(self.engine, wasm)
        except wasmtime.WasmtimeError as exc:
            raise ModuleRejected(f"wasm: not a valid module: {str(exc).strip()}") from None
        bad = [f"{imp.module}.{imp.name}" for imp in module.imports if imp.module != WASI_MODULE]
        if bad:
            raise ModuleRejected(f"wasm: imports other than {WASI_MODULE} are not allowed: {', '.join(bad[:5])}")
        if not any(exp.name == "_start" for exp in module.exports):
            raise ModuleRejected("wasm: not a WASI command (no exported _start function)")
        return module

    def serialize(self, module: wasmtime.Module) -> bytes:
        return module.serialize()

    def deserialize(self, data: bytes) -> wasmtime.Module:
        return wasmtime.Module.deserialize(self.engine, data)

    def run(self, module: wasmtime.Module, stdin: bytes, argv: list[str], limits: Limits, name: str = "module") -> RunResult:
        start = time.perf_counter()
        store = wasmtime.Store(self.engine)
        store.set_fuel(limits.fuel)
        store.set_epoch_deadline(max(1, int(limits.timeout_ms / 1000 / EPOCH_TICK_S)))
        store.set_limits(memory_size=limits.memory_bytes)
        out, err = _Capped(limits.max_output_bytes), _Capped(MAX_STDERR_BYTES)
        wasi = wasmtime.WasiConfig()
        wasi.argv = [name, *argv]
        wasi.stdout_custom = out.write
        wasi.stderr_custom = err.write
        fd, path = tempfile.mkstemp(prefix="cotserve-stdin-", dir=self._shm)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(stdin)
            wasi.stdin_file = path
            store.set_wasi(wasi)
            linker = wasmtime.Linker(self.engine)
            linker.define_wasi()
            exit_code, outcome, message = 0, Outcome.OK, ""
            instance = None
            try:
                instance = linker.instantiate(store, module)
                instance.exports(store)["_start"](store)
            except wasmtime.ExitTrap as exc:
                exit_code = exc.code
                outcome = Outcome.OK if exc.code == 0 else Outcome.EXIT_NONZERO
            except wasmtime.Trap as exc:
                code = exc.trap_code
                exit_code, message = -1, f"trap: {code.name.lower() if code is not None else 'unknown'}"
                outcome = {wasmtime.TrapCode.OUT_OF_FUEL: Outcome.OUT_OF_FUEL,
                           wasmtime.TrapCode.INTERRUPT: Outcome.TIMEOUT}.get(exc.trap_code, Outcome.TRAP)
            except wasmtime.WasmtimeError as exc:
                exit_code, outcome, message = -1, Outcome.TRAP, str(exc).splitlines()[0]
            if outcome in (Outcome.TRAP, Outcome.EXIT_NONZERO) and instance is not None and self._at_memory_limit(instance, store, limits):
                outcome = Outcome.MEMORY_LIMIT
            if out.overflowed:
                outcome = Outcome.OUTPUT_LIMIT
            fuel_used = limits.fuel - store.get_fuel()
        finally:
            os.unlink(path)
        return RunResult(outcome, out.value(), err.value(), exit_code, fuel_used, (time.perf_counter() - start) * 1000, message)

    @staticmethod
    def _at_memory_limit(instance: wasmtime.Instance, store: wasmtime.Store, limits: Limits) -> bool:
        """Whether a failed memory.grow likely explains the failure.

        wasmtime-py exposes no limiter callback, so a refused grow is invisible; the run is put down
        to the memory limit when the module failed with its memory past half the cap (growth that
        far, then failure, is what a refused grow looks like; a module that fails small did not
        hit the cap by growing)."""
        memory = instance.exports(store).get("memory")
        if not isinstance(memory, wasmtime.Memory):
            return False
        return memory.data_len(store) + PAGE_BYTES > limits.memory_bytes // 2
