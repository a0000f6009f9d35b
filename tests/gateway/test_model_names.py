"""Models by name: a worker serves its model under several names; the gateway lists the first with the others as
aliases and routes a request that names any of them."""

from __future__ import annotations

import asyncio

import pytest

from cotserve.gateway.server import GatewayConfig, start_gateway
from cotserve.sdk import AsyncClient, NotFound
from cotserve.worker.config import WorkerConfig
from cotserve.worker.server import start_worker


def test_every_served_name_reaches_the_model_and_the_first_is_its_name():
    async def main():
        worker = await start_worker(WorkerConfig(engine_process=False, port=0, max_num_seqs=4,
                                                 served_model_name=("arith-small", "arith", "demo")))
        gw = await start_gateway(GatewayConfig(port=0, workers=[worker.server.address]))
        try:
            async with AsyncClient(gw.server.address) as client:
                for _ in range(100):  # the gateway's first poll of the worker
                    models = await client.list_models()
                    if models:
                        break
                    await asyncio.sleep(0.05)
                texts = [(await client.generate("37+48-12=", model=name, max_new_tokens=8)).text
                         for name in ("arith-small", "arith", "demo")]
                with pytest.raises(NotFound, match="model: 'cotserve-demo' is not served here \\(served: arith-small\\)"):
                    await client.generate("1+1=", model="cotserve-demo", max_new_tokens=2)
            return models, texts
        finally:
            await gw.stop()
            await worker.stop()

    models, texts = asyncio.run(main())
    assert [(m.name, m.aliases) for m in models] == [("arith-small", ("arith", "demo"))]
    assert texts[0] == texts[1] == texts[2] and texts[0].startswith("<think>")


def test_served_names_must_be_distinct_and_not_empty():
    with pytest.raises(ValueError, match=r"served_model_name: \['a', 'a'\] names a model twice"):
        WorkerConfig(served_model_name=("a", "a")).validate()
    with pytest.raises(ValueError, match="served_model_name: names must not be empty"):
        WorkerConfig(served_model_name=("a", " ")).validate()
