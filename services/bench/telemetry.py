"""`cotserve bench telemetry`: spans per second the telemetry service's OTLP receiver sustains.

The load is pre-serialized OTLP export requests of whole request traces, up to 512 spans each
(the SDK's default batch: 56 traces, 504 spans),
modelled on a real request's trace: the gateway's summary span with its attributes, `queue wait`,
the client span, the worker span with its events and its three phase spans, a sandbox call and its
span: 9 spans per request. The same bytes are sent, with the same concurrency, to the telemetry
service and to a null OTLP receiver (parses each request, counts its spans, keeps nothing), each a
separate process on this machine; the ratio is what aggregation and the trace store cost on top of
gRPC and protobuf.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass

from cotserve.common.clitools import run_loop
from cotserve.telemetry.otlpbuild import export_request, gateway_attrs, span

SPANS_PER_REQUEST = 9
BATCH_SPANS = 512  # the OTel SDK's default max export batch
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def synthetic_batches(num_batches: int, spans_per_batch: int = 512, seed: int = 0) -> list[bytes]:
    """Serialized export requests of whole request traces, at most `spans_per_batch` spans each."""
    rng = random.Random(seed)
    now = time.time_ns()
    batches = []
    for _ in range(num_batches):
        spans = []
        while len(spans) + SPANS_PER_REQUEST <= spans_per_batch:
            trace_id, end = rng.randbytes(16), now - rng.randrange(0, 600) * 10**9
            ttft = rng.lognormvariate(3.0, 0.6)
            g = span({**gateway_attrs(ttft=ttft, e2e=ttft + rng.uniform(50, 800), queue=rng.uniform(0, 5), tpot=rng.uniform(2, 20),
                                      kv_frac=rng.random(), version=f"model@{rng.choice('ab')}",
                                      sla=rng.choice(["SLA_CLASS_REALTIME", "SLA_CLASS_INTERACTIVE", "SLA_CLASS_BATCH"]),
                                      tenant=rng.choice(["acme", "globex", "default"])),
                      "gen_ai.operation.name": "text_completion", "gen_ai.request.model": "model",
                      "gen_ai.usage.input_tokens": 64, "gen_ai.usage.output_tokens": 64}, end, trace_id=trace_id)
            q = span({"cotserve.worker": "127.0.0.1:50061"}, end, "queue wait", trace_id, parent=g.span_id)
            c = span({"rpc.system": "grpc", "rpc.method": "Generate"}, end, "/cotserve.worker.v1.WorkerService/Generate",
                     trace_id, parent=g.span_id)
            w = span({"gen_ai.request.model": "model", "cotserve.preemptions": 0}, end, "generate model", trace_id, parent=c.span_id)
            for name in ("scheduled", "first_token", "finished"):
                w.events.add(name=name, time_unix_nano=end)
            phases = [span({}, end, name, trace_id, parent=w.span_id) for name in ("queue", "prefill", "decode")]
            sc = span({"rpc.system": "grpc"}, end, "/cotserve.sandbox.v1.SandboxService/Run", trace_id, parent=g.span_id)
            sb = span({"cotserve.sandbox.module": "strip-think"}, end, "sandbox.run strip-think", trace_id, parent=sc.span_id)
            spans += [g, q, c, w, *phases, sc, sb]
        batches.append(export_request(spans).SerializeToString())
    return batches


@dataclass(slots=True, frozen=True)
class ReceiverRun:
    name: str
    spans: int
    seconds: float

    @property
    def spans_per_s(self) -> float:
        return self.spans / self.seconds


async def drive(address: str, batches: list[bytes], spans_per_batch: int, concurrency: int, name: str) -> ReceiverRun:
    """Send every batch (after one warm-up) with `concurrency` calls in flight; time it."""
    import grpc

    async with grpc.aio.insecure_channel(address) as ch:
        await asyncio.wait_for(ch.channel_ready(), 30)
        export = ch.unary_unary(EXPORT_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        await export(batches[0], timeout=30)  # warm-up
        it = iter(batches)

        async def client() -> None:
            for b in it:
                await export(b, timeout=60)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return ReceiverRun(name, len(batches) * spans_per_batch, time.perf_counter() - start)


def _null_receiver(port: int) -> None:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Null(trace_service_pb2_grpc.TraceServiceServicer):
        spans = 0

        async def Export(self, request, context):
            self.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    async def main() -> None:
        server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Null(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    run_loop(main())


def run(num_batches: int, concurrency: int, progress) -> tuple[ReceiverRun, ReceiverRun, dict]:
    """Both receivers, each in its own process; returns (null, telemetry, telemetry's stats)."""
    import grpc

    from cotserve.common.procs import Child, free_port, grpc_ready, python_cli, wait_serving
    from cotserve.bench.warm import running
    from cotserve.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc

    progress(f"building {num_batches} export requests of up to {BATCH_SPANS} spans ...")
    batches = synthetic_batches(num_batches, BATCH_SPANS)
    per_batch = BATCH_SPANS // SPANS_PER_REQUEST * SPANS_PER_REQUEST
    results = []
    null_port = free_port()
    null = Child("null-receiver", f"127.0.0.1:{null_port}",
                 [sys.executable, "-m", "cotserve.bench.telemetry", "--null-receiver", str(null_port)], lambda: True)
    tel_port = free_port()
    tel = Child("telemetry", f"127.0.0.1:{tel_port}", python_cli("serve", "telemetry", "--port", str(tel_port), "--no-state"),
                grpc_ready(f"127.0.0.1:{tel_port}"))
    stats = {}
    for child in (null, tel):
        with running([child], grace_s=2.0, wait=lambda c: wait_serving(c, 60, lambda: None)):
            progress(f"sending {num_batches * per_batch} spans to the {child.name} ...")
            results.append(run_loop(drive(child.address, batches, per_batch, concurrency, child.name)))
            if child is tel:
                with grpc.insecure_channel(child.address) as ch:
                    s = telemetry_pb2_grpc.TelemetryServiceStub(ch).GetStats(telemetry_pb2.GetStatsRequest(), timeout=10)
                    stats = {"spans_received": s.spans_received, "spans_malformed": s.spans_malformed,
                             "requests_aggregated": s.requests_aggregated}
    return results[0], results[1], stats


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Helper process of `cotserve bench telemetry`.")
    parser.add_argument("--null-receiver", type=int, required=True, help="Port of the null OTLP receiver to run.")
    _null_receiver(parser.parse_args().null_receiver)
    os._exit(0)
