"""Chat messages through the gateway: the worker renders them with the model's chat template (the demo model's
writes its BOS token and the turns' contents), so a chat and the prompt it renders to give the same tokens."""

from __future__ import annotations

import grpc
import pytest

from cotserve.sdk import Client, InvalidArgument


def test_a_chat_gives_what_its_rendered_prompt_gives(demo_gateway):
    with Client(demo_gateway) as c:
        direct = c.generate("37+48-12=", max_new_tokens=24)
        chat = c.generate(messages=[{"role": "system", "content": "You add and subtract."},
                                    {"role": "user", "content": "37+48-12="}], max_new_tokens=24)
        streamed = [chunk for chunk in c.stream(messages=[{"role": "user", "content": "37+48-12="}], max_new_tokens=24)]
    assert chat.token_ids == direct.token_ids and chat.text == direct.text and direct.token_ids
    assert [t for ch in streamed for t in ch.token_ids] == direct.token_ids
    # the rendered prompt is "<s>37+48-12=": the BOS token the template wrote, not a second one added on top
    assert chat.usage.prompt_tokens == direct.usage.prompt_tokens


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt="1+1=", messages=[{"role": "user", "content": "1+1="}]), "prompt / messages: give exactly one"),
    (dict(messages=[{"role": "", "content": "x"}]), "messages[0].role: 0 characters, allowed 1..64"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "the demo model takes system, user and assistant turns, not tool"),
    (dict(messages=[{"role": "user", "content": "1+1="}], pre_processor="cot-guard"),
     "pre_processor: runs on a prompt's text; chat messages cannot take one"),
])
def test_bad_chats_name_the_field(demo_gateway, kwargs, message):
    with Client(demo_gateway) as c, pytest.raises(InvalidArgument) as err:
        c.generate(max_new_tokens=2, **kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.message


def test_the_sdk_names_an_unknown_message_key(demo_gateway):
    with Client(demo_gateway) as c, pytest.raises(InvalidArgument, match="messages\\[0\\]: unknown key\\(s\\) image"):
        c.generate(messages=[{"role": "user", "content": "x", "image": "a.png"}])


def test_a_model_without_a_chat_template_refuses_a_chat(tmp_path):
    """A worker whose model ships no template: FAILED_PRECONDITION naming what is missing (prompts still work)."""
    import asyncio
    import shutil

    from cotserve.worker.config import DEMO_MODEL, WorkerConfig
    from cotserve.worker.server import start_worker
    from cotserve.worker.v1 import worker_pb2, worker_pb2_grpc
    from cotserve.common.v1 import common_pb2

    folder = tmp_path / "no-template"
    shutil.copytree(DEMO_MODEL, folder)
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().split('"chat_template"')[0].rstrip().rstrip(",") + "\n}\n")

    async def main():
        worker = await start_worker(WorkerConfig(model=folder, port=0, engine_process=False))
        try:
            async with grpc.aio.insecure_channel(worker.server.address) as ch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)
                sampling = common_pb2.SamplingParams(max_new_tokens=2)
                ok = [c async for c in stub.Generate(worker_pb2.GenerateRequest(prompt_text="1+1=", sampling=sampling))]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(worker_pb2.GenerateRequest(
                            messages=[common_pb2.ChatMessage(role="user", content="1+1=")], sampling=sampling)):
                        pass
            return ok, err.value
        finally:
            await worker.stop()

    ok, err = asyncio.run(main())
    assert ok and err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "messages: this model has no chat template" in err.details()
