"""Registered modules: content-addressed on disk, compiled once, surviving restarts.

Layout of the store folder:
    index.json                    name -> {sha256, max limits}
    <sha256>.wasm                 the module as registered
    <sha256>.<wasmtime>.cwasm     wasmtime's serialized compiled artifact for this wasmtime version
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
                entry = ModuleEntry(name, spec["sha256"], spec["size_bytes"], Limits(**spec["max_limits"]))
                self._compiled[entry.sha256] = self._module(entry.sha256)
                self._entries[name] = entry
            except (KeyError, TypeError, OSError, ModuleRejected, wasmtime.WasmtimeError) as exc:
                log.error("module %r could not be restored (%s); skipped", name, exc)

    def _save(self) -> None:
        data = {e.name: {"sha256": e.sha256, "size_bytes": e.size_bytes, "max_limits": asdict(e.max_limits)}
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
    def register(self, name: str, wasm: bytes, max_limits: Limits | None) -> ModuleEntry:
        if not _NAME.match(name):
            raise ModuleRejected(f"name: {name!r} must be 1-64 of A-Z a-z 0-9 _ . - (starting with a letter or digit)")
        limits = self.clamp_max(max_limits)
        module = self.engine.compile(wasm)  # raises ModuleRejected with the compiler's message
        sha = hashlib.sha256(wasm).hexdigest()
        with self._lock:
            path = self.folder / f"{sha}.wasm"
            if not path.exists():
                path.write_bytes(wasm)
                (self.folder / f"{sha}.{WASMTIME_VERSION}.cwasm").write_bytes(self.engine.serialize(module))
            self._compiled[sha] = module
            entry = ModuleEntry(name, sha, len(wasm), limits)
            self._entries[name] = entry
            self._save()
        return entry

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

    def delete(self, name: str) -> bool:
        with self._lock:
            entry = self._entries.pop(name, None)
            if entry is None:
                return False
            self._save()
            if not any(e.sha256 == entry.sha256 for e in self._entries.values()):
                self._compiled.pop(entry.sha256, None)
            return True

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
