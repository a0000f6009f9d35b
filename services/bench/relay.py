"""The floor under the gateway's added latency: a bare grpc.aio relay of the gateway's GenerateStream to one worker
(no interceptors, tracing, admission, tenants or metrics: only the hop, and gRPC health for the runner), run as its own process by
`cotserve bench baseline` so that the TTFT the gateway adds can be split into what one more grpc.aio hop costs and
what the gateway's own work costs.

    python -m cotserve.bench.relay HOST:PORT WORKER_HOST:PORT
"""

from __future__ import annotations

import sys
import uuid

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from cotserve.common.clitools import run_loop
from cotserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc


class BareRelay(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, worker: worker_pb2_grpc.WorkerServiceStub) -> None:
        self.worker = worker

    async def GenerateStream(self, request: gateway_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext):
        wreq = worker_pb2.GenerateRequest(request_id=uuid.uuid4().hex, prompt_text=request.prompt,
                                          sampling=request.sampling, sla_class=request.sla_class)
        async for chunk in self.worker.Generate(wreq):
            yield gateway_pb2.GenerateStreamResponse(text=chunk.text, token_ids=chunk.token_ids, logprobs=chunk.logprobs,
                                                     finish_reason=chunk.finish_reason, index=chunk.index, part=chunk.part)


async def serve(address: str, worker: str) -> None:
    async with grpc.aio.insecure_channel(worker) as channel:
        server = grpc.aio.server()
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(BareRelay(worker_pb2_grpc.WorkerServiceStub(channel)), server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)  # SERVING: for procs.running
        server.add_insecure_port(address)
        await server.start()
        print(f"relay on {address}", flush=True)
        await server.wait_for_termination()


if __name__ == "__main__":
    from cotserve.common.procs import die_with_supervisor

    die_with_supervisor()
    run_loop(serve(sys.argv[1], sys.argv[2]))
