"""Tenants: API keys (stored only as SHA-256 hashes), allowed SLA classes and limits.

The tenants file is TOML:

    [tenants.acme]
    key_sha256 = ["9f86d08..."]
    sla_classes = ["realtime", "interactive", "batch"]   # absent: interactive and batch (REALTIME is granted)
    requests_per_min = 600
    tokens_per_min = 200000
    max_concurrent = 16
    modules = ["strip-think", "cot-guard"]   # sandbox modules it may name (absent: any)
    raw_tokens = true   # token ids and logprobs stream even when a post-processor rewrites the text (absent: false)

Without a file the gateway has one open tenant, `default`, with no limits and every class (for local use).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import tomli_w

from cotserve.common.auth import bearer
from cotserve.common.errors import PermissionDenied, Unauthenticated
from cotserve.common.sampling import SlaClass

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_LIMITS = ("requests_per_min", "tokens_per_min", "max_concurrent")
DEFAULT_CLASSES = frozenset({SlaClass.INTERACTIVE, SlaClass.BATCH})
"""What a tenant in the file may use unless its `sla_classes` says otherwise: REALTIME jumps every queue,
so it is granted explicitly."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    key_sha256: frozenset[str] = frozenset()
    sla_classes: frozenset[SlaClass] = DEFAULT_CLASSES
    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    max_concurrent: int | None = None
    modules: frozenset[str] | None = None  # sandbox modules it may name; None = any
    raw_tokens: bool = False  # token ids and logprobs are sent even when a post-processor rewrites the text

    @property
    def has_limits(self) -> bool:
        return any(getattr(self, name) is not None for name in _LIMITS)


OPEN_TENANT = Tenant("default", sla_classes=frozenset(SlaClass))


@dataclass(slots=True)
class TenantRegistry:
    tenants: dict[str, Tenant] = field(default_factory=dict)
    is_open: bool = True
    _by_hash: dict[str, Tenant] = field(default_factory=dict)

    @classmethod
    def open(cls) -> "TenantRegistry":
        return cls({OPEN_TENANT.name: OPEN_TENANT}, True)

    @classmethod
    def from_file(cls, path: Path) -> "TenantRegistry":
        tenants = load_tenants(path)
        reg = cls(tenants, False)
        for t in tenants.values():
            for h in t.key_sha256:
                reg._by_hash[h] = t
        return reg

    def authenticate(self, metadata: Mapping[str, str] | Iterable[tuple[str, str | bytes]]) -> Tenant:
        """The tenant an `authorization: Bearer KEY` header names (the open tenant without a file).
        A request that sends the header more than once is refused: which copy a proxy or the
        gateway would honour is not something a client should be able to play with."""
        if self.is_open:
            return OPEN_TENANT
        key, sent = bearer(metadata)
        if sent > 1:
            raise Unauthenticated(f"authorization: sent {sent} times; send exactly one `authorization: Bearer <key>`")
        if key is None:
            raise Unauthenticated("authorization: missing API key (send `authorization: Bearer <key>`)")
        tenant = self._by_hash.get(hash_key(key))
        if tenant is None:
            raise Unauthenticated("authorization: unknown API key")
        return tenant

    @staticmethod
    def authorize(tenant: Tenant, cls: SlaClass) -> None:
        if cls not in tenant.sla_classes:
            allowed = ", ".join(c.name for c in sorted(tenant.sla_classes))
            raise PermissionDenied(f"sla_class: tenant {tenant.name!r} may not use {cls.name} (allowed: {allowed})")


def load_tenants(path: Path) -> dict[str, Tenant]:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"tenants_file: {path} not found") from None
    except OSError as exc:
        raise ValueError(f"tenants_file: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"tenants_file: {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"tenants_file: {path} is not valid TOML ({exc})") from None
    out: dict[str, Tenant] = {}
    tables = raw.get("tenants") or {}
    if not isinstance(tables, dict):
        raise ValueError(f"tenants_file: {path}: `tenants` must be a table of [tenants.NAME] tables")
    for name, spec in tables.items():
        where = f"tenants_file: {path}: tenant {name!r}"
        if not _NAME.match(name) or not isinstance(spec, dict):
            raise ValueError(f"{where}: names are 1-64 of A-Z a-z 0-9 _ . -, each a table")
        hashes = spec.get("key_sha256", [])
        if not isinstance(hashes, list) or not all(isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes):
            raise ValueError(f"{where}: key_sha256 must be a list of 64-hex-digit SHA-256 hashes")
        listed = spec.get("sla_classes", [c.name.lower() for c in DEFAULT_CLASSES])
        try:
            if not isinstance(listed, list):
                raise KeyError(listed)
            classes = frozenset(SlaClass[c.upper()] for c in listed)
        except (KeyError, AttributeError):
            raise ValueError(f"{where}: sla_classes must list realtime, interactive and/or batch") from None
        limits = {}
        for key in _LIMITS:
            value = spec.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{where}: {key} must be an integer >= 1 (or absent for no limit)")
            limits[key] = value
        modules = spec.get("modules")
        if modules is not None and (not isinstance(modules, list) or not all(isinstance(m, str) for m in modules)):
            raise ValueError(f"{where}: modules must be a list of sandbox module names (or absent for any)")
        raw = spec.get("raw_tokens", False)
        if not isinstance(raw, bool):
            raise ValueError(f"{where}: raw_tokens must be true or false")
        out[name] = Tenant(name, frozenset(hashes), classes, **limits,
                           modules=frozenset(modules) if modules is not None else None, raw_tokens=raw)
    if not out:
        raise ValueError(f"tenants_file: {path} defines no [tenants.NAME] table")
    return out


def _toml(tenants: dict[str, Tenant]) -> str:
    """The tenants file, written by a TOML writer so that every allowed name (dots included) round-trips."""
    table: dict[str, dict] = {}
    for t in tenants.values():
        spec: dict = {"key_sha256": sorted(t.key_sha256), "sla_classes": [c.name.lower() for c in sorted(t.sla_classes)]}
        spec.update({key: getattr(t, key) for key in _LIMITS if getattr(t, key) is not None})
        if t.modules is not None:
            spec["modules"] = sorted(t.modules)
        if t.raw_tokens:
            spec["raw_tokens"] = True
        table[t.name] = spec
    header = ("# cotserve tenants. API keys are stored as SHA-256 hashes only; add one with\n"
              "# `cotserve tenants add-key NAME --file THIS_FILE`.\n\n")
    return header + tomli_w.dumps({"tenants": table})


def add_key(path: Path, name: str, sla_classes: frozenset[SlaClass] | None = None, **limits: int | None) -> str:
    """Create a key for tenant `name` (the tenant too, with `limits`, if new); store its hash; return the key.
    `sla_classes` replaces the tenant's classes when given."""
    if not _NAME.match(name):
        raise ValueError(f"name: {name!r} must be 1-64 of A-Z a-z 0-9 _ . -")
    tenants = load_tenants(path) if path.exists() else {}
    key = "cs-" + secrets.token_urlsafe(32)
    current = tenants.get(name, Tenant(name))
    updates = {k: v for k, v in limits.items() if v is not None}
    tenants[name] = Tenant(name, current.key_sha256 | {hash_key(key)}, sla_classes or current.sla_classes,
                           **{k: updates.get(k, getattr(current, k)) for k in _LIMITS}, modules=current.modules,
                           raw_tokens=current.raw_tokens)
    path.write_text(_toml(tenants))
    return key
