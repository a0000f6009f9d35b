"""Structured output through the OpenAI-compatible API against a real stack (the session's demo worker, a gateway
with the HTTP API), with the clients people call it with: the `openai` client's `parse` with a Pydantic model,
`response_format` JSON object and schema (whole and streamed), vLLM's `guided_*` and `structured_outputs`, and
LangChain's `with_structured_output`; and the gRPC API through the SDK. The demo model is a reasoning model: its
thinking stays free, its answer follows the format."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from cotserve.common.procs import free_port
from cotserve.sdk import Client, InvalidArgument
from tests.conftest import start_gateway, stop_process, wait_worker_idle

MESSAGES = [{"role": "user", "content": "37+48-12="}]


class Answer(BaseModel):
    value: int = Field(ge=-200, le=200)
    sign: Literal["positive", "negative", "zero"]
    checked: bool


@pytest.fixture(scope="module")
def base(demo_worker):
    port = free_port()
    proc, _ = start_gateway(demo_worker, extra=("--http-port", str(port)))
    yield f"http://127.0.0.1:{port}/v1"
    stop_process(proc)
    wait_worker_idle(demo_worker)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)


def test_the_openai_clients_parse_fills_a_pydantic_model_and_the_thinking_stays_free(base):
    with client(base) as c:
        r = c.chat.completions.parse(model="cotserve-demo", messages=MESSAGES, response_format=Answer,
                                     max_tokens=200, temperature=1.0, seed=3)
    message = r.choices[0].message
    assert isinstance(message.parsed, Answer) and r.choices[0].finish_reason == "stop"
    assert Answer.model_validate_json(message.content) == message.parsed
    assert re.search(r"\d+[+-]\d+=\d+", message.reasoning)  # the demo's arithmetic, unconstrained


def test_json_object_and_schema_whole_and_streamed(base):
    schema = Answer.model_json_schema()
    with client(base) as c:
        whole = c.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=200, seed=5,
                                          temperature=1.0, response_format={"type": "json_schema", "json_schema": {
                                              "name": "answer", "schema": schema, "strict": True}})
        stream = c.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=200, seed=5,
                                           temperature=1.0, stream=True, response_format={
                                               "type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                                      "strict": True}})
        content = "".join(e.choices[0].delta.content or "" for e in stream if e.choices)
        obj = c.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=200, seed=1,
                                        response_format={"type": "json_object"})
    Answer.model_validate_json(whole.choices[0].message.content)
    assert content == whole.choices[0].message.content  # the same seed: the same answer, in pieces
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")


def test_vllms_guided_fields_and_structured_outputs(base):
    with client(base) as c:
        def ask(**extra):
            r = c.chat.completions.create(model="cotserve-demo", messages=MESSAGES, max_tokens=120, temperature=1.0,
                                          extra_body=extra)
            return r.choices[0].message.content

        assert ask(guided_choice=["seventy-three", "73", "unknown"]) in ("seventy-three", "73", "unknown")
        assert re.fullmatch(r"[0-9]{2}!", ask(guided_regex=r"[0-9]{2}!"))
        assert re.fullmatch(r"-?[0-9]+", ask(structured_outputs={"regex": r"-?[0-9]+"}))
        Answer.model_validate_json(ask(guided_json=Answer.model_json_schema()))
        assert ask(structured_outputs={"grammar": 'root ::= "yes" | "no"'}) in ("yes", "no")
        completion = c.completions.create(model="cotserve-demo", prompt="37+48-12=", max_tokens=60,
                                          extra_body={"guided_regex": "[0-9]+"})
        thought, answer = completion.choices[0].text.split("</think>")  # completions return the whole text
        assert re.search(r"\d+[+-]\d+=\d+", thought) and re.fullmatch(r"[0-9]+", answer)


def test_a_format_that_cannot_be_compiled_or_two_formats_are_a_400_naming_the_field(base):
    with client(base) as c:
        with pytest.raises(openai.BadRequestError) as bad_regex:
            c.chat.completions.create(model="cotserve-demo", messages=MESSAGES, extra_body={"guided_regex": "[0-9"})
        with pytest.raises(openai.BadRequestError) as two:
            c.chat.completions.create(model="cotserve-demo", messages=MESSAGES, response_format={"type": "json_object"},
                                      extra_body={"guided_regex": "[0-9]"})
        with pytest.raises(openai.BadRequestError) as bad_type:
            c.chat.completions.create(model="cotserve-demo", messages=MESSAGES, response_format={"type": "xml"})
    assert "cannot be compiled" in bad_regex.value.message and "Unclosed" in bad_regex.value.message
    assert bad_regex.value.body["param"].startswith("response_format")
    assert two.value.body["param"] == "guided_regex"
    assert bad_type.value.body["param"] == "response_format.type"


def test_langchains_with_structured_output(base):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="cotserve-demo", base_url=base, api_key="unused", max_retries=0, temperature=1.0,
                     max_tokens=200, seed=7)
    for method in ("json_schema", "json_mode"):
        structured = llm.with_structured_output(Answer if method == "json_schema" else Answer.model_json_schema(),
                                                method=method)
        got = structured.invoke("37+48-12=" if method == "json_schema" else "37+48-12= answer in JSON")
        if method == "json_schema":
            assert isinstance(got, Answer)
        else:
            assert isinstance(got, dict)


def test_the_sdk_over_grpc_takes_each_format_and_names_what_is_wrong(demo_gateway):
    schema = Answer.model_json_schema()
    with Client(demo_gateway) as sdk:
        r = sdk.generate(messages=MESSAGES, max_new_tokens=200, temperature=1.0, seed=2, json_schema=schema)
        Answer.model_validate_json(r.answer_text)
        assert re.search(r"\d+[+-]\d+=\d+", r.reasoning_text)
        assert sdk.generate(messages=MESSAGES, max_new_tokens=80, choice=["yes", "no"]).answer_text in ("yes", "no")
        with pytest.raises(InvalidArgument, match=r"sampling.structured_output.regex: cannot be compiled"):
            sdk.generate(messages=MESSAGES, regex="[0-9")
        with pytest.raises(InvalidArgument, match=r"sampling.structured_output.json_schema.schema: not JSON"):
            sdk.generate(messages=MESSAGES, json_schema="{nope")
        with pytest.raises(InvalidArgument, match=r"regex: give one structured-output format \(got json_schema"):
            sdk.generate(messages=MESSAGES, json_schema=schema, regex="[0-9]+")
