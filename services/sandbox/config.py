"""The WASI sandbox's settings (`cotserve serve sandbox` is generated from them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from cotserve.common.config import Cli, legacy_env
from cotserve.common.paths import cache_dir
from cotserve.common.tls import TlsSettings

if TYPE_CHECKING:
    from cotserve.sandbox.runner import Limits

ADMIN_TOKEN_MIN_CHARS = 16


@dataclass(slots=True)
class SandboxConfig(TlsSettings):
    """Everything `cotserve serve sandbox` takes: each field is one setting (`common.config`), its docstring the help."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 50071
    """Port to bind (0 picks a free one)."""
    store_dir: Path = field(default_factory=lambda: cache_dir("sandbox"))
    """Folder for registered modules and compiled artifacts (kept across restarts)."""
    pool_size: int = field(default_factory=lambda: max(2, os.cpu_count() or 2))
    """Runs executing at once (default: the CPU count, at least 2)."""
    per_module_concurrency: int | None = None
    """Runs of one module at once (default: half the pool), so a hostile module delays only its own callers."""
    default_fuel: int = 100_000_000
    """Fuel (wasmtime's instruction budget) of a run that asks for none."""
    default_memory_bytes: int = 64 << 20
    """Linear memory of a run that asks for none."""
    default_timeout_ms: int = 1000
    """Wall-clock limit of a run that asks for none."""
    default_output_bytes: int = 1 << 20
    """Output (stdout) of a run that asks for none."""
    cap_fuel: int = 10_000_000_000
    """The most fuel any module may be allowed."""
    cap_memory_bytes: int = 512 << 20
    """The most linear memory any module may be allowed."""
    cap_timeout_ms: int = 10_000
    """The longest wall-clock limit any module may be allowed."""
    cap_output_bytes: int = 16 << 20
    """The most output any module may be allowed."""
    max_input_bytes: int = 4 << 20
    """Largest stdin accepted."""
    register_shipped: bool = True
    """Register the shipped modules (strip-think, redact, cot-guard) at start; they are read-only."""
    admin_token_file: Path | None = None
    """File holding the token RegisterModule and DeleteModule need, at least 16 characters (default: one made at
    first start in <store_dir>/admin-token, mode 0600)."""
    metrics_port: int = 0
    """Port for Prometheus /metrics on `host` (0 = off)."""
    grace_s: float = 5.0
    """Seconds to drain in-flight runs on SIGTERM."""

    CLI: ClassVar[dict[str, Cli]] = {
        **legacy_env("host", "grace_s"),
        "store_dir": Cli(env=("COTSERVE_SANDBOX_STORE",)),
        "pool_size": Cli(env=("COTSERVE_SANDBOX_POOL",)),
        "register_shipped": Cli(flag="--register-shipped/--no-shipped"),
    }

    @property
    def default_limits(self) -> Limits:
        """Limits of a run that asks for none."""
        from cotserve.sandbox.runner import Limits

        return Limits(self.default_fuel, self.default_memory_bytes, self.default_timeout_ms, self.default_output_bytes)

    @property
    def max_limits(self) -> Limits:
        """The most any module may be allowed."""
        from cotserve.sandbox.runner import Limits

        return Limits(self.cap_fuel, self.cap_memory_bytes, self.cap_timeout_ms, self.cap_output_bytes)

    def configured_admin_token(self) -> str | None:
        """The token in `admin_token_file` (None without one); a ValueError names the file when it cannot serve."""
        if self.admin_token_file is None:
            return None
        try:
            token = self.admin_token_file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"admin_token_file: cannot read {self.admin_token_file}: {exc.strerror}") from None
        if len(token) < ADMIN_TOKEN_MIN_CHARS:
            raise ValueError(f"admin_token_file: {self.admin_token_file} holds {len(token)} characters; "
                             f"use at least {ADMIN_TOKEN_MIN_CHARS}")
        return token

    def validate(self) -> None:
        self.check_tls()
        checks = [
            (0 <= self.port <= 65535, f"port: {self.port}, allowed 0..65535"),
            (0 <= self.metrics_port <= 65535, f"metrics_port: {self.metrics_port}, allowed 0..65535"),
            (self.pool_size >= 1, f"pool_size: {self.pool_size}, must be >= 1"),
            (self.per_module_concurrency is None or self.per_module_concurrency >= 1,
             f"per_module_concurrency: {self.per_module_concurrency}, must be >= 1"),
            (self.max_input_bytes >= 1, f"max_input_bytes: {self.max_input_bytes}, must be >= 1"),
        ]
        for name in ("fuel", "memory_bytes", "timeout_ms", "output_bytes"):
            default, cap = getattr(self, f"default_{name}"), getattr(self, f"cap_{name}")
            checks.append((0 < default <= cap, f"default_{name}: {default}, must be within 1..cap_{name} ({cap})"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.configured_admin_token()
