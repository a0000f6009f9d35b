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
    admission: bool = True
    """Per-class admission: limits and queues per worker (--no-admission forwards every request at once, a
    benchmark baseline)."""
    batch_limit: int = 128
    """BATCH requests in flight per worker at most."""
    batch_restart_limit: int = 8
    """BATCH's in-flight ceiling per worker right after an INTERACTIVE request had to queue here; it doubles at every
    poll without one, back up to batch_limit (BATCH restarts slowly after a burst instead of all at once)."""
    max_queue_interactive: int = 256
    """INTERACTIVE requests waiting per worker at most (then RESOURCE_EXHAUSTED)."""
    max_queue_batch: int = 1024
    """BATCH requests waiting per worker at most (then RESOURCE_EXHAUSTED)."""
    http_port: int | None = None
    """Serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) on this port of
    `host` (0 picks a free one; default: none; `cotserve up` serves it on 8000)."""
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
    slo_address: str | None = None
    """The SLO predictor HOST:PORT: windows are reported to it, its predictions route, and with --slo-admission its
    forecasts hold BATCH (none: heuristics only)."""
    slo_admission: bool = False
    """Hold BATCH in the gateway while an urgent class's forecast is over the threshold (from --slo-throttle-from x
    threshold, a share rising to all at it), drawn again at every forecast refresh. Off by default: in the latest
    full run of `cotserve bench slo` both holding rules were worse than none on both seeds, as they were on two or
    three seeds of three in the run before, and in none of the six before those was a holding rule never worse."""
    slo_routing: bool = False
    """Route among a model's workers by predicted TTFT (the predictor's trained trees, fetched when they change and
    evaluated in the gateway) instead of least loaded. Off by default: in `cotserve bench slo-routing` it was 42%
    better at p90 TTFT than least loaded with a worker short of seats, and 33% worse with a worker busy with traffic
    from elsewhere (the same build, the same hour)."""
    slo_predict_budget_ms: float = 5.0
    """Milliseconds routing waits for a latency prediction from a predictor whose trees this gateway cannot evaluate
    itself (another build's features), before using the load heuristic."""
    slo_retry_after_ms: int = 10_000
    """retry-after-ms, on average (each drawn within +-50%), of a BATCH request turned away because
    --slo-max-held already wait."""
    slo_throttle_from: float = 1.0
    """Where holding BATCH starts, as a fraction of the forecast threshold (1, the default: all BATCH while the
    forecast is over the threshold, none below; 0.5: a share rising from half the threshold)."""
    slo_max_hold_ms: int = 30_000
    """Longest a BATCH request is held on the forecast; then it goes whatever the forecast says."""
    slo_max_held: int = 1024
    """BATCH requests held at once; more are turned away (RESOURCE_EXHAUSTED with retry-after-ms)."""
    slo_pause_batch: bool = True
    """While an urgent class's forecast is at or over the threshold (and urgent requests are in flight), pause the
    model's running BATCH work on its workers (PauseBatch: BATCH sits out every engine step that has urgent work),
    a few seconds at a time, renewed at each forecast refresh. On by default with --slo-shed-over 0.8: together they
    were never worse than no rule, in INTERACTIVE misses or p99 TTFT, on any of six seeds of `cotserve bench slo`'s
    last three full runs (10-58% fewer misses); without --slo, or while the forecast is below the threshold, untrained
    or missing, nothing is paused."""
    slo_max_pause_ms: int = 5_000
    """Longest BATCH stays paused in one go; then it runs for at least half as long before it may be paused again
    (so that BATCH streams keep moving through a long urgent burst)."""
    slo_shed_over: float = 0.8
    """While an urgent class's forecast is at or over the threshold, turn away (RESOURCE_EXHAUSTED, retry-after-ms) an
    INTERACTIVE request that would queue in this gateway and whose TTFT p90, predicted by the SLO predictor's trees
    for the worker picked for it, is over this multiple of the class's TTFT target, rather than queue it behind a
    backlog that makes it, and those after it, miss; 0: never (a client then gets a late answer, not a fast refusal).
    A request turned away counts as a miss; what it buys is the backlog it does not add (`cotserve bench slo`'s
    replays "shed" and "shed and pause", the default with --slo-pause-batch, measure both)."""
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
    worker_wait_s: float = 10.0
    """Seconds a request waits for a worker of its model to come (back) into rotation, e.g. while one restarts,
    before it fails with UNAVAILABLE (never past its deadline; 0: fail at once)."""
    upstream_tls_ca: Path | None = None
    """PEM CA bundle of the workers', sandbox's and SLO predictor's certificates: set, the gateway calls them over TLS
    (presenting its own tls_cert when it has one, for their mutual TLS); unset, in plaintext."""
    grace_s: float = 5.0
    """Seconds to drain in-flight streams on SIGTERM."""

    CLI: ClassVar[dict[str, Cli]] = {
        **legacy_env("host", "workers_file", "poll_interval_s", "batch_limit", "max_queue_interactive",
                     "max_queue_batch", "tenants_file", "redis_url", "prefix_cache_scope", "grace_s"),
        "workers": Cli(flag="--worker", env=("COTSERVE_WORKERS",)),
        "sla_target": Cli(env=("COTSERVE_SLA_TARGETS",)),
        "sandbox_address": Cli(flag="--sandbox-address --sandbox", env=("COTSERVE_SANDBOX_ADDRESS",)),
        "fail_open_modules": Cli(flag="--fail-open"),
        "slo_address": Cli(flag="--slo-address --slo", env=("COTSERVE_SLO_ADDRESS",)),
        "slo_predict_budget_ms": Cli(flag="--slo-predict-budget-ms --slo-budget-ms", env=("COTSERVE_SLO_BUDGET_MS",)),
    }

    @property
    def targets(self) -> dict[SlaClass, SlaTarget]:
        """Every class's target: the defaults with `sla_target`'s overrides."""
        return sla_targets(self.sla_target)

    @property
    def admission_config(self) -> AdmissionConfig:
        """What each worker's admission runs with."""
        return AdmissionConfig(enabled=self.admission, targets=self.targets, batch_limit=self.batch_limit,
                               batch_restart_limit=self.batch_restart_limit,
                               max_queue={SlaClass.INTERACTIVE: self.max_queue_interactive,
                                          SlaClass.BATCH: self.max_queue_batch})

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

    def validate(self) -> None:
        self.check_tls()
        checks = [
            (0 <= self.port <= 65535, f"port: {self.port}, allowed 0..65535"),
            (self.http_port is None or 0 <= self.http_port <= 65535, f"http_port: {self.http_port}, allowed 0..65535"),
            (self.poll_interval_s > 0, f"poll_interval_s: {self.poll_interval_s}, must be > 0"),
            (self.slo_retry_after_ms >= 1, f"slo_retry_after_ms: {self.slo_retry_after_ms}, must be >= 1"),
            (0 < self.slo_throttle_from <= 1, f"slo_throttle_from: {self.slo_throttle_from}, allowed (0, 1]"),
            (self.slo_shed_over == 0 or 0.25 <= self.slo_shed_over <= 100,
             f"slo_shed_over: {self.slo_shed_over}, allowed 0 (off) or 0.25..100"),
            (1_000 <= self.slo_max_pause_ms <= 60_000, f"slo_max_pause_ms: {self.slo_max_pause_ms}, allowed 1000..60000"),
            (self.slo_max_hold_ms >= 0, f"slo_max_hold_ms: {self.slo_max_hold_ms}, must be >= 0"),
            (self.slo_max_held >= 0, f"slo_max_held: {self.slo_max_held}, must be >= 0"),
            (self.prefix_cache_scope in PREFIX_CACHE_SCOPES,
             f"prefix_cache_scope: {self.prefix_cache_scope!r}, allowed: {', '.join(PREFIX_CACHE_SCOPES)}"),
            (self.slo_predict_budget_ms > 0, f"slo_predict_budget_ms: {self.slo_predict_budget_ms}, must be > 0"),
            (self.max_request_bytes >= 1024, f"max_request_bytes: {self.max_request_bytes}, must be >= 1024"),
            (self.worker_wait_s >= 0, f"worker_wait_s: {self.worker_wait_s}, must be >= 0"),
            (self.dns_interval_s > 0, f"dns_interval_s: {self.dns_interval_s}, must be > 0"),
            (self.max_prompt_chars >= 0 and self.max_prompt_tokens >= 0,
             "max_prompt_chars / max_prompt_tokens: must be >= 0 (0: from the model's context)"),
            (self.batch_limit >= 0, f"batch_limit: {self.batch_limit}, must be >= 0"),
            (self.batch_restart_limit >= 0, f"batch_restart_limit: {self.batch_restart_limit}, must be >= 0"),
            (self.max_queue_interactive >= 0, f"max_queue_interactive: {self.max_queue_interactive}, must be >= 0"),
            (self.max_queue_batch >= 0, f"max_queue_batch: {self.max_queue_batch}, must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        sla_targets(self.sla_target)  # each override parses, or a ValueError names sla_target
        self.all_workers()
        for target in self.worker_dns:
            split_name(target)
