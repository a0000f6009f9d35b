"""Tool calling through the OpenAI-compatible API against a real stack: a tiny Qwen3 checkpoint (random weights, the
demo tokenizer) served with Qwen3's published chat template, which shows the tools and writes calls as Hermes'
`<tool_call>` blocks, so the worker parses them (`--tool-call-parser auto` finds hermes). Random weights never call a
tool of their own accord, so the calls here are the enforced ones (required, a named function), parsed back out of the
answer as the `auto` path parses them; the official `openai` client (whole and streamed) and LangChain's `bind_tools`
with a tool round trip."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

transformers = pytest.importorskip("transformers")

from cotserve.common.procs import free_port  # noqa: E402
from tests.conftest import start_gateway, start_worker, stop_process  # noqa: E402
from tests.worker.engine_helpers import save_tiny_checkpoint  # noqa: E402
from tests.worker.models.test_oracle import BASE  # noqa: E402

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja"
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": ADD}},
         {"type": "function", "function": {"name": "weather", "description": "Today's weather.", "parameters": CITY}}]
MESSAGES = [{"role": "user", "content": "What is 2+3, and the weather in Oslo?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(HTTP base URL, gRPC address) of a gateway in front of the tiny Qwen3 worker."""
    # (the template writes the tools out in its system turn: about a thousand of the demo tokenizer's tokens)
    folder = tmp_path_factory.mktemp("tools") / "tiny-qwen3"
    save_tiny_checkpoint(transformers.Qwen3Config(**dict(BASE, max_position_embeddings=4096)), folder, seed=3)
    (folder / "chat_template.jinja").write_text(TEMPLATE.read_text())
    worker, address = start_worker("--model", str(folder), "--max-num-seqs", "4", "--reasoning-parser", "none")
    port = free_port()
    gateway, grpc_address = start_gateway(address, extra=("--http-port", str(port)))
    yield f"http://127.0.0.1:{port}/v1", grpc_address
    stop_process(gateway)
    stop_process(worker)


@pytest.fixture(scope="module")
def base(stack):
    return stack[0]


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)


def check_call(call, schemas: dict[str, dict]) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_required_choice_returns_parsed_calls_that_follow_each_functions_schema(base):
    with client(base) as c:
        r = c.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                      max_tokens=400, temperature=1.0, seed=1)
        single = c.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=2)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert 1 <= len(choice.message.tool_calls) <= 4
    for call in choice.message.tool_calls:
        check_call(call, {"add": ADD, "weather": CITY})
    assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_named_function_is_the_one_called_and_streaming_says_what_the_whole_response_says(base):
    named = {"type": "function", "function": {"name": "weather"}}
    with client(base) as c:
        whole = c.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                          max_tokens=120, temperature=1.0, seed=5)
        events = list(c.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                                max_tokens=120, temperature=1.0, seed=5, stream=True))
    (call,) = whole.choices[0].message.tool_calls
    check_call(call, {"weather": CITY})
    deltas = [d for e in events for d in (e.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "weather", call.function.arguments)]
    assert events[-1].choices[0].finish_reason == "tool_calls"


def test_no_tool_is_called_under_none_and_a_tool_round_trip_renders(base):
    with client(base) as c:
        plain = c.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=16, temperature=0.0)
        first = c.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, tools=TOOLS,
                                          tool_choice={"type": "function", "function": {"name": "add"}},
                                          max_tokens=120, temperature=1.0, seed=7)
        call = first.choices[0].message.tool_calls[0]
        history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = c.chat.completions.create(model="tiny-qwen3", messages=history, tools=TOOLS, max_tokens=8,
                                           temperature=0.0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_langchains_bind_tools_and_a_round_trip(base):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Numbers(BaseModel):  # bounded: random weights would write integers of any length
        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    @tool(args_schema=Numbers)
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    llm = ChatOpenAI(model="tiny-qwen3", base_url=base, api_key="unused", max_retries=0, temperature=1.0,
                     max_tokens=120, seed=11)
    ai = llm.bind_tools([add], tool_choice="add").invoke([HumanMessage("What is 2+3?")])
    (call,) = ai.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    answer = llm.bind_tools([add]).invoke([HumanMessage("What is 2+3?"), ai,
                                           ToolMessage(str(add.invoke(call["args"])), tool_call_id=call["id"])])
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_tools_for_a_model_that_writes_no_calls_are_refused_naming_the_flag(demo_worker):
    port = free_port()
    gateway, _ = start_gateway(demo_worker, extra=("--http-port", str(port)))
    try:
        with client(f"http://127.0.0.1:{port}/v1") as c, pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(model="cotserve-demo", messages=MESSAGES, tools=TOOLS)
    finally:
        stop_process(gateway)
    assert refused.value.body["param"] == "tools" and "--tool-call-parser" in refused.value.message


def test_the_sdk_over_grpc_carries_tools_and_typed_calls(stack):
    from cotserve.sdk import Client, ToolCall

    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    with Client(stack[1]) as sdk:
        r = sdk.generate(messages=MESSAGES, tools=tools, tool_choice="add", max_new_tokens=120, temperature=1.0, seed=3)
        chunks = list(sdk.stream(messages=MESSAGES, tools=tools, tool_choice="add", max_new_tokens=120,
                                 temperature=1.0, seed=3))
        (call,) = r.tool_calls
        again = sdk.generate(messages=[*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": call.id, "content": "5"}],
                             tools=tools, max_new_tokens=4, temperature=0.0)
    assert isinstance(call, ToolCall) and r.finish_reason == "tool_calls" and call.name == "add"
    jsonschema.validate(json.loads(call.arguments), ADD)
    assert [(c.name, c.arguments) for chunk in chunks for c in chunk.tool_calls] == [(call.name, call.arguments)]
    assert again.usage.prompt_tokens > r.usage.prompt_tokens
