"""The MoE router's settings (`cotserve serve router` is generated from them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from cotserve.common.config import Cli, legacy_env
from cotserve.common.tls import TlsSettings


@dataclass(slots=True)
class RouterConfig(TlsSettings):
    """Everything `cotserve serve router` takes: each field is one setting (`common.config`), its docstring the help."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis of the MoE control plane."""
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 50081
    """Port to bind (0 picks a free one)."""
    balance: bool = True
    """Run the load-balancing loop."""
    balance_interval_s: float = 2.0
    """Seconds between balancing rounds."""
    balance_window_s: float = 10.0
    """Seconds of expert load each round looks at."""
    gamma: float = 0.05
    """Bias step of the balancing rule (> 0)."""
    rule: str = "sign"
    """sign: b += gamma * sign(mean - load); proportional: b += gamma * clip((mean - load) / mean, -1, 1)."""
    models: list[str] = field(default_factory=list)
    """Models to consume load for and balance (repeatable; default: every model with a registered shape)."""
    metrics_port: int = 0
    """Port for Prometheus /metrics on `host` (0 = off)."""
    grace_s: float = 5.0
    """Seconds to drain in-flight calls on SIGTERM."""

    CLI: ClassVar[dict[str, Cli]] = {**legacy_env("redis_url", "host", "grace_s"), "models": Cli(flag="--model")}

    def validate(self) -> None:
        self.check_tls()
        checks = [
            (self.gamma > 0, f"gamma: {self.gamma}, must be > 0"),
            (self.balance_interval_s > 0, f"balance_interval_s: {self.balance_interval_s}, must be > 0"),
            (self.balance_window_s > 0, f"balance_window_s: {self.balance_window_s}, must be > 0"),
            (self.rule in ("sign", "proportional"), f"rule: {self.rule!r}, allowed: sign, proportional"),
            (0 <= self.port <= 65535, f"port: {self.port}, allowed 0..65535"),
            (0 <= self.metrics_port <= 65535, f"metrics_port: {self.metrics_port}, allowed 0..65535"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
