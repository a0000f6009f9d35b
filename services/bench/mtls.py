"""What mutual TLS between the services costs: `cotserve bench baseline`'s mTLS section.

Two stacks of a worker and a gateway on the same checkpoint, started side by side, one with the services calling each
other in plaintext (`up --insecure-internal`), one with mutual TLS and the authorization table (`up`'s default). The
load and the one-at-a-time TTFT requests alternate between them, so that both see the same machine."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cotserve.common.clitools import run_loop


@dataclass(slots=True)
class MtlsRun:
    """One stack's measurements: output tok/s of each load run, TTFT samples (ms) straight to the worker and
    through the gateway."""

    label: str
    tokens_per_s: list[float]
    direct_ms: list[float]
    gateway_ms: list[float]


async def _ttft_rounds(paths: list[tuple[str, str, Any]], prompt: str, rounds: int) -> list[tuple[list[float], list[float]]]:
    """For each (gateway, worker, the worker's credentials) of `paths`: `rounds` requests one at a time straight to the
    worker (as the gateway's identity, where mutual TLS asks for one) and as many through the gateway (plaintext at the
    front on both stacks), interleaved across paths, on channels opened once and warmed by five rounds first; their
    TTFTs, ms."""
    from contextlib import AsyncExitStack

    from cotserve.bench.throughput import first_token_ms
    from cotserve.common.tls import aio_channel
    from cotserve.common.v1 import common_pb2
    from cotserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
    from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc

    sampling = common_pb2.SamplingParams(max_new_tokens=1, ignore_eos=True)
    wrequest = worker_pb2.GenerateRequest(prompt_text=prompt, sampling=sampling)
    grequest = gateway_pb2.GenerateStreamRequest(prompt=prompt, sampling=sampling)
    out: list[tuple[list[float], list[float]]] = [([], []) for _ in paths]
    async with AsyncExitStack() as channels:
        stubs = []
        for gateway, worker, credentials in paths:
            wch = await channels.enter_async_context(aio_channel(worker, credentials))
            gch = await channels.enter_async_context(aio_channel(gateway, None))
            stubs.append((worker_pb2_grpc.WorkerServiceStub(wch), gateway_pb2_grpc.GatewayServiceStub(gch)))
        for i in range(rounds + 5):
            for (wstub, gstub), (direct, via) in zip(stubs, out):
                d = await first_token_ms(wstub.Generate(wrequest))
                v = await first_token_ms(gstub.GenerateStream(grequest))
                if i >= 5:
                    direct.append(d)
                    via.append(v)
    return out


def measure(model_dir: Path, concurrency: int, prompt_tokens: int, max_new_tokens: int, requests: int, rounds: int,
            load_runs: int, say: Callable[[str], None]) -> list[MtlsRun]:
    """The plaintext stack and the mTLS stack: `load_runs` load runs each (alternating), then `rounds` TTFT
    requests each (interleaved, one at a time)."""
    from cotserve.bench.throughput import prompt_of_tokens, run_level
    from cotserve.bench.warm import running
    from cotserve.common.procs import free_port
    from cotserve.common.tlsgen import stack_tls
    from cotserve.common.topology import stack
    from cotserve.sdk import AsyncClient

    with tempfile.TemporaryDirectory(prefix="cotserve-mtls-") as folder:
        tls = stack_tls(Path(folder), internal=True)
        plain_children, _ = stack(model_dir, free_port(), None, full=False)
        tls_children, _ = stack(model_dir, free_port(), None, full=False, tls=tls)
        runs = [MtlsRun("plaintext (--insecure-internal)", [], [], []), MtlsRun("mutual TLS (the default)", [], [], [])]
        stacks = [(plain_children, None), (tls_children, tls.credentials("gateway"))]
        with running(plain_children + tls_children, on_start=lambda child: say(f"starting {child.name} ...")):
            async def main() -> None:
                gateways = [children[-1].address for children, _ in stacks]
                async with AsyncClient(gateways[0]) as c:
                    prompt = await prompt_of_tokens(c, prompt_tokens)
                for gateway in gateways:  # warm both: connections, caches
                    await run_level(gateway, concurrency, prompt, 4, concurrency, multiplex=True)
                for n in range(load_runs):
                    for run, gateway in zip(runs, gateways):
                        say(f"{run.label}: load run {n + 1}/{load_runs}, {requests} requests at concurrency {concurrency} ...")
                        level = await run_level(gateway, concurrency, prompt, max_new_tokens, requests, multiplex=True)
                        run.tokens_per_s.append(level.output_tokens / level.seconds)
                say(f"TTFT: {rounds} requests one at a time to each worker and through each gateway, interleaved ...")
                paths = [(gateway, children[0].address, credentials) for gateway, (children, credentials) in zip(gateways, stacks)]
                for run, (direct, via) in zip(runs, await _ttft_rounds(paths, prompt, rounds)):
                    run.direct_ms, run.gateway_ms = direct, via

            run_loop(main())
    return runs


def print_cost(console, runs: list[MtlsRun]) -> None:
    """The table, and the cost against the goals (end-to-end tokens/s within 5 %, gateway TTFT within 0.3 ms)."""
    from rich.table import Table

    from cotserve.common.stats import percentile

    table = Table(title="mutual TLS between the services: the same load on two stacks side by side")
    for column in ("internal calls", "output tok/s (median of runs)", "TTFT p50 worker direct, ms",
                   "TTFT p50 via gateway, ms", "gateway adds, ms"):
        table.add_column(column, justify="right" if column != "internal calls" else "left")
    rates, via = [], []
    for run in runs:
        rate = percentile(sorted(run.tokens_per_s), 50)
        direct50, via50 = percentile(sorted(run.direct_ms), 50), percentile(sorted(run.gateway_ms), 50)
        rates.append(rate)
        via.append(via50)
        table.add_row(run.label, f"{rate:,.0f}", f"{direct50:.2f}", f"{via50:.2f}", f"{via50 - direct50:.2f}")
    console.print(table)
    loss = 1 - rates[1] / rates[0]
    added = via[1] - via[0]
    console.print(f"mutual TLS costs {loss:+.1%} of end-to-end tokens/s (goal <= 5%: {'met' if loss <= 0.05 else 'NOT met'}) "
                  f"and {added:+.2f} ms of TTFT through the gateway (goal <= 0.3 ms: {'met' if added <= 0.3 else 'NOT met'})",
                  soft_wrap=True)
