"""The topology `cotserve up` starts on one machine, and the benchmarks a part of: which services, in which order,
wired to which addresses. `common.procs.running` starts and stops what `stack` returns."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

METRICS_PORT_OFFSETS = {"gateway": 0, "worker": 1, "slo": 2, "router": 3, "sandbox": 4, "telemetry": 5}
"""Each service's Prometheus /metrics port under `up`: the base port (`--metrics-port`, 9301) plus its offset."""


def tls_env(tls) -> dict[str, str]:
    """Every service's TLS settings as environment variables (each reads only its own), the gateway trusting the CA
    for the services it calls."""
    if tls is None:
        return {}
    env = {"COTSERVE_GATEWAY_UPSTREAM_TLS_CA": str(tls.ca)}
    for name in METRICS_PORT_OFFSETS:
        env[f"COTSERVE_{name.upper()}_TLS_CERT"] = str(tls.server_cert)
        env[f"COTSERVE_{name.upper()}_TLS_KEY"] = str(tls.server_key)
    return env


def otlp_env(telemetry_addr: str, tls) -> dict[str, str]:
    """Where every service exports its spans (batched every half second), over TLS trusting the CA with `tls`."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"{'https' if tls else 'http'}://{telemetry_addr}",
            "OTEL_EXPORTER_OTLP_INSECURE": "false" if tls else "true", "OTEL_BSP_SCHEDULE_DELAY": "500",
            **({"OTEL_EXPORTER_OTLP_CERTIFICATE": str(tls.ca)} if tls else {})}


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
    the service's `METRICS_PORT_OFFSETS`; `tls` (`common.tlsgen.TlsFiles`) makes every service speak TLS only.

    Only the ports a user names (the gateway's, its HTTP API's, telemetry's, metrics) are fixed. The internal services
    bind a free port themselves and report it (`Child.argv_for`); the embedded Redis listens on a unix socket
    of its own. Start them in order: each one's command line is built when it starts, from the
    addresses its dependencies reported."""
    from cotserve.common.procs import Child, grpc_ready, python_cli, redis_socket_child

    ports = metrics_ports(metrics_port)
    metrics = lambda name: ["--metrics-port", str(ports[name])] if ports else []  # noqa: E731

    def service(name: str, args: Callable[[int], list[str]], env: dict[str, str]) -> Child:
        return Child(name, "", [], None, env, log_dir=log_dir,
                     argv_for=lambda p: python_cli("serve", name, "--port", str(p), *metrics(name), *args(p)))

    children = []
    if redis_url is None and full:
        redis, redis_url = redis_socket_child()
        redis.log_dir = log_dir
        children.append(redis)
    env = {"COTSERVE_REDIS_URL": redis_url} if redis_url else {}
    env.update(tls_env(tls))
    if full:
        telemetry_addr = f"127.0.0.1:{telemetry_port}"
        children.append(Child("telemetry", telemetry_addr,
                              python_cli("serve", "telemetry", "--port", str(telemetry_port), "--http-port", str(telemetry_http_port),
                                         *metrics("telemetry")),
                              grpc_ready(telemetry_addr), env, log_dir=log_dir))
        env = {**env, **otlp_env(telemetry_addr, tls)}
    # the bundled demo model ends each reasoning step with "."; another model's steps are its operator's to name
    demo = ["--reasoning-step", "."] if model is None and "--model" not in worker_extra else []
    model_args = ["--model", str(model)] if model else []
    worker = service("worker", lambda p: [*demo, *worker_extra, *model_args], env)
    children.append(worker)
    gateway_args: list[Child] = []
    if full:
        slo = service("slo", lambda p: [], env)
        router = service("router", lambda p: [], env)
        sandbox = service("sandbox", lambda p: [], env)
        children += [slo, router, sandbox]
        gateway_args = [sandbox, slo]
    gateway_addr = f"127.0.0.1:{port}"

    def gateway_argv(p: int) -> list[str]:
        linked = ["--sandbox", gateway_args[0].address, "--slo", gateway_args[1].address] if gateway_args else []
        http = ["--http-port", str(http_port)] if http_port is not None else []
        return python_cli("serve", "gateway", "--port", str(port), "--worker", worker.address, *linked, *http,
                          *metrics("gateway"), *gateway_extra)

    children.append(Child("gateway", gateway_addr, [], grpc_ready(gateway_addr), env, argv_for=gateway_argv,
                          log_dir=log_dir, port=port))
    return children, redis_url
