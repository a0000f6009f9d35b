"""`cotserve up` and `cotserve generate` as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def children_of(pid: int) -> list[int]:
    """The process's children in the order they started (not by pid: pids wrap around)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout

    def started(kid: int) -> int:
        try:
            return int(open(f"/proc/{kid}/stat").read().rsplit(")", 1)[1].split()[19])
        except OSError:
            return 0
    return sorted((int(x) for x in out.split()), key=started)


_handed_out: set[int] = set()


def fixed_port() -> int:
    """A free loopback port below the kernel's ephemeral range, for a service that `cotserve up` starts later on it.
    A port from the ephemeral range (`free_port`) can be taken in the meantime by another of the stack's services
    binding port 0, or by any outbound connection's source port: CI once saw `up`'s gateway, started last, find its
    port so taken. Never the same port twice in a session."""
    import random
    import socket

    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low // 2), low - 16)  # (room for a run of ports: free_port_run)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port below {low}")


def free_port_run(n: int) -> int:
    """The first of `n` consecutive free loopback ports (as `up --metrics-port` takes them), below the ephemeral
    range (`fixed_port`)."""
    import socket

    while True:
        base = fixed_port()
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def check_metrics_and_http_api(metrics_base: int, http_port: int) -> None:
    """Every service's /metrics at `up`'s documented offsets, each with its own metrics; the OpenAI API answers."""
    import json
    import urllib.request

    own = {"gateway": "cotserve_gateway_requests_total", "worker": "vllm:num_requests_running",
           "slo": "cotserve_slo_recommended_replicas", "router": "cotserve_router_policy_publishes",
           "sandbox": "cotserve_sandbox_modules", "telemetry": "cotserve_telemetry_spans_received_total"}
    for offset, (service, name) in enumerate(own.items()):
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_base + offset}/metrics", timeout=10).read().decode()
        assert name in text, (service, text[:500])
    body = json.dumps({"messages": [{"role": "user", "content": "37+48-12="}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    answer = json.load(urllib.request.urlopen(req, timeout=60))
    assert answer["choices"][0]["message"]["content"].strip() == "73"


def test_up_serves_generate_and_stops_everything_on_sigint(tmp_path):
    port = fixed_port()
    log = open(tmp_path / "up.log", "w+")
    telemetry_port, http_port, metrics_base = fixed_port(), fixed_port(), free_port_run(6)
    proc = subprocess.Popen([sys.executable, "-m", "cotserve.cli", "up", "--port", str(port), "--telemetry-port", str(telemetry_port),
                             "--telemetry-http-port", str(fixed_port()), "--http-port", str(http_port),
                             "--metrics-port", str(metrics_base)],
                            stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        deadline = time.monotonic() + 120
        while "cotserve is up" not in (tmp_path / "up.log").read_text():
            assert proc.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "cotserve up did not come up"
            time.sleep(0.2)
        kids = children_of(proc.pid)
        names = [open(f"/proc/{k}/cmdline").read() for k in kids]
        assert len(kids) == 7 and "redis-server" in names[0] and "telemetry" in names[1] and "worker" in names[2]
        assert "slo" in names[3] and "router" in names[4] and "sandbox" in names[5] and "gateway" in names[6]
        assert "--slo" in names[6]
        # the internal services bind a free port themselves and report it: no port picked free and raced for
        assert all("\x00--port\x000\x00" in names[i] for i in (2, 3, 4, 5)), names
        assert "unixsocket" in names[0]
        gen = subprocess.run([sys.executable, "-m", "cotserve.cli", "generate", "37+48-12=", "--address", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=60)
        assert gen.returncode == 0, gen.stderr
        assert gen.stdout.startswith("<think>37+48=85. 85-12=73.</think> 73\n[stop | 6 prompt + 17 completion tokens (14 reasoning) | queue ")
        check_metrics_and_http_api(metrics_base, http_port)
        # up tells the demo worker that "." ends a reasoning step, so step budgets work on the stack
        steps = subprocess.run([sys.executable, "-m", "cotserve.cli", "generate", "12+30-7+5+61-20=", "--address", f"127.0.0.1:{port}",
                                "--max-thinking-steps", "1"], capture_output=True, text=True, timeout=60)
        assert steps.returncode == 0, steps.stderr
        assert steps.stdout.startswith("<think>12+30=42.</think> 42\n"), steps.stdout
        # the reasoning controls together, as a user types them (a vote samples at temperature 1.0 by default)
        vote = subprocess.run([sys.executable, "-m", "cotserve.cli", "generate", "12+30-7+5+61-20=", "--address", f"127.0.0.1:{port}",
                               "--max-thinking-tokens", "40", "--early-exit", "--self-consistency", "8", "--seed", "4"],
                              capture_output=True, text=True, timeout=60)
        assert vote.returncode == 0, vote.stderr
        assert "\nvote: 81 (81 x" in vote.stdout and " probe tokens |" in vote.stdout, vote.stdout
        # every service exports its spans to the telemetry service `up` started, over mutual TLS; the admin commands
        # present the operator certificate from the variables up wrote (tls/operator.env), and without it are refused
        (run,) = (tmp_path / "cache" / "cotserve" / "up").iterdir()
        operator = dict(line.removeprefix("export ").split("=", 1) for line in (run / "tls" / "operator.env").read_text().splitlines())
        assert f"source {run / 'tls' / 'operator.env'}" in (tmp_path / "up.log").read_text()
        admin_env = {**os.environ, **operator}
        check = subprocess.run([sys.executable, "-m", "cotserve.cli", "trace", "check", "--address", f"127.0.0.1:{port}",
                                "--telemetry", f"127.0.0.1:{telemetry_port}", "--n", "8", "--post-processor", "strip-think"],
                               capture_output=True, text=True, timeout=120, env=admin_env)
        assert check.returncode == 0 and "complete and correctly parented: 8/8 = 100.0%" in check.stdout, check.stdout + check.stderr
        heatmap = [sys.executable, "-m", "cotserve.cli", "heatmap", "--address", f"127.0.0.1:{telemetry_port}"]
        heat = subprocess.run(heatmap, capture_output=True, text=True, timeout=60, env=admin_env)
        assert heat.returncode == 0 and "n=12" in heat.stdout, heat.stdout + heat.stderr  # 3 generates, 1 chat, 8 checked
        as_worker = {**admin_env, "COTSERVE_ADMIN_TLS_CERT": str(run / "tls" / "worker.pem"),
                     "COTSERVE_ADMIN_TLS_KEY": str(run / "tls" / "worker.key")}
        for env, code in ((os.environ, "UNAVAILABLE"), (as_worker, "PERMISSION_DENIED")):
            refused = subprocess.run(heatmap, capture_output=True, text=True, timeout=60, env=env)
            assert refused.returncode != 0 and code in refused.stderr, refused.stdout + refused.stderr
        # a killed worker is restarted on its port while the rest keeps running; the stack serves again
        os.kill(kids[2], signal.SIGKILL)
        killed_at = time.monotonic()
        while True:
            again = subprocess.run([sys.executable, "-m", "cotserve.cli", "generate", "37+48-12=", "--address", f"127.0.0.1:{port}",
                                    "--timeout-s", "5"], capture_output=True, text=True, timeout=60)
            if again.returncode == 0:
                break
            assert proc.poll() is None and time.monotonic() - killed_at < 60, (tmp_path / "up.log").read_text()
            time.sleep(0.5)
        assert again.stdout.startswith("<think>37+48=85. 85-12=73.</think> 73\n")
        text = (tmp_path / "up.log").read_text()
        assert "worker: killed by signal 9; restarting in 0.0s" in text and "worker: restarted (start 2)" in text, text
        new_kids = children_of(proc.pid)
        assert kids[2] not in new_kids and len(new_kids) == 7 and set(kids) - {kids[2]} <= set(new_kids)
        # one log folder per run, a file per service, the restart appended to the worker's
        assert {p.name for p in run.glob("*.log")} == {f"{n}.log" for n in
                                                       ("redis", "telemetry", "worker", "slo", "router", "sandbox", "gateway")}
        assert "--- cotserve up: start 2 at" in (run / "worker.log").read_text()
        kids = new_kids
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        for kid in kids:
            assert not os.path.exists(f"/proc/{kid}") or open(f"/proc/{kid}/stat").read().split()[2] == "Z"
    finally:
        if proc.poll() is None:
            proc.terminate()  # up stops its children on SIGTERM
            proc.wait(30)


def test_up_exits_nonzero_with_the_service_error_when_a_service_cannot_start(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cotserve.cli", "up", "--port", str(fixed_port()), "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "worker exited with code 2" in proc.stderr and "config.json: file not found" in proc.stderr


def test_every_cli_flag_has_help_text():
    from typer.main import get_command

    from cotserve.cli import app

    def walk(cmd, path):
        for param in cmd.params:
            if param.param_type_name == "option":
                assert param.help, f"{path} {param.opts} has no help text"
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(get_command(app), "cotserve")


def test_a_port_in_use_is_a_clear_error_not_a_traceback():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for service in (["gateway", "--worker", "127.0.0.1:1"], ["worker"]):
            proc = subprocess.run([sys.executable, "-m", "cotserve.cli", "serve", service[0], "--port", str(port), *service[1:]],
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode == 2
            assert f"port: cannot bind 127.0.0.1:{port} (in use" in proc.stderr and "Traceback" not in proc.stderr


def test_readme_command_table_is_made_from_the_command_line():
    """README.md's command table is what `make readme` makes from the commands' own definitions (a command, flag or
    help text changed without `make readme` fails here), and it lists every command."""
    import typer.main

    from cotserve import cli
    from cotserve.common.clitools import command_rows

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert cli.readme_with_commands(readme) == readme, "README.md's command table is stale: run `make readme`"
    rows = command_rows(typer.main.get_command(cli.app))
    for command in ("cotserve up", "cotserve generate PROMPT", "cotserve serve gateway", "cotserve bench baseline",
                    "cotserve sandbox register NAME FILE", "cotserve demo train"):
        assert f"| `{command}` |" in readme
    assert len(rows) == readme.count("\n| `cotserve ")


def test_version_prints_the_installed_version():
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"cotserve {version('cotserve')}"


def test_up_tls_serves_only_tls_clients_that_trust_its_local_ca(tmp_path):
    """`up --tls`: a local CA made for the run; the gateway's gRPC port, its HTTP API and the heatmap page speak TLS
    only; a client given the CA (COTSERVE_TLS_CA) gets through, a plaintext one does not; the spans still reach
    telemetry over mutual TLS."""
    import json
    import re

    port, http_port, page_port, tel_port = fixed_port(), fixed_port(), fixed_port(), fixed_port()
    log = tmp_path / "up.log"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("COTSERVE_TLS_CA", None)
    proc = subprocess.Popen([sys.executable, "-m", "cotserve.cli", "up", "--tls", "--port", str(port), "--http-port",
                             str(http_port), "--telemetry-port", str(tel_port), "--telemetry-http-port", str(page_port),
                             "--metrics-port", "0"], stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while "cotserve is up" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        ca = re.search(r"TLS: local CA (\S+)", log.read_text()).group(1)
        cmd = [sys.executable, "-m", "cotserve.cli", "generate", "37+48-12=", "--address", f"127.0.0.1:{port}", "--timeout-s", "20"]
        trusted = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**env, "COTSERVE_TLS_CA": ca})
        plain = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        body = json.dumps({"messages": [{"role": "user", "content": "37+48-12="}]})
        https = subprocess.run(["curl", "-s", "--cacert", ca, f"https://127.0.0.1:{http_port}/v1/chat/completions",
                                "-H", "Content-Type: application/json", "-d", body], capture_output=True, text=True, timeout=60)
        insecure_http = subprocess.run(["curl", "-s", f"http://127.0.0.1:{http_port}/v1/models"], capture_output=True,
                                       text=True, timeout=60)
        heat = 0  # the two requests' spans reach telemetry over TLS (the page, over HTTPS, counts them)
        while heat < 2 and time.monotonic() < deadline + 30:
            page = subprocess.run(["curl", "-s", "--cacert", ca, f"https://127.0.0.1:{page_port}/api/heatmap?metric=ttft"],
                                  capture_output=True, text=True, timeout=60).stdout
            heat = sum(c["count"] for c in json.loads(page)["cells"]) if page else 0
            time.sleep(0.5)
        admin = [sys.executable, "-m", "cotserve.cli", "heatmap", "--address", f"127.0.0.1:{tel_port}", "--metric", "ttft"]
        operator = dict(line.removeprefix("export ").split("=", 1)
                        for line in (Path(ca).parent / "operator.env").read_text().splitlines())
        admin_tls = subprocess.run(admin, capture_output=True, text=True, timeout=60, env={**env, **operator})
        admin_plain = subprocess.run(admin, capture_output=True, text=True, timeout=60, env=env)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    assert trusted.returncode == 0 and trusted.stdout.startswith("<think>37+48=85. 85-12=73.</think> 73\n"), trusted.stderr
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
    assert json.loads(https.stdout)["choices"][0]["message"]["content"].strip() == "73"
    assert "data" not in insecure_http.stdout  # plain HTTP to the HTTPS port gets no answer
    assert heat == 2
    assert admin_tls.returncode == 0 and "time to first token" in admin_tls.stdout, admin_tls.stderr  # as operator
    assert admin_plain.returncode != 0 and "UNAVAILABLE" in admin_plain.stderr
    text = log.read_text()
    assert "exited" not in text and "restarting" not in text, text  # every service came up on TLS and stayed up
