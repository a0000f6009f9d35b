"""`cotserve trace check`: send requests through a gateway, each under a trace id of our own (a W3C
`traceparent` in the metadata), then read each trace back from the telemetry service and check it
arrived complete and correctly parented:

  our span ─▶ gateway `generate M` ─┬▶ `queue wait`
                                    ├▶ [post-processing: client span ─▶ sandbox span]
                                    └▶ client span WorkerService/Generate ─▶ worker `generate M`
                                             (events scheduled, first_token, finished) ─▶ queue, prefill, decode
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Callable

SERVER, CLIENT = 2, 3  # OTLP span kinds


@dataclass(slots=True)
class TraceVerdict:
    trace_id: bytes
    problems: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.problems


def verify_trace(spans, our_span_id: bytes, post_processor: str = "") -> list[str]:
    """The problems of one request's trace (empty when complete and correctly parented). `spans`
    are TraceSpan messages from GetTrace."""
    problems: list[str] = []
    by_id = {s.span_id: s for s in spans}

    def children(parent, pred) -> list:
        return [s for s in spans if s.parent_span_id == parent.span_id and pred(s)]

    gateways = [s for s in spans if s.attributes.get("cotserve.component") == "gateway"]
    if len(gateways) != 1:
        return [f"want one gateway request span, found {len(gateways)} (of {len(spans)} spans)"]
    g = gateways[0]
    if g.parent_span_id != our_span_id:
        problems.append(f"gateway span's parent is {g.parent_span_id.hex() or 'none'}, not the caller's span")
    for s in spans:
        if s is not g and s.parent_span_id not in by_id:
            problems.append(f"span {s.name!r} ({s.service_name}) has a parent that never arrived")
    if not children(g, lambda s: s.name == "queue wait"):
        problems.append("no `queue wait` span under the gateway span")
    calls = children(g, lambda s: s.kind == CLIENT and s.name.endswith("WorkerService/Generate"))
    if not calls:
        problems.append("no WorkerService/Generate client span under the gateway span")
    workers = [w for c in calls for w in children(c, lambda s: s.kind == SERVER)]
    if calls and not workers:
        problems.append("no worker span under the gateway's WorkerService/Generate call")
    for w in workers[-1:]:  # the call that served the request (a retry follows a failed one)
        missing = [e for e in ("scheduled", "first_token", "finished") if e not in w.event_names]
        if missing:
            problems.append(f"worker span lacks events {missing}")
        phases = {s.name for s in children(w, lambda s: True)}
        if not {"queue", "prefill", "decode"} <= phases:
            problems.append(f"worker span's phases are {sorted(phases)}, want queue, prefill, decode")
        if w.service_name == g.service_name:
            problems.append(f"worker span came from {w.service_name!r}, the gateway's own service name")
    if post_processor:
        sandbox_calls = children(g, lambda s: s.kind == CLIENT and s.name.endswith("SandboxService/Run"))
        if not any(children(c, lambda s: s.kind == SERVER) for c in sandbox_calls):
            problems.append("no sandbox span (under a SandboxService/Run call from the gateway)")
    return problems


async def check_traces(gateway: str, telemetry: str, n: int, concurrency: int = 4, prompt: str = "37+48-12=",
                       max_new_tokens: int = 32, post_processor: str = "", wait_s: float = 20.0,
                       progress: Callable[[str], None] = lambda msg: None) -> list[TraceVerdict]:
    import grpc

    from cotserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
    from cotserve.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc

    sent: list[tuple[bytes, bytes]] = []
    failures: list[str] = []
    from cotserve.common.tls import aio_channel, env_credentials

    async with aio_channel(gateway, env_credentials(admin=False)) as gch, aio_channel(telemetry, env_credentials()) as tch:
        gw, tel = gateway_pb2_grpc.GatewayServiceStub(gch), telemetry_pb2_grpc.TelemetryServiceStub(tch)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(n):
            queue.put_nowait(i)

        async def client() -> None:
            while not queue.empty():
                queue.get_nowait()
                trace_id, span_id = os.urandom(16), os.urandom(8)
                md = (("traceparent", f"00-{trace_id.hex()}-{span_id.hex()}-01"),)
                req = gateway_pb2.GenerateRequest(prompt=prompt, post_processor=post_processor)
                req.sampling.max_new_tokens = max_new_tokens
                try:
                    await gw.Generate(req, metadata=md, timeout=60)
                    sent.append((trace_id, span_id))
                except grpc.aio.AioRpcError as err:
                    failures.append(f"{err.code().name}: {err.details()}")
                if len(sent) % 10 == 0:
                    progress(f"sent {len(sent)}/{n}")

        await asyncio.gather(*(client() for _ in range(max(1, min(concurrency, n)))))
        if failures:
            raise RuntimeError(f"{len(failures)} of {n} requests failed, first: {failures[0]}")
        verdicts: dict[bytes, TraceVerdict] = {}
        deadline = time.monotonic() + wait_s
        while True:  # exporters batch: give the last spans time to arrive
            for trace_id, span_id in sent:
                resp = await tel.GetTrace(telemetry_pb2.GetTraceRequest(trace_id=trace_id), timeout=10)
                verdicts[trace_id] = TraceVerdict(trace_id, verify_trace(resp.spans, span_id, post_processor))
            done = sum(v.complete for v in verdicts.values())
            progress(f"{done}/{len(sent)} traces complete")
            if done == len(sent) or time.monotonic() > deadline:
                return list(verdicts.values())
            await asyncio.sleep(1.0)
