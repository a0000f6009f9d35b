"""The sandbox service: register WASI modules, run them under limits on a bounded pool.

The control plane (RegisterModule, DeleteModule) needs the admin token as `authorization: Bearer
<token>`: from `--admin-token-file` / COTSERVE_SANDBOX_ADMIN_TOKEN, else one made at first start and
kept in `<store>/admin-token` (mode 0600), where `cotserve sandbox register` finds it on this
machine. Every change is written to the `cotserve.sandbox.audit` log with the caller's address.
Running and listing modules needs no token: the gateway does that for every request.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import wasmtime
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cotserve.common.auth import bearer
from cotserve.common.metrics import LATENCY_BUCKETS, MetricsServer, serve_metrics
from cotserve.common.errors import AlreadyExists, InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from cotserve.common.server import Server, ServiceSpec, run_until_signalled
from cotserve.common.tracing import make_tracer_provider
from cotserve.sandbox.config import SandboxConfig
from cotserve.sandbox.registry import ModuleEntry, ModuleExists, ModuleReadOnly, ModuleRegistry
from cotserve.sandbox.runner import Limits, ModuleRejected, RunResult, SandboxEngine
from cotserve.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc

log = logging.getLogger("cotserve.sandbox")


class SandboxMetrics:
    """The sandbox's Prometheus metrics: runs by module and outcome, their wall time and fuel."""

    def __init__(self, registry: ModuleRegistry) -> None:
        self.registry = r = CollectorRegistry()
        self.runs = Counter("cotserve_sandbox_runs", "Module runs by outcome (OK, OUT_OF_FUEL, TIMEOUT, ...).",
                            ["module", "outcome"], registry=r)
        self.seconds = Histogram("cotserve_sandbox_run_seconds", "Wall time of a module run.", ["module"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.fuel = Counter("cotserve_sandbox_fuel_used", "Fuel (wasmtime instructions) module runs used.", ["module"],
                            registry=r)
        modules = Gauge("cotserve_sandbox_modules", "Modules registered.", registry=r)
        modules.set_function(lambda: len(registry.entries()))

    def record(self, module: str, result: RunResult) -> None:
        self.runs.labels(module, result.outcome.value).inc()
        self.seconds.labels(module).observe(result.wall_ms / 1000)
        self.fuel.labels(module).inc(result.fuel_used)
audit = logging.getLogger("cotserve.sandbox.audit")
SHIPPED_DIR = Path(__file__).parent / "modules"
ADMIN_TOKEN_FILE = "admin-token"
MAX_MODULE_BYTES = 16 << 20

_LIMIT_FIELDS = ("fuel", "memory_bytes", "timeout_ms", "max_output_bytes")


def entry_to_pb(e: ModuleEntry) -> sandbox_pb2.ModuleInfo:
    return sandbox_pb2.ModuleInfo(name=e.name, sha256=e.sha256, size_bytes=e.size_bytes, shipped=e.shipped,
                                  max_limits=sandbox_pb2.RunLimits(**{f: getattr(e.max_limits, f) for f in _LIMIT_FIELDS}))


def admin_token(cfg: SandboxConfig) -> str:
    """The configured token (`admin_token_file`), else the one kept in the store (made now, readable by this user
    only, if new)."""
    configured = cfg.configured_admin_token()
    if configured:
        return configured
    path = cfg.store_dir / ADMIN_TOKEN_FILE
    cfg.store_dir.mkdir(parents=True, exist_ok=True)
    try:
        token = path.read_text().strip()
        if token:
            return token
    except FileNotFoundError:
        pass
    token = "sbx-" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    log.info("made an admin token for RegisterModule/DeleteModule: %s", path)
    return token


def limits_from_pb(pb: sandbox_pb2.RunLimits) -> Limits:
    return Limits(*(getattr(pb, f) for f in _LIMIT_FIELDS))


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(self, registry: ModuleRegistry, cfg: SandboxConfig, token: str) -> None:
        self.registry = registry
        self.cfg = cfg
        self._token = token.encode()
        self.pool = ThreadPoolExecutor(max_workers=cfg.pool_size, thread_name_prefix="cotserve-sandbox-run")
        self.per_module = cfg.per_module_concurrency or max(1, cfg.pool_size // 2)
        self._module_slots: dict[str, asyncio.Semaphore] = {}
        self.metrics = SandboxMetrics(registry)

    def _admin(self, context: grpc.aio.ServicerContext, action: str) -> None:
        """UNAUTHENTICATED unless the call carries exactly one `authorization: Bearer <admin token>`."""
        key, sent = bearer(context.invocation_metadata() or ())
        if key is None or not hmac.compare_digest(key.encode(), self._token):
            audit.warning("refused %s from %s: %s", action, context.peer(),
                          "no admin token" if not sent else "wrong admin token" if sent == 1 else "several tokens")
            raise Unauthenticated(f"authorization: {action} needs the sandbox's admin token "
                                  "(`authorization: Bearer <token>`, one header)")

    async def RegisterModule(self, request: sandbox_pb2.RegisterModuleRequest, context: grpc.aio.ServicerContext) -> sandbox_pb2.RegisterModuleResponse:
        self._admin(context, "RegisterModule")
        if bool(request.wasm) == bool(request.wat):
            raise InvalidArgument("wasm / wat: set exactly one")
        wasm = request.wasm
        if max(len(request.wasm), len(request.wat)) > MAX_MODULE_BYTES:
            raise InvalidArgument(f"wasm / wat: {max(len(request.wasm), len(request.wat))} bytes, at most {MAX_MODULE_BYTES}")
        if request.wat:
            try:
                wasm = wasmtime.wat2wasm(request.wat)
            except wasmtime.WasmtimeError as exc:
                raise InvalidArgument(f"wat: {str(exc).strip()}") from None
        max_limits = limits_from_pb(request.max_limits) if request.HasField("max_limits") else None
        try:
            entry, old = await asyncio.to_thread(self.registry.register, request.name, wasm, max_limits,
                                                 replace=request.replace)
        except ModuleRejected as exc:
            raise InvalidArgument(str(exc)) from None
        except ModuleReadOnly as exc:
            audit.warning("refused RegisterModule %s from %s: shipped module", request.name, context.peer())
            raise PermissionDenied(str(exc)) from None
        except ModuleExists as exc:
            raise AlreadyExists(str(exc)) from None
        if old is None:
            audit.info("registered %s sha256 %s (%d bytes) from %s", entry.name, entry.sha256, entry.size_bytes, context.peer())
        else:
            audit.warning("replaced %s: sha256 %s -> %s (%d bytes) from %s", entry.name, old.sha256, entry.sha256,
                          entry.size_bytes, context.peer())
        return sandbox_pb2.RegisterModuleResponse(module=entry_to_pb(entry))

    async def ListModules(self, request: sandbox_pb2.ListModulesRequest, context: grpc.aio.ServicerContext) -> sandbox_pb2.ListModulesResponse:
        return sandbox_pb2.ListModulesResponse(modules=[entry_to_pb(e) for e in self.registry.entries()])

    async def DeleteModule(self, request: sandbox_pb2.DeleteModuleRequest, context: grpc.aio.ServicerContext) -> sandbox_pb2.DeleteModuleResponse:
        self._admin(context, "DeleteModule")
        try:
            entry = self.registry.delete(request.name)
        except ModuleReadOnly as exc:
            audit.warning("refused DeleteModule %s from %s: shipped module", request.name, context.peer())
            raise PermissionDenied(str(exc)) from None
        if entry is None:
            raise NotFound(f"name: no module {request.name!r}")
        audit.info("deleted %s sha256 %s from %s", entry.name, entry.sha256, context.peer())
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
        self.metrics.record(entry.name, result)
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
        registry.register(name, wasm.read_bytes(), None, shipped=True)
        names.append(name)
    return names


@dataclass(slots=True)
class RunningSandbox:
    server: Server
    servicer: SandboxServicer
    engine: SandboxEngine
    metrics_server: MetricsServer | None = None

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.server.stop(grace_s)
        self.close()

    def close(self) -> None:
        self.servicer.pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()


async def start_sandbox(cfg: SandboxConfig, tracer_provider: TracerProvider | None = None) -> RunningSandbox:
    cfg.validate()
    engine = SandboxEngine()
    registry = await asyncio.to_thread(ModuleRegistry, engine, cfg.store_dir, cfg.max_limits)
    if cfg.register_shipped:
        names = await asyncio.to_thread(register_shipped, registry)
        log.info("shipped modules registered: %s", ", ".join(names))
    servicer = SandboxServicer(registry, cfg, await asyncio.to_thread(admin_token, cfg))
    spec = ServiceSpec("cotserve.sandbox.v1.SandboxService",
                       lambda srv: sandbox_pb2_grpc.add_SandboxServiceServicer_to_server(servicer, srv))
    # a message holds a run's input or a module (up to 16 MiB), plus the envelope
    server = Server([spec], cfg.host, cfg.port, tracer_provider,
                    max_message_bytes=max(cfg.max_input_bytes, MAX_MODULE_BYTES) + (64 << 10), tls=cfg)
    metrics_server = serve_metrics(servicer.metrics.registry, cfg.host, cfg.metrics_port)
    await server.start()
    await server.set_serving()
    log.info("SERVING sandbox on %s: %d modules, store %s, pool %d", server.address, len(registry.entries()),
             cfg.store_dir, cfg.pool_size)
    return RunningSandbox(server, servicer, engine, metrics_server)


async def serve(cfg: SandboxConfig) -> None:
    sandbox = await start_sandbox(cfg, make_tracer_provider("cotserve-sandbox"))
    await run_until_signalled(sandbox.server, cfg.grace_s, on_stop=sandbox.close)
