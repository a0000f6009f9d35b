"""The gateway's HTTP API fuzzed against its own OpenAPI document (`GET /openapi.json`, `gateway/openapi.py`) with
schemathesis, on a real gateway in front of a real worker: bodies that fit the document (positive) and bodies that
break it (negative) never get a 5xx, valid ones get a status the document lists, invalid ones are refused; afterwards
the worker holds no KV block and no sequence. Bounded and derandomized in CI (`COTSERVE_FUZZ_EXAMPLES` per operation
and mode, 30); `make fuzz` runs it longer with a fresh seed. The document and the parser agree field for field."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from cotserve.common.procs import free_port
from tests.conftest import start_gateway, start_worker, stop_process, wait_worker_idle

EXAMPLES = int(os.environ.get("COTSERVE_FUZZ_EXAMPLES", "30"))


@pytest.fixture(scope="module")
def api():
    worker, worker_address = start_worker("--max-num-seqs", "16")
    http_port = free_port()
    gateway, _ = start_gateway(worker_address, extra=("--http-port", str(http_port)))
    try:
        yield f"http://127.0.0.1:{http_port}", worker_address
    finally:
        stop_process(gateway)
        stop_process(worker)


def test_the_document_is_served_and_names_every_field_the_parser_reads(api):
    from cotserve.gateway.openai_api import _FIELDS

    base, _ = api
    doc = json.load(urllib.request.urlopen(f"{base}/openapi.json", timeout=10))
    assert doc["openapi"].startswith("3.1") and set(doc["paths"]) == {"/v1/chat/completions", "/v1/completions",
                                                                      "/v1/models", "/v1/models/{model}", "/health"}
    for path, kind in (("/v1/chat/completions", "chat"), ("/v1/completions", "completion")):
        body = body_of(doc, path)
        assert set(body["properties"]) == _FIELDS[kind], path
        assert body["additionalProperties"] is False


def body_of(document: dict, path: str) -> dict:
    return document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_body_gets_a_server_error_or_leaves_anything_behind(api, mode):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import negative_data_rejection, not_a_server_error, status_code_conformance

    base, worker = api
    document = json.load(urllib.request.urlopen(f"{base}/openapi.json", timeout=10))
    for path in ("/v1/chat/completions", "/v1/completions"):  # valid bodies name the model served (any other: 404)
        body_of(document, path)["properties"]["model"] = {"anyOf": [{"enum": ["cotserve-demo"]}, {"type": "null"}]}
    # and the roles the demo model's chat template takes (another role is a 400 naming the template)
    message = body_of(document, "/v1/chat/completions")["properties"]["messages"]["items"]
    message["properties"]["role"] = {"enum": ["system", "user", "assistant"]}
    schema = schemathesis.openapi.from_dict(document)
    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    checks = [not_a_server_error, status_code_conformance if mode == "positive" else negative_data_rejection]
    statuses: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode == "negative" and operation.method.upper() == "GET":
            continue  # nothing to break: the GETs take no body (a model id in the path is any string)

        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  derandomize="COTSERVE_FUZZ_EXAMPLES" not in os.environ)
        @given(operation.as_strategy(generation_mode=generation))
        def call(case):
            response = case.call(base_url=base, timeout=60)
            statuses.setdefault(f"{operation.method.upper()} {operation.path}", set()).add(response.status_code)
            case.validate_response(response, checks=checks)

        call()
    posts = {"POST /v1/chat/completions", "POST /v1/completions"}
    gets = {"GET /v1/models", "GET /v1/models/{model}", "GET /health"}
    assert set(statuses) == (posts | gets if mode == "positive" else posts)
    if mode == "positive":  # valid bodies are served, not only refused
        assert 200 in statuses["POST /v1/chat/completions"] and 200 in statuses["POST /v1/completions"], statuses
    else:
        assert all(s < 500 for codes in statuses.values() for s in codes), statuses
    wait_worker_idle(worker, timeout_s=30)  # no KV block, no sequence left behind by any of them
