"""The gateway's settings (`cotserve serve gateway` is generated from them)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from cotserve.common.config import Cli, legacy_env
from cotserve.common.sampling import SlaClass
from cotserve.common.sla import SlaTarget, sla_targets
from cotserve.common.tls import TlsSettings
from cotserve.gateway.admission import AdmissionConfig
from cotserve.gateway.slo_settings import SloSettings

PREFIX_CACHE_SCOPES = ("tenant", "global")


def split_name(target: str) -> tuple[str, int]:
    """NAME:PORT (a worker_dns entry) -> (NAME, PORT); ValueError names the bad value."""
    name, _, port = target.rpartition(":")
    if not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker_dns: {target!r} is not NAME:PORT")
    return name, int(port)
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


@dataclass(slots=True)
class GatewayConfig(TlsSettings):
    """Everything `cotserve serve gateway` takes: each field is one setting (`common.config`), its docstring the help."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 50051
    """Port to bind (0 picks a free one)."""
    workers: list[str] = field(default_factory=list)
    """Worker address HOST:PORT (repeatable)."""
    workers_file: Path | None = None
    """TOML file with `workers = ["HOST:PORT", ...]`, added to `workers`."""
    worker_dns: list[str] = field(default_factory=list)
    """NAME:PORT whose every address is a worker, e.g. a Kubernetes headless Service (repeatable): re-resolved every
    dns_interval_s; new addresses join, vanished ones are drained (their streams finish, no new ones start)."""
    dns_interval_s: float = 5.0
    """Seconds between resolutions of worker_dns (a scale-up or scale-down is seen within about this long)."""
    poll_interval_s: float = 0.5
    """Seconds between Stats polls of each worker."""
    sla_target: tuple[str, ...] = ()
    """CLASS=TTFT_MS/ITL_P95_MS, e.g. interactive=1000/100 (repeatable; defaults: realtime=250/50,
    interactive=1000/100, batch=30000/1000)."""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    """Per-worker admission (its settings are its own fields: `--admission`, `--batch-limit`, ...)."""
    http_port: int | None = None
    """Serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) on this port of
    `host` (0 picks a free one; default: none; `cotserve up` serves it on 8000)."""
    http_body_timeout_s: float = 30.0
    """Seconds an HTTP client has to send its whole request body once its headers are in (then 408)."""
    http_max_connections_per_client: int = 1024
    """Open HTTP connections one client address may hold; one more is answered 429 and closed. Behind Envoy every
    connection comes from Envoy's address: keep this at least Envoy's upstream max_connections (1024 by default)."""
    metrics_port: int = 0
    """Port for Prometheus /metrics on `host` (0 = off)."""
    tenants_file: Path | None = None
    """TOML tenants file (API key hashes, classes, limits); without one, a single open tenant."""
    redis_url: str | None = None
    """Redis that holds tenant limits (shared by every gateway); needed when tenants have limits."""
    sandbox_address: str | None = None
    """The WASI sandbox service HOST:PORT that runs pre- and post-processors (none: requests naming one fail
    closed)."""
    fail_open_modules: frozenset[str] = frozenset()
    """Module whose failure lets the text through unchanged (repeatable; default: every module fails closed)."""
    slo: SloSettings = field(default_factory=SloSettings)
    """The SLO predictor and the rules that act on its forecasts (its settings are `--slo-*`)."""
    prefix_cache_scope: str = "tenant"
    """Who shares workers' prefix-cache blocks: tenant (only requests of the same tenant: a shared cache would
    leak one tenant's prompts to another through timing) or global (every request)."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Largest request message accepted, in bytes (gRPC refuses a larger one with RESOURCE_EXHAUSTED before
    reading it)."""
    max_prompt_chars: int = 0
    """Prompt characters allowed at most; 0: what the model's context can hold (its context times its longest
    token, which the worker reports), so a prompt that cannot fit is refused before any worker tokenizes it."""
    max_prompt_tokens: int = 0
    """Prompt tokens allowed at most (the worker checks after tokenizing); 0: the model's context less one."""
    worker_multiplex: bool = True
    """Send each worker every request as a stream of one long-lived Multiplex call (no call set-up per request, one
    message per engine step for all its streams); off: a Generate call per request. Workers without Multiplex (older
    builds) are called per request either way."""
    max_session_streams: int = 256
    """Streams one Session call may have open at once; one more is refused (RESOURCE_EXHAUSTED), so that a single
    client cannot fill the workers' queues through one call (0: no limit)."""
    worker_wait_s: float = 10.0
    """Seconds a request waits for a worker of its model to come (back) into rotation, e.g. while one restarts,
    before it fails with UNAVAILABLE (never past its deadline; 0: fail at once)."""
    upstream_tls_ca: Path | None = None
    """PEM CA bundle of the workers', sandbox's and SLO predictor's certificates: set, the gateway calls them over TLS
    (presenting upstream_tls_cert, else its own tls_cert, for their mutual TLS); unset, in plaintext."""
    upstream_tls_cert: Path | None = None
    """PEM certificate the gateway presents to the services it calls (its `gateway` identity, `cotserve tls init`),
    so that its public port can keep a certificate of its own, or none."""
    upstream_tls_key: Path | None = None
    """PEM private key of upstream_tls_cert."""
    grace_s: float = 5.0
    """Seconds to drain in-flight streams on SIGTERM."""

    CLI: ClassVar[dict[str, Cli]] = {
        **legacy_env("host", "workers_file", "poll_interval_s", "tenants_file", "redis_url", "prefix_cache_scope",
                     "grace_s"),
        "admission": Cli(prefix=""),
        "workers": Cli(flag="--worker", env=("COTSERVE_WORKERS",)),
        "sla_target": Cli(env=("COTSERVE_SLA_TARGETS",)),
        "sandbox_address": Cli(flag="--sandbox-address --sandbox", env=("COTSERVE_SANDBOX_ADDRESS",)),
        "fail_open_modules": Cli(flag="--fail-open"),
    }

    @property
    def targets(self) -> dict[SlaClass, SlaTarget]:
        """Every class's target: the defaults with `sla_target`'s overrides."""
        return sla_targets(self.sla_target)

    def all_workers(self) -> list[str]:
        """`workers` and those in `workers_file`, each HOST:PORT, once each; a ValueError names what is wrong."""
        addresses = list(self.workers)
        if self.workers_file is not None:
            try:
                data = tomllib.loads(self.workers_file.read_text())
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ValueError(f"workers_file: cannot read {self.workers_file}: {exc}") from None
            listed = data.get("workers")
            if not isinstance(listed, list) or not all(isinstance(a, str) for a in listed):
                raise ValueError(f"workers_file: {self.workers_file} needs `workers = [\"HOST:PORT\", ...]`")
            addresses += listed
        for a in addresses:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"worker: {a!r} is not HOST:PORT")
        if not addresses and not self.worker_dns:
            raise ValueError("worker: give at least one --worker HOST:PORT (or --workers-file, or --worker-dns NAME:PORT)")
        return list(dict.fromkeys(addresses))

    def upstream_credentials(self):
        """grpc.ChannelCredentials for the workers, sandbox and SLO predictor (None: plaintext)."""
        return self.client_credentials(self.upstream_tls_ca, self.upstream_tls_cert, self.upstream_tls_key)

    def validate(self) -> None:
        self.check_tls()
        if (self.upstream_tls_cert is None) != (self.upstream_tls_key is None):
            raise ValueError("upstream_tls_cert / upstream_tls_key: give both or neither")
        if self.upstream_tls_cert is not None and self.upstream_tls_ca is None:
            raise ValueError("upstream_tls_cert: presenting a certificate needs upstream_tls_ca (the upstreams' CA)")
        checks = [
            (0 <= self.port <= 65535, f"port: {self.port}, allowed 0..65535"),
            (self.http_port is None or 0 <= self.http_port <= 65535, f"http_port: {self.http_port}, allowed 0..65535"),
            (self.poll_interval_s > 0, f"poll_interval_s: {self.poll_interval_s}, must be > 0"),
            (self.prefix_cache_scope in PREFIX_CACHE_SCOPES,
             f"prefix_cache_scope: {self.prefix_cache_scope!r}, allowed: {', '.join(PREFIX_CACHE_SCOPES)}"),
            (self.max_request_bytes >= 1024, f"max_request_bytes: {self.max_request_bytes}, must be >= 1024"),
            (self.worker_wait_s >= 0, f"worker_wait_s: {self.worker_wait_s}, must be >= 0"),
            (self.max_session_streams >= 0, f"max_session_streams: {self.max_session_streams}, must be >= 0"),
            (self.http_body_timeout_s > 0, f"http_body_timeout_s: {self.http_body_timeout_s}, must be > 0"),
            (self.http_max_connections_per_client >= 1,
             f"http_max_connections_per_client: {self.http_max_connections_per_client}, must be >= 1"),
            (self.dns_interval_s > 0, f"dns_interval_s: {self.dns_interval_s}, must be > 0"),
            (self.max_prompt_chars >= 0 and self.max_prompt_tokens >= 0,
             "max_prompt_chars / max_prompt_tokens: must be >= 0 (0: from the model's context)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.admission.validate()
        self.slo.validate()
        sla_targets(self.sla_target)  # each override parses, or a ValueError names sla_target
        self.all_workers()
        for target in self.worker_dns:
            split_name(target)
