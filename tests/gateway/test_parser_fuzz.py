"""Property-based tests of the parsers that read untrusted text: the reasoning splitter that turns a sample's stream
into `reasoning` and `content` however its chunks fall, the chat templates a client's messages are rendered through,
and the operator's tenants file. Whatever they are given, they answer or raise the error that names the problem,
never another exception. Bounded and derandomized here; `make fuzz` runs them longer with a fresh seed."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cotserve.common.errors import InvalidArgument
from cotserve.common.v1 import common_pb2
from cotserve.gateway.openai_api import ReasoningSplit
from cotserve.gateway.tenants import load_tenants
from cotserve.worker.chat_template import ChatTemplate
from tests.worker.test_chat_template import CHATML, LLAMA_LIKE, THINKING

EXAMPLES = int(os.environ.get("COTSERVE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="COTSERVE_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])

surrogates = st.integers(0xD800, 0xDFFF).map(chr)
text = st.text(st.characters() | surrogates, max_size=30)
markers = st.sampled_from([("<think>", "</think>"), ("", "</think>"), ("<|channel|>analysis<|message|>", "<|end|>")])


def chunks(s: str, cuts: list[int]) -> list[str]:
    """`s` cut at `cuts` (positions, any order, repeats allowed): the pieces a stream could deliver it in."""
    points = sorted({0, len(s), *(c % (len(s) + 1) for c in cuts)})
    return [s[a:b] for a, b in zip(points, points[1:])]


@FUZZ
@given(markers=markers, thought=text, answer=text, closed=st.booleans(), cuts=st.lists(st.integers(0, 200), max_size=8),
       answer_cuts=st.lists(st.integers(0, 200), max_size=4))
def test_the_reasoning_split_recovers_thought_and_answer_however_the_chunks_fall(markers, thought, answer, closed,
                                                                                 cuts, answer_cuts):
    start, end = markers
    raw = start + thought + (end if closed else "")
    split = ReasoningSplit(start, end)
    reasoning, content = "", ""
    for piece in chunks(raw, cuts):
        r, c = split.feed(piece, common_pb2.TEXT_PART_REASONING)
        reasoning, content = reasoning + r, content + c
    if closed:
        for piece in chunks(answer, answer_cuts) or [""]:
            r, c = split.feed(piece, common_pb2.TEXT_PART_ANSWER)
            reasoning, content = reasoning + r, content + c
    reasoning += split.finish()
    expected = thought if not thought.endswith(end) or closed or not end else thought.removesuffix(end)
    assert reasoning == expected and content == (answer if closed else "")


json_scalars = st.none() | st.booleans() | st.integers(-(1 << 40), 1 << 40) | st.floats() | text
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                           max_leaves=8)
messages = st.lists(st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "user", "assistant", "tool", ""]) | json_values,
    "content": text | json_values, "reasoning_content": text | json_values}) | json_values, max_size=4) | json_values


@pytest.mark.parametrize("source", [CHATML, LLAMA_LIKE, THINKING,
                                    (Path(__file__).resolve().parents[2] / "services" / "worker" / "demo" / "cotserve-demo")],
                         ids=["chatml", "llama-like", "thinking", "demo model"])
@FUZZ
@given(conversation=messages, thinking=st.none() | st.booleans())
def test_any_messages_render_or_are_refused_naming_the_field(source, conversation, thinking):
    template = (ChatTemplate.from_folder(source) if isinstance(source, Path)
                else ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"}))
    try:
        out = template.render(conversation, **({} if thinking is None else {"enable_thinking": thinking}))
    except InvalidArgument as err:
        assert str(err).startswith("messages"), str(err)
        return
    assert isinstance(out, str)


toml_values = st.recursive(st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1) | st.text(max_size=70),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
                           max_leaves=10)
tenant = st.fixed_dictionaries({}, optional={
    "key_sha256": st.lists(st.sampled_from(["0" * 64, "f" * 64, "xyz"]), max_size=2) | toml_values,
    "sla_classes": st.lists(st.sampled_from(["realtime", "interactive", "batch", "urgent"]), max_size=3) | toml_values,
    "requests_per_min": st.integers(-2, 5) | toml_values, "tokens_per_min": st.integers(-2, 5) | toml_values,
    "max_concurrent": st.integers(-2, 5) | toml_values, "modules": st.lists(st.text(max_size=5), max_size=2) | toml_values,
    "raw_tokens": st.booleans() | toml_values})
names = st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True) | st.text(max_size=70)
tenants_files = (st.dictionaries(names, tenant | toml_values, max_size=3).map(lambda t: {"tenants": t})
                 | st.dictionaries(st.text(max_size=10), toml_values, max_size=3))


@FUZZ
@given(document=tenants_files, garbage=st.none() | st.binary(max_size=60))
def test_any_tenants_file_loads_or_is_refused_naming_the_file(tmp_path, document, garbage):
    path = tmp_path / "tenants.toml"
    path.write_bytes(garbage if garbage is not None else tomli_w.dumps(document).encode())
    try:
        tenants = load_tenants(path)
    except ValueError as err:
        assert str(err).startswith("tenants_file: "), str(err)
        return
    raw = tomllib.loads(path.read_text())["tenants"]
    assert set(tenants) == set(raw) and all(t.name == name for name, t in tenants.items())
