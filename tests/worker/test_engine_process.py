"""The engine in its own process: crashes are reported and nothing hangs; an idle engine sleeps."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker
from cotserve.worker.utilization import process_cpu_seconds
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import start_worker as start_worker_process


def test_killing_the_engine_fails_in_flight_calls_with_the_reason_and_health_turns_not_serving():
    deaths: list[str] = []

    async def main():
        worker = await start_worker(WorkerConfig(port=0, max_num_seqs=4), on_engine_death=deaths.append)
        pid = worker.engine.pid
        out = {"engine_pid": pid, "front_pid": os.getpid(), "kernels": worker.engine.kernels}
        try:
            async with grpc.aio.insecure_channel(worker.server.address) as ch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)
                health = health_pb2_grpc.HealthStub(ch)
                # the engine compiles its CPU kernels on a helper thread after start: idle means after that
                settle_by = time.monotonic() + 120
                while True:
                    idle_before = process_cpu_seconds(pid)
                    await asyncio.sleep(1.0)
                    out["idle_cpu_s"] = process_cpu_seconds(pid) - idle_before
                    if out["idle_cpu_s"] < 0.1 or time.monotonic() > settle_by:
                        break
                req = worker_pb2.GenerateRequest(prompt_text="37+48-12=")
                req.sampling.max_new_tokens = 200
                req.sampling.ignore_eos = True
                call = stub.Generate(req, timeout=30)
                got = 0
                try:
                    async for _ in call:
                        got += 1
                        if got == 3:
                            os.kill(pid, signal.SIGKILL)
                except grpc.aio.AioRpcError as err:
                    out["stream"] = (err.code(), err.details(), got)
                deadline = time.monotonic() + 10
                while (await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)).status \
                        != health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() < deadline, "health stayed SERVING after the engine died"
                    await asyncio.sleep(0.05)
                try:
                    await stub.Generate(worker_pb2.GenerateRequest(prompt_text="1+1="), timeout=5).read()
                except grpc.aio.AioRpcError as err:
                    out["after"] = (err.code(), err.details())
            return out
        finally:
            await worker.stop()

    out = asyncio.run(main())
    assert out["engine_pid"] != out["front_pid"]
    assert out["kernels"] == "cpu-native kernels, cpu-native layer ops"  # the engine process's choice, reported back
    assert out["idle_cpu_s"] < 0.1, out["idle_cpu_s"]  # blocked on its input, not spinning
    code, details, got = out["stream"]
    assert code == grpc.StatusCode.UNAVAILABLE and got >= 3
    assert "the engine process died (killed by signal 9)" in details
    assert out["after"] == (grpc.StatusCode.UNAVAILABLE, "engine: the engine process died (killed by signal 9)")
    assert deaths == ["the engine process died (killed by signal 9)"]


def test_a_served_worker_exits_when_its_engine_dies_and_its_engine_dies_with_it():
    """`cotserve serve worker` stops itself (so that `up` restarts it) when its engine dies; and an engine whose
    worker is killed does not outlive it."""
    for victim in ("engine", "front"):
        proc, address = start_worker_process()
        try:
            kids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True).stdout.split()
            engines = [int(k) for k in kids if "cotserve.worker.engine_process" in open(f"/proc/{k}/cmdline").read()]
            assert len(engines) == 1, kids
            (engine,) = engines
            os.kill(engine if victim == "engine" else proc.pid, signal.SIGKILL)
            if victim == "engine":
                assert proc.wait(20) == 0  # a graceful stop, a second after the death
            deadline = time.monotonic() + 20
            while os.path.exists(f"/proc/{engine}") and open(f"/proc/{engine}/stat").read().split()[2] != "Z":
                assert time.monotonic() < deadline, f"the engine outlived its {victim}"
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
