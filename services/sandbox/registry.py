"""Registered modules: content-addressed on disk, compiled once, surviving restarts.

Layout of the store folder:
    index.json                    name -> {sha256, max limits, shipped}
    <sha256>.wasm                 the module as registered
    <sha256>.<wasmtime>.cwasm     wasmtime's serialized compiled artifact for this wasmtime version
    admin-token                   the service's admin token when none is configured (mode 0600)

A name is bound once: registering an existing name needs `replace`; shipped modules can be neither
replaced nor deleted; a module's files go when no name refers to them any more.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import wasmtime

from cotserve.sandbox.runner import Limits, ModuleRejected, SandboxEngine

log = logging.getLogger("cotserve.sandbox")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
try:
    WASMTIME_VERSION = importlib.metadata.version("wasmtime")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source build
    WASMTIME_VERSION = "unknown"


@dataclass(slots=True, frozen=True)
class ModuleEntry:
    name: str
    sha256: str
    size_bytes: int
    max_limits: Limits
    shipped: bool = False


class ModuleExists(ValueError):
    """The name is taken and the request did not ask to replace it."""


class ModuleReadOnly(ValueError):
    """The name belongs to a shipped module."""


class ModuleRegistry:
    def __init__(self, engine: SandboxEngine, folder: Path, service_max: Limits) -> None:
        self.engine = engine
        self.folder = folder
        self.service_max = service_max
        self._lock = threading.Lock()
        self._entries: dict[str, ModuleEntry] = {}
        self._compiled: dict[str, wasmtime.Module] = {}
        folder.mkdir(parents=True, exist_ok=True)
        self._load()

    # ---- persistence -------------------------------------------------------------------------
    def _index_path(self) -> Path:
        return self.folder / "index.json"

    def _load(self) -> None:
        path = self._index_path()
        if not path.exists():
            return
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            log.error("%s is corrupt (%s); starting with no modules", path, exc)
            return
        for name, spec in raw.items():
            try:
                entry = ModuleEntry(name, spec["sha256"], spec["size_bytes"], Limits(**spec["max_limits"]),
                                    bool(spec.get("shipped", False)))
                self._compiled[entry.sha256] = self._module(entry.sha256)
                self._entries[name] = entry
            except (KeyError, TypeError, OSError, ModuleRejected, wasmtime.WasmtimeError) as exc:
                log.error("module %r could not be restored (%s); skipped", name, exc)

    def _save(self) -> None:
        data = {e.name: {"sha256": e.sha256, "size_bytes": e.size_bytes, "max_limits": asdict(e.max_limits),
                         "shipped": e.shipped}
                for e in self._entries.values()}
        tmp = self._index_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, self._index_path())

    def _module(self, sha: str) -> wasmtime.Module:
        """The compiled module: from the artifact cache when this wasmtime made one, else compiled now."""
        cached = self.folder / f"{sha}.{WASMTIME_VERSION}.cwasm"
        if cached.exists():
            try:
                return self.engine.deserialize(cached.read_bytes())
            except wasmtime.WasmtimeError:
                log.warning("compiled artifact %s unusable; recompiling", cached.name)
        module = self.engine.compile((self.folder / f"{sha}.wasm").read_bytes())
        cached.write_bytes(self.engine.serialize(module))
        return module

    # ---- API -----------------------------------------------------------------------------
    def register(self, name: str, wasm: bytes, max_limits: Limits | None, *, replace: bool = False,
                 shipped: bool = False) -> tuple[ModuleEntry, ModuleEntry | None]:
        """Store and compile a module under `name`; return it and the entry it replaced, if any.
        `shipped` (the service's own start-up only) may replace anything and marks the entry read-only."""
        if not _NAME.match(name):
            raise ModuleRejected(f"name: {name!r} must be 1-64 of A-Z a-z 0-9 _ . - (starting with a letter or digit)")
        if not shipped:
            self._check_writable(name, replace)  # before compiling: refusing is cheap
        limits = self.clamp_max(max_limits)
        module = self.engine.compile(wasm)  # raises ModuleRejected with the compiler's message
        sha = hashlib.sha256(wasm).hexdigest()
        with self._lock:
            if not shipped:
                self._check_writable(name, replace)
            path = self.folder / f"{sha}.wasm"
            if not path.exists():
                path.write_bytes(wasm)
                (self.folder / f"{sha}.{WASMTIME_VERSION}.cwasm").write_bytes(self.engine.serialize(module))
            self._compiled[sha] = module
            entry = ModuleEntry(name, sha, len(wasm), limits, shipped)
            old = self._entries.get(name)
            self._entries[name] = entry
            self._save()
            if old is not None and old.sha256 != sha:
                self._drop_files_if_unused(old.sha256)
        return entry, old

    def _check_writable(self, name: str, replace: bool) -> None:
        current = self._entries.get(name)
        if current is None:
            return
        if current.shipped:
            raise ModuleReadOnly(f"name: {name!r} is a shipped module and read-only; register yours under another name")
        if not replace:
            raise ModuleExists(f"name: {name!r} is already registered (sha256 {current.sha256[:16]}...); "
                               "set replace to replace it")

    def _drop_files_if_unused(self, sha: str) -> None:
        """Called with the lock held: forget a module's compiled form and delete its files when no name uses it."""
        if any(e.sha256 == sha for e in self._entries.values()):
            return
        self._compiled.pop(sha, None)
        for path in [self.folder / f"{sha}.wasm", *self.folder.glob(f"{sha}.*.cwasm")]:
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def clamp_max(self, requested: Limits | None) -> Limits:
        """A module's maxima: what it asked for (0 = the service's), never above the service's."""
        m = self.service_max
        if requested is None:
            return m
        for field_name in ("fuel", "memory_bytes", "timeout_ms", "max_output_bytes"):
            value = getattr(requested, field_name)
            if value > getattr(m, field_name):
                raise ModuleRejected(f"max_limits.{field_name}: {value} is over the service's maximum {getattr(m, field_name)}")
        return Limits(*(getattr(requested, f) or getattr(m, f) for f in ("fuel", "memory_bytes", "timeout_ms", "max_output_bytes")))

    def delete(self, name: str) -> ModuleEntry | None:
        """Remove `name` (and its files, when no other name uses them); the entry, or None when unknown."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return None
            if entry.shipped:
                raise ModuleReadOnly(f"name: {name!r} is a shipped module and cannot be deleted")
            del self._entries[name]
            self._save()
            self._drop_files_if_unused(entry.sha256)
            return entry

    def lookup(self, name: str = "", sha256: str = "") -> tuple[ModuleEntry, wasmtime.Module] | None:
        with self._lock:
            if name:
                entry = self._entries.get(name)
            else:
                entry = next((e for e in self._entries.values() if e.sha256 == sha256), None)
            if entry is None:
                return None
            return entry, self._compiled[entry.sha256]

    def entries(self) -> list[ModuleEntry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.name)
