"""The sandbox service: register WASI modules, run them under limits on a bounded pool."""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import wasmtime
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from cotserve.common.errors import InvalidArgument, NotFound
from cotserve.common.paths import cache_dir
from cotserve.common.server import Server, ServiceSpec, run_until_signalled
from cotserve.common.tracing import make_tracer_provider
from cotserve.sandbox.registry import ModuleEntry, ModuleRegistry
from cotserve.sandbox.runner import Limits, ModuleRejected, RunResult, SandboxEngine
from cotserve.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc

log = logging.getLogger("cotserve.sandbox")
SHIPPED_DIR = Path(__file__).parent / "modules"
_LIMIT_FIELDS = ("fuel", "memory_bytes", "timeout_ms", "max_output_bytes")


@dataclass(slots=True)
class SandboxConfig:
    """Everything `cotserve serve sandbox` takes; see the CLI for each flag's help."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 50071
    """Port to bind (0 picks a free one)."""
    store_dir: Path = field(default_factory=lambda: cache_dir("sandbox"))
    """Folder for registered modules and compiled artifacts (kept across restarts)."""
    pool_size: int = field(default_factory=lambda: max(2, os.cpu_count() or 2))
    """Runs executing at once."""
    per_module_concurrency: int | None = None
    """Runs of one module at once (default: half the pool), so a hostile module delays only its own callers."""
    default_limits: Limits = Limits(fuel=100_000_000, memory_bytes=64 << 20, timeout_ms=1000, max_output_bytes=1 << 20)
    """Limits of a run that asks for none."""
    max_limits: Limits = Limits(fuel=10_000_000_000, memory_bytes=512 << 20, timeout_ms=10_000, max_output_bytes=16 << 20)
    """The most any module may be allowed."""
    max_input_bytes: int = 4 << 20
    """Largest stdin accepted."""
    register_shipped: bool = True
    """Register the shipped modules (strip-think, redact, cot-guard) at start."""
    grace_s: float = 5.0
    """Seconds to drain in-flight runs on SIGTERM."""


def entry_to_pb(e: ModuleEntry) -> sandbox_pb2.ModuleInfo:
    return sandbox_pb2.ModuleInfo(name=e.name, sha256=e.sha256, size_bytes=e.size_bytes,
                                  max_limits=sandbox_pb2.RunLimits(**{f: getattr(e.max_limits, f) for f in _LIMIT_FIELDS}))


def limits_from_pb(pb: sandbox_pb2.RunLimits) -> Limits:
    return Limits(*(getattr(pb, f) for f in _LIMIT_FIELDS))


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(self, registry: ModuleRegistry, cfg: SandboxConfig) -> None:
        self.registry = registry
        self.cfg = cfg
        self.pool = ThreadPoolExecutor(max_workers=cfg.pool_size, thread_name_prefix="cotserve-sandbox-run")
        self.per_module = cfg.per_module_concurrency or max(1, cfg.pool_size // 2)
        self._module_slots: dict[str, asyncio.Semaphore] = {}

    async def RegisterModule(self, request: sandbox_pb2.RegisterModuleRequest, context: grpc.aio.ServicerContext) -> sandbox_pb2.RegisterModuleResponse:
        if bool(request.wasm) == bool(request.wat):
            raise InvalidArgument("wasm / wat: set exactly one")
        wasm = request.wasm
        if request.wat:
            try:
                wasm = wasmtime.wat2wasm(request.wat)
            except wasmtime.WasmtimeError as exc:
                raise InvalidArgument(f"wat: {str(exc).strip()}") from None
        max_limits = limits_from_pb(request.max_limits) if request.HasField("max_limits") else None
        try:
            entry = await asyncio.to_thread(self.registry.register, request.name, wasm, max_limits)
        except ModuleRejected as exc:
            raise InvalidArgument(str(exc)) from None
        log.info("registered %s (%s, %d bytes)", entry.name, entry.sha256[:12], entry.size_bytes)
        return sandbox_pb2.RegisterModuleResponse(module=entry_to_pb(entry))

    async def ListModules(self, request: sandbox_pb2.ListModulesRequest, context: grpc.aio.ServicerContext) -> sandbox_pb2.ListModulesResponse:
        return sandbox_pb2.ListModulesResponse(modules=[entry_to_pb(e) for e in self.registry.entries()])

    async def DeleteModule(self, request: sandbox_pb2.DeleteModuleRequest, context: grpc.aio.ServicerContext) -> sandbox_pb2.DeleteModuleResponse:
        if not self.registry.delete(request.name):
            raise NotFound(f"name: no module {request.name!r}")
        return sandbox_pb2.DeleteModuleResponse()

    def resolve_limits(self, entry: ModuleEntry, requested: Limits) -> Limits:
        """0 means the default (capped at the module's maximum); above the maximum is an error."""
        out = []
        for f in _LIMIT_FIELDS:
            value, cap = getattr(requested, f), getattr(entry.max_limits, f)
            if value > cap:
                raise InvalidArgument(f"limits.{f}: {value} is out of range (1..{cap} for module {entry.name!r})")
            out.append(value or min(getattr(self.cfg.default_limits, f), cap))
        return Limits(*out)

    async def Run(self, request: sandbox_pb2.RunRequest, context: grpc.aio.ServicerContext) -> sandbox_pb2.RunResponse:
        if not request.name and not request.sha256:
            raise InvalidArgument("name / sha256: name the module to run")
        found = self.registry.lookup(request.name, request.sha256)
        if found is None:
            raise NotFound(f"module: {request.name or request.sha256!r} is not registered")
        entry, module = found
        if len(request.input) > self.cfg.max_input_bytes:
            raise InvalidArgument(f"input: {len(request.input)} bytes is over the limit ({self.cfg.max_input_bytes})")
        limits = self.resolve_limits(entry, limits_from_pb(request.limits))
        slots = self._module_slots.setdefault(entry.sha256, asyncio.Semaphore(self.per_module))
        async with slots:
            result: RunResult = await asyncio.get_running_loop().run_in_executor(
                self.pool, self.registry.engine.run, module, request.input, list(request.args), limits, entry.name)
        span = trace.get_current_span()
        span.update_name(f"sandbox.run {entry.name}")
        span.set_attributes({"cotserve.sandbox.module": entry.name, "cotserve.sandbox.sha256": entry.sha256,
                             "cotserve.sandbox.outcome": result.outcome.value, "cotserve.sandbox.fuel_used": result.fuel_used,
                             "cotserve.sandbox.wall_ms": result.wall_ms})
        return sandbox_pb2.RunResponse(
            outcome=sandbox_pb2.RunOutcome.Value(f"RUN_OUTCOME_{result.outcome.value}"), output=result.output,
            stderr=result.stderr, exit_code=result.exit_code, fuel_used=result.fuel_used, wall_ms=result.wall_ms,
        )


def register_shipped(registry: ModuleRegistry) -> list[str]:
    names = []
    for wasm in sorted(SHIPPED_DIR.glob("*.wasm")):
        name = wasm.stem.replace("_", "-")
        registry.register(name, wasm.read_bytes(), None)
        names.append(name)
    return names


@dataclass(slots=True)
class RunningSandbox:
    server: Server
    servicer: SandboxServicer
    engine: SandboxEngine

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.server.stop(grace_s)
        self.close()

    def close(self) -> None:
        self.servicer.pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()


async def start_sandbox(cfg: SandboxConfig, tracer_provider: TracerProvider | None = None) -> RunningSandbox:
    engine = SandboxEngine()
    registry = await asyncio.to_thread(ModuleRegistry, engine, cfg.store_dir, cfg.max_limits)
    if cfg.register_shipped:
        names = await asyncio.to_thread(register_shipped, registry)
        log.info("shipped modules registered: %s", ", ".join(names))
    servicer = SandboxServicer(registry, cfg)
    spec = ServiceSpec("cotserve.sandbox.v1.SandboxService",
                       lambda srv: sandbox_pb2_grpc.add_SandboxServiceServicer_to_server(servicer, srv))
    server = Server([spec], cfg.host, cfg.port, tracer_provider)
    await server.start()
    await server.set_serving()
    log.info("SERVING sandbox on %s: %d modules, store %s, pool %d", server.address, len(registry.entries()),
             cfg.store_dir, cfg.pool_size)
    return RunningSandbox(server, servicer, engine)


async def serve(cfg: SandboxConfig) -> None:
    sandbox = await start_sandbox(cfg, make_tracer_provider("cotserve-sandbox"))
    await run_until_signalled(sandbox.server, cfg.grace_s, on_stop=sandbox.close)
