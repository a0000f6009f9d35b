"""The topology `cotserve up` starts on one machine, and the benchmarks a part of: which services, in which order,
wired to which addresses. `common.procs.running` starts and stops what `stack` returns."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

METRICS_PORT_OFFSETS = {"gateway": 0, "worker": 1, "slo": 2, "router": 3, "sandbox": 4, "telemetry": 5}
"""Each service's Prometheus /metrics port under `up`: the base port (`--metrics-port`, 9301) plus its offset."""


def tls_env(tls, name: str) -> dict[str, str]:
    """Service `name`'s TLS settings as environment variables (`tls`: a `common.tlsgen.StackTls`, or None for
    plaintext). Inside (`tls.internal`): every service but the gateway serves mutual TLS with its identity's
    certificate and authorizes its callers (`common.authz`); the gateway calls them presenting its own. Outside
    (`tls.public`): the gateway's ports and the heatmap page speak TLS with the server certificate."""
    if tls is None:
        return {}
    prefix = f"COTSERVE_{name.upper()}_"
    cert, key = tls.identity(name)
    env: dict[str, str] = {}
    if name == "gateway":
        if tls.internal:
            env.update({prefix + "UPSTREAM_TLS_CA": str(tls.ca), prefix + "UPSTREAM_TLS_CERT": str(cert),
                        prefix + "UPSTREAM_TLS_KEY": str(key)})
        if tls.public:
            env.update({prefix + "TLS_CERT": str(tls.folder / "server.pem"), prefix + "TLS_KEY": str(tls.folder / "server.key")})
        return env
    if tls.internal:
        env.update({prefix + "TLS_CERT": str(cert), prefix + "TLS_KEY": str(key), prefix + "TLS_CLIENT_CA": str(tls.ca)})
    if name == "telemetry":
        env[prefix + "HTTP_TLS"] = "true" if tls.public and tls.internal else "false"
    return env


def otlp_env(telemetry_addr: str, tls, name: str) -> dict[str, str]:
    """Where service `name` exports its spans (batched every half second): with mutual TLS inside, trusting the CA
    and presenting its identity's certificate."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"{'https' if tls and tls.internal else 'http'}://{telemetry_addr}",
           "OTEL_EXPORTER_OTLP_INSECURE": "false" if tls and tls.internal else "true", "OTEL_BSP_SCHEDULE_DELAY": "500"}
    if tls and tls.internal:
        cert, key = tls.identity(name)
        env.update({"OTEL_EXPORTER_OTLP_CERTIFICATE": str(tls.ca), "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(cert),
                    "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(key)})
    return env


def ready_credentials(tls, name: str):
    """How `up` checks service `name`'s health: as `operator` inside, trusting the CA on the gateway's public port
    with `tls.public`, else in plaintext."""
    if tls is None or (name == "gateway" and not tls.public) or (name != "gateway" and not tls.internal):
        return None
    return tls.credentials(None if name == "gateway" else "operator")


def metrics_ports(base: int) -> dict[str, int]:
    """Every service's /metrics port from the base (0: none)."""
    return {name: base + offset for name, offset in METRICS_PORT_OFFSETS.items()} if base else {}


def stack(model: Optional[Path], port: int, redis_url: Optional[str], full: bool = True,
          worker_extra: tuple[str, ...] = (), gateway_extra: tuple[str, ...] = (),
          telemetry_port: int = 4317, telemetry_http_port: int = 8317, log_dir: Optional[Path] = None,
          http_port: Optional[int] = None, metrics_port: int = 0, tls=None) -> tuple[list, str]:
    """The services `up` starts, in start order, and the Redis URL they share. `full=False` (benchmarks)
    starts only the worker and the gateway. With `full`, the telemetry service starts first and every other service
    exports its spans to it (`otlp_env`); the gateway reports its windows to the SLO predictor and follows its
    forecasts. `http_port` turns on the gateway's HTTP API; `metrics_port` (not 0) every service's /metrics, at it plus
    the service's `METRICS_PORT_OFFSETS`; `tls` (`common.tlsgen.StackTls`) mutual TLS between the services and/or TLS
    on the gateway's ports (`tls_env`).

    Only the ports a user names (the gateway's, its HTTP API's, telemetry's, metrics) are fixed. The internal services
    bind a free port themselves and report it (`Child.argv_for`); the embedded Redis listens on a unix socket
    of its own. Start them in order: each one's command line is built when it starts, from the
    addresses its dependencies reported."""
    from cotserve.common.procs import Child, python_cli, redis_socket_child

    ports = metrics_ports(metrics_port)
    metrics = lambda name: ["--metrics-port", str(ports[name])] if ports else []  # noqa: E731
    children = []
    if redis_url is None and full:
        redis, redis_url = redis_socket_child()
        redis.log_dir = log_dir
        children.append(redis)
    shared = {"COTSERVE_REDIS_URL": redis_url} if redis_url else {}
    telemetry_addr = f"127.0.0.1:{telemetry_port}"

    def env(name: str) -> dict[str, str]:
        return {**shared, **tls_env(tls, name), **(otlp_env(telemetry_addr, tls, name) if full and name != "telemetry" else {})}

    def service(name: str, args: Callable[[int], list[str]], fixed_port: int = 0) -> Child:
        return Child(name, f"127.0.0.1:{fixed_port}" if fixed_port else "", [], None, env(name), log_dir=log_dir,
                     argv_for=lambda p: python_cli("serve", name, "--port", str(p), *metrics(name), *args(p)),
                     port=fixed_port, credentials=ready_credentials(tls, name))

    if full:
        children.append(service("telemetry", lambda p: ["--http-port", str(telemetry_http_port)], telemetry_port))
    # the bundled demo model ends each reasoning step with "."; another model's steps are its operator's to name
    demo = ["--reasoning-step", "."] if model is None and "--model" not in worker_extra else []
    model_args = ["--model", str(model)] if model else []
    worker = service("worker", lambda p: [*demo, *worker_extra, *model_args])
    children.append(worker)
    linked: list[Child] = []
    if full:
        slo, router, sandbox = (service(name, lambda p: []) for name in ("slo", "router", "sandbox"))
        children += [slo, router, sandbox]
        linked = [sandbox, slo]

    def gateway_args(p: int) -> list[str]:
        links = ["--sandbox", linked[0].address, "--slo", linked[1].address] if linked else []
        http = ["--http-port", str(http_port)] if http_port is not None else []
        return ["--worker", worker.address, *links, *http, *gateway_extra]

    children.append(service("gateway", gateway_args, port))
    return children, redis_url
