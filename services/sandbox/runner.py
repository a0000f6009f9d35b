"""Run WASI (preview 1) command modules under wasmtime with hard limits. No grpc.

Module contract: a WASI command (`_start`); input on stdin, output on stdout, arguments in argv;
no environment, no preopened directories (so no filesystem), no network. Each run gets a fresh
store with its own fuel, linear-memory cap and wall-time deadline (epoch interruption, ticked
every millisecond by one background thread per engine); stdout and stderr are collected in
memory and cut at their limits.

The memory cap is enforced by the host, not by a store limit, so that a refused grow is *known*:
wasmtime-py has no limiter callback and its store limits make a refused `memory.grow` return -1
silently (the C API has no trap-on-grow-failure switch either). What the bindings do offer is the
host memory creator (`wasmtime_config_host_memory_creator_set`): wasmtime asks us to map each
linear memory and calls us on every grow. We map the reservation wasmtime asks for (plus its
guard) inaccessible, open the pages in use, and refuse a grow past the run's cap, noting it; a run
that then traps or exits nonzero is MEMORY_LIMIT, any other failure is TRAP whatever its size.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass

import wasmtime
from wasmtime import _bindings as ffi

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


log = logging.getLogger("cotserve.sandbox")


@dataclass(slots=True)
class MemoryUse:
    """What one run's linear memories did: the largest size reached, and the grow refused (bytes asked), if any."""

    cap: int
    peak_bytes: int = 0
    refused_bytes: int = 0


class _HostMemories:
    """Linear memories mapped by the host (see the module docstring). Each run names its cap and its
    `MemoryUse` in a thread-local before it instantiates; memories are created and grown on that thread."""

    OS_PAGE = 4096
    PROT_NONE, PROT_RW = 0, 3
    MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0x02, 0x20, 0x4000

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc = libc
        self.current = threading.local()
        self.live: dict[int, list] = {}  # id -> [base, mapped bytes, size, maximum, MemoryUse]
        self._ids = itertools.count(1)
        # the callbacks must outlive every engine that uses them: they are this object's (module-level) fields
        self._get = ffi.wasmtime_memory_get_callback_t(self._get_memory)
        self._grow = ffi.wasmtime_memory_grow_callback_t(self._grow_memory)
        self._free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._free_memory)
        self._new = ffi.wasmtime_new_memory_callback_t(self._new_memory)
        self._no_env = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda env: None)
        self.creator = ffi.wasmtime_memory_creator(None, self._new, self._no_env)

    def install(self, config: wasmtime.Config) -> None:
        ffi.wasmtime_config_host_memory_creator_set(config.ptr(), ctypes.byref(self.creator))
        # copy-on-write images of data segments need wasmtime's own mmap memories: data is copied in instead
        ffi.wasmtime_config_memory_init_cow_set(config.ptr(), False)

    @staticmethod
    def _error(message: str) -> int:
        err = ffi.wasmtime_error_new(ctypes.create_string_buffer(message.encode()))
        return ctypes.cast(err, ctypes.c_void_p).value or 0

    def _pages(self, n: int) -> int:
        return -(-n // self.OS_PAGE) * self.OS_PAGE

    def _new_memory(self, env, ty, minimum, maximum, reserved, guard, ret) -> int:
        try:
            use: MemoryUse = getattr(self.current, "use", None) or MemoryUse(cap=1 << 62)
            if minimum > use.cap:
                use.refused_bytes = max(use.refused_bytes, minimum)
                return self._error(f"memory limit: the module starts with {minimum} bytes, the cap is {use.cap}")
            # a fixed reservation must be honoured (wasmtime then never moves the memory and elides bounds
            # checks into the guard); without one, reserve what the cap allows so that we never move it either
            span = self._pages(reserved or min(maximum, max(use.cap, minimum)))
            mapped = span + guard
            base = self.libc.mmap(None, mapped, self.PROT_NONE, self.MAP_PRIVATE | self.MAP_ANONYMOUS | self.MAP_NORESERVE, -1, 0)
            if base is None or base == ctypes.c_void_p(-1).value:
                return self._error(f"memory: cannot reserve {mapped} bytes of address space")
            if minimum and self.libc.mprotect(base, self._pages(minimum), self.PROT_RW) != 0:
                self.libc.munmap(base, mapped)
                return self._error(f"memory: cannot commit {minimum} bytes")
            key = next(self._ids)
            self.live[key] = [base, mapped, minimum, span, use]
            use.peak_bytes = max(use.peak_bytes, minimum)
            out = ret[0]
            out.env, out.get_memory, out.grow_memory, out.finalizer = key, self._get, self._grow, self._free
            return 0
        except BaseException as exc:  # noqa: BLE001 - never unwind into wasmtime
            log.exception("host memory creator failed")
            return self._error(f"memory: host error {exc!r}")

    def _get_memory(self, env, byte_size, max_byte_size) -> int:
        base, _, size, maximum, _ = self.live[env]
        byte_size[0], max_byte_size[0] = size, maximum
        return base

    def _grow_memory(self, env, new_size) -> int:
        try:
            mem = self.live[env]
            base, _, _, maximum, use = mem
            if new_size > use.cap:
                use.refused_bytes = max(use.refused_bytes, new_size)
                return self._error(f"memory limit: {new_size} bytes asked, the cap is {use.cap}")
            if new_size > maximum or self.libc.mprotect(base, self._pages(new_size), self.PROT_RW) != 0:
                return self._error(f"memory: cannot grow to {new_size} bytes")
            mem[2] = new_size
            use.peak_bytes = max(use.peak_bytes, new_size)
            return 0
        except BaseException as exc:  # noqa: BLE001
            log.exception("host memory grow failed")
            return self._error(f"memory: host error {exc!r}")

    def _free_memory(self, env) -> None:
        base, mapped, *_ = self.live.pop(env)
        self.libc.munmap(base, mapped)


_HOST_MEMORIES = _HostMemories()


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
        _HOST_MEMORIES.install(config)
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
        memory = MemoryUse(cap=limits.memory_bytes)  # enforced by _HOST_MEMORIES for memories made on this thread
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
            _HOST_MEMORIES.current.use = memory
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
            finally:
                _HOST_MEMORIES.current.use = None
            if outcome in (Outcome.TRAP, Outcome.EXIT_NONZERO) and memory.refused_bytes:
                outcome = Outcome.MEMORY_LIMIT
                message = f"memory limit: a grow to {memory.refused_bytes} bytes was refused (cap {limits.memory_bytes})"
            if out.overflowed:
                outcome = Outcome.OUTPUT_LIMIT
            fuel_used = limits.fuel - store.get_fuel()
        finally:
            os.unlink(path)
        return RunResult(outcome, out.value(), err.value(), exit_code, fuel_used, (time.perf_counter() - start) * 1000, message)
