"""Workers going down and coming back: rotation, retry before the first token, UNAVAILABLE after."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from cotserve.sdk import Client, Unavailable
from tests.conftest import free_port, start_gateway, start_worker, stop_process


def wait_for(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture
def two_workers():
    procs = [start_worker("--max-num-seqs", "8") for _ in range(2)]
    yield procs
    for proc, _ in procs:
        if proc.poll() is None:
            stop_process(proc)


def healthy(client: Client) -> int:
    return client.list_models()[0].num_healthy_workers


def test_dead_worker_leaves_rotation_within_2s_and_returns_when_healthy(two_workers):
    (w0, a0), (w1, a1) = two_workers
    gw, address = start_gateway(a0, a1)
    try:
        with Client(address, timeout_s=30) as client:
            assert healthy(client) == 2
            w0.kill()
            w0.wait()
            took = wait_for(lambda: healthy(client) == 1, 2.0, "the dead worker to leave rotation")
            assert took < 2.0
            for i in range(4):  # every request lands on the live worker
                assert client.generate(f"{i}+1=", max_new_tokens=32).text.endswith(f" {i + 1}")
            port = a0.rsplit(":", 1)[1]
            back = subprocess.Popen([sys.executable, "-m", "cotserve.cli", "serve", "worker", "--port", port],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                wait_for(lambda: healthy(client) == 2, 60.0, "the restarted worker to rejoin")
            finally:
                stop_process(back)
    finally:
        stop_process(gw)


def test_worker_dying_before_the_first_token_is_retried_once_on_another(two_workers):
    (w0, a0), (w1, a1) = two_workers
    # A slow poll: the gateway still believes the first worker is healthy when the request arrives.
    gw, address = start_gateway(a0, a1, extra=("--poll-interval-s", "30"))
    try:
        w0.kill()
        w0.wait()
        with Client(address, timeout_s=30) as client:
            r = client.generate("37+48-12=", max_new_tokens=64)
            assert r.text == "<think>37+48=85. 85-12=73.</think> 73"
    finally:
        stop_process(gw)


def test_worker_dying_after_the_first_token_is_unavailable_to_the_client(two_workers):
    (w0, a0), (w1, a1) = two_workers
    gw, address = start_gateway(a0, a1, extra=("--poll-interval-s", "30"))
    try:
        with Client(address, timeout_s=30) as client:
            stream = client.stream("1+2+3=", max_new_tokens=250, ignore_eos=True)
            next(stream)
            w0.kill()  # the first worker (equal load: the first listed) serves this stream
            w0.wait()
            with pytest.raises(Unavailable, match=f"worker {a0} failed after the first token"):
                for _ in stream:
                    pass
    finally:
        stop_process(gw)


def test_gateway_without_workers_refuses_to_start():
    proc = subprocess.run([sys.executable, "-m", "cotserve.cli", "serve", "gateway", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "worker: give at least one --worker HOST:PORT (or --workers-file, or --worker-dns NAME:PORT)" in proc.stderr


def test_workers_file(tmp_path, demo_worker):
    f = tmp_path / "workers.toml"
    f.write_text(f'workers = ["{demo_worker}"]\n')
    gw, address = start_gateway(extra=("--workers-file", str(f)))
    try:
        with Client(address) as client:
            assert healthy(client) == 1
    finally:
        stop_process(gw)
