"""Prometheus metrics of the gateway and the worker, scraped over HTTP as Prometheus would."""

# In-process workers here run their engine as a thread (engine_process=False): these tests are about metrics, not
# the engine process boundary, which tests/worker/test_engine_process.py and every CLI-started worker cover;
# a second interpreter importing torch per worker would add about 2 s to each start.

from __future__ import annotations

import asyncio

from cotserve.gateway.server import GatewayConfig, start_gateway
from cotserve.sdk import AsyncClient, InvalidArgument
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker
from tests.conftest import free_port
from tests.metrics import scrape, value


def test_metrics_are_scraped_from_both_services():
    wport, gport = free_port(), free_port()

    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4, metrics_port=wport))
        gateway = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address], metrics_port=gport))
        try:
            async with AsyncClient(gateway.server.address) as c:
                await c.generate("1+1=", max_new_tokens=16)
                await c.generate("2+2=", max_new_tokens=16)
                await c.generate("3+3=", max_new_tokens=16, sla="batch")
                try:
                    await c.generate("4+4=", temperature=9.0)
                except InvalidArgument:
                    pass
                async for _ in c.stream("5+5=", max_new_tokens=200, ignore_eos=True, sla="realtime"):
                    busy = await asyncio.to_thread(scrape, wport)  # one request running, its pages held
                    break
            for _ in range(100):  # the cancelled stream's pages are freed at the engine's next step
                w = await asyncio.to_thread(scrape, wport)
                if value(w, "cotserve_worker_kv_blocks_used", model="cotserve-demo") == 0:
                    break
                await asyncio.sleep(0.05)
            await gateway.pool.poll_once()
            return await asyncio.to_thread(scrape, gport), w, worker.server.address, busy
        finally:
            await gateway.stop()
            await worker.stop()

    g, w, worker_address, busy = asyncio.run(main())
    ok = dict(model="cotserve-demo", tenant="default", code="OK")
    assert value(g, "cotserve_gateway_requests_total", sla_class="INTERACTIVE", **ok) == 2
    assert value(g, "cotserve_gateway_requests_total", sla_class="BATCH", **ok) == 1
    assert value(g, "cotserve_gateway_requests_total", model="cotserve-demo", sla_class="INTERACTIVE", code="INVALID_ARGUMENT",
                 tenant="default") == 1
    assert value(g, "cotserve_gateway_ttft_seconds_count", model="cotserve-demo", sla_class="INTERACTIVE") == 2
    assert value(g, "cotserve_gateway_request_duration_seconds_count", model="cotserve-demo", sla_class="BATCH") == 1
    assert value(g, "cotserve_gateway_queue_seconds_count", model="cotserve-demo", sla_class="INTERACTIVE") == 2
    assert value(g, "cotserve_gateway_inter_token_latency_seconds_count", model="cotserve-demo", sla_class="INTERACTIVE") > 0
    assert value(g, "cotserve_gateway_in_flight_requests", model="cotserve-demo", sla_class="INTERACTIVE") == 0
    assert value(g, "cotserve_gateway_queued_requests", model="cotserve-demo", sla_class="BATCH") == 0
    assert value(g, "cotserve_gateway_worker_kv_blocks_total", worker=worker_address, model="cotserve-demo") == 4 * 16
    assert value(g, "cotserve_gateway_worker_healthy", worker=worker_address, model="cotserve-demo") == 1
    assert value(g, "cotserve_gateway_admission_limit", worker=worker_address, model="cotserve-demo", sla_class="BATCH") == 128
    assert 2 <= value(g, "cotserve_gateway_admission_limit", worker=worker_address, model="cotserve-demo",
                      sla_class="INTERACTIVE") <= 32  # moved by the inter-token gaps within its range
    assert not [name for name, _ in g if name.startswith("cotserve_worker_")]  # the workers' own names are theirs
    assert value(w, "cotserve_worker_kv_blocks_total", model="cotserve-demo") == 4 * 16
    assert value(w, "cotserve_worker_kv_blocks_used", model="cotserve-demo") == 0
    assert value(w, "cotserve_worker_requests_finished_total", model="cotserve-demo") == 4
    # load under cotserve's names and vLLM's, for endpoint pickers and autoscalers built for vLLM
    for ours, vllm in (("cotserve_worker_num_requests_running", "vllm:num_requests_running"),
                       ("cotserve_worker_num_requests_waiting", "vllm:num_requests_waiting"),
                       ("cotserve_worker_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc")):
        assert value(busy, ours, model="cotserve-demo") == value(busy, vllm, model_name="cotserve-demo")
    assert value(busy, "vllm:num_requests_running", model_name="cotserve-demo") == 1
    assert value(busy, "vllm:num_requests_waiting", model_name="cotserve-demo") == 0
    assert 0 < value(busy, "vllm:kv_cache_usage_perc", model_name="cotserve-demo") <= 1
    assert value(w, "vllm:kv_cache_usage_perc", model_name="cotserve-demo") == 0
    steps = value(w, "cotserve_worker_step_latency_seconds_count", model="cotserve-demo")
    assert steps >= 3 * 8 and value(w, "cotserve_worker_step_latency_seconds_bucket", model="cotserve-demo", le="+Inf") == steps
    assert value(w, "cotserve_worker_step_latency_seconds_sum", model="cotserve-demo") > 0
    assert value(w, "cotserve_worker_generated_tokens_total", model="cotserve-demo") >= 3 * 8
