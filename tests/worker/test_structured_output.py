"""Structured output in the engine (`worker/grammar.py`): every sampled output of the demo model, which left alone
writes arithmetic and never JSON, follows its format (JSON Schema, JSON object, regex, choice, EBNF grammar); a
reasoning model's thinking stays free and only its answer is constrained, with budgets and early-exit probes; a
format that cannot be compiled fails at submit, naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from cotserve.common.sampling import EarlyExitParams, ReasoningParams, StructuredOutput
from cotserve.worker.config import DEMO_MODEL
from cotserve.worker.engine import Engine
from cotserve.worker.engine_config import EngineConfig
from cotserve.worker.grammar import Phase, grammars_for
from cotserve.worker.models.loader import load_model
from cotserve.worker.reasoning import ReasoningFormat
from cotserve.worker.sequence import SamplingParams
from tests.worker.engine_helpers import run_engine

SCHEMA = {  # nested objects, an array, enums, bounded numbers; at most ~150 characters (the demo's context is 256)
    "type": "object",
    "properties": {
        "id": {"type": "string", "maxLength": 6},
        "total": {"type": "integer", "minimum": -50, "maximum": 500},
        "kind": {"enum": ["sum", "product", "mixed"]},
        "steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"op": {"enum": ["+", "-"]},
                                             "value": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["op", "value"], "additionalProperties": False}},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                 "additionalProperties": False},
    },
    "required": ["id", "total", "kind", "steps", "meta"],
    "additionalProperties": False,
}
PROMPT = "12+30-7+5+61-20="


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_MODEL, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def fmt(demo):
    return ReasoningFormat.for_tokenizer(demo.tokenizer)


def sample(demo, fmt, structured: StructuredOutput, n: int, max_new_tokens: int = 230, **params):
    engine = Engine(demo, EngineConfig(num_blocks=1024, max_model_len=256, max_num_seqs=32), fmt)
    ids = demo.tokenizer.encode(PROMPT).ids
    outs = run_engine(engine, [ids] * n, [SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=i,
                                                         structured=structured, **params) for i in range(n)])
    assert engine.block_manager.num_free_blocks == 1024
    return outs


def test_left_alone_the_demo_model_writes_no_json(demo):
    (out,) = sample(demo, None, None, 1)
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_fifty_samples_at_temperature_one_all_validate_against_a_nested_schema(demo):
    outs = sample(demo, None, StructuredOutput("json_schema", json.dumps(SCHEMA)), 50)
    values = [json.loads(o.text) for o in outs]
    for value, out in zip(values, outs):
        jsonschema.validate(value, SCHEMA)
        assert out.finish_reason == "stop"  # the format finished: only the end-of-sequence token was left
    assert len({json.dumps(v, sort_keys=True) for v in values}) > 25  # sampled, not one answer forced


def test_a_json_object_a_regex_a_choice_and_a_grammar_hold_for_every_sample(demo):
    """A JSON object of free keys may run to the length limit on this model (its strings go on): every finished one
    parses to an object, and every one that ran out is a prefix the grammar accepts token by token."""
    fmt = StructuredOutput("json_object")
    outs = sample(demo, None, fmt, 20)
    finished = [json.loads(o.text) for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 5 and all(isinstance(value, dict) for value in finished)
    grammars = grammars_for(demo, None)
    for out in outs:
        # no token left the grammar: a finished one is complete, a truncated one still in it
        assert grammars.state(fmt, None, [], out.token_ids).phase == (Phase.DONE if out.finish_reason == "stop"
                                                                      else Phase.ACTIVE)
    pattern = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    texts = [o.text for o in sample(demo, None, StructuredOutput("regex", pattern), 20)]
    assert all(re.fullmatch(pattern, t) for t in texts) and len(set(texts)) > 10
    choices = ("eighty-one", "81", "not sure")
    texts = [o.text for o in sample(demo, None, StructuredOutput("choice", choices=choices), 20)]
    assert set(texts) <= set(choices) and len(set(texts)) > 1
    grammar = 'root ::= "(" num (op num)* ")"\nnum ::= [1-9] [0-9]?\nop ::= " + " | " - "'
    texts = [o.text for o in sample(demo, None, StructuredOutput("grammar", grammar), 20)]
    assert all(re.fullmatch(r"\([1-9][0-9]?( [+-] [1-9][0-9]?)*\)", t) for t in texts)


def test_a_reasoning_models_thinking_stays_free_and_only_its_answer_is_constrained(demo, fmt):
    """The demo model thinks in <think>...</think> (arithmetic, free) and then answers in the format."""
    outs = sample(demo, fmt, StructuredOutput("json_schema", json.dumps(SCHEMA)), 10, max_new_tokens=236)
    for out in outs:
        thought, answer = fmt.split(out.text)
        assert out.text.startswith("<think>") and re.search(r"\d+[+-]\d+=\d+", thought)
        jsonschema.validate(json.loads(answer), SCHEMA)


def test_a_thinking_budgets_forced_end_hands_over_to_the_grammar(demo, fmt):
    engine = Engine(demo, EngineConfig(num_blocks=256, max_model_len=256), fmt)
    ids = demo.tokenizer.encode(PROMPT).ids
    answers = []
    for i in range(6):
        out = []
        engine.submit(f"r{i}", ids, SamplingParams(max_new_tokens=64, temperature=1.0, seed=i,
                                                   structured=StructuredOutput("choice", choices=("yes", "no"))),
                      lambda o, out=out: out.append(o), budget=ReasoningParams(max_thinking_tokens=4))
        answers.append(out)
    engine.drain_inbox(block=False)
    while engine.scheduler.has_work():
        engine.step()
    for out in answers:
        text = "".join(o.text for o in out)
        thought, answer = fmt.split(text)
        assert len(demo.tokenizer.encode(thought, add_special_tokens=False).ids) <= 4
        assert answer in ("yes", "no"), text


def test_early_exit_probes_decode_under_the_grammar(demo, fmt):
    """Probes answer in the format (the regex of a number), so the answers they agree on are well-formed."""
    engine = Engine(demo, EngineConfig(num_blocks=512, max_model_len=256), fmt)
    ids = demo.tokenizer.encode(PROMPT).ids
    probe_texts: list[str] = []
    original = engine.requests.probe_token

    def probe_token(probe, token, lp, now):
        original(probe, token, lp, now)
        if probe.is_finished:
            probe_texts.append(demo.tokenizer.decode(probe.output_ids))
            assert probe.grammar is not None and probe.grammar.phase in (Phase.ACTIVE, Phase.DONE)

    engine.requests.probe_token = probe_token
    out = []
    engine.submit("r", ids, SamplingParams(max_new_tokens=120, structured=StructuredOutput("regex", "-?[0-9]{1,4}")),
                  out.append, budget=ReasoningParams(early_exit=EarlyExitParams(probe_every_tokens=6, agree=2)))
    engine.drain_inbox(block=False)
    while engine.scheduler.has_work():
        engine.step()
    text = "".join(o.text for o in out)
    assert probe_texts and all(re.fullmatch(r"-?[0-9]{1,4}", t.strip()) for t in probe_texts), probe_texts
    assert re.fullmatch(r"-?[0-9]{1,4}", fmt.split(text)[1])


@pytest.mark.parametrize("structured, message", [
    (StructuredOutput("regex", "[0-9"), r"sampling.structured_output.regex: cannot be compiled: .*Unclosed"),
    (StructuredOutput("grammar", "root ::= foo"), r"sampling.structured_output.grammar: cannot be compiled: .*foo"),
    (StructuredOutput("json_schema", '{"type": "bogus"}'),
     r"sampling.structured_output.json_schema.schema: cannot be compiled: .*bogus"),
])
def test_a_format_that_cannot_be_compiled_fails_at_submit_naming_the_field(demo, structured, message):
    engine = Engine(demo, EngineConfig(num_blocks=64, max_model_len=256))
    with pytest.raises(ValueError, match=message):
        engine.submit("bad", [5, 6, 7], SamplingParams(structured=structured), lambda out: None)
    assert not engine.scheduler.has_work()


def test_votes_compare_json_answers_as_values_not_strings():
    """Two samples that write the same object spaced and ordered differently cast one ballot's worth each for the
    same value; other answers are compared as written."""
    from cotserve.common.sampling import SelfConsistencyParams
    from cotserve.worker.reasoning import Ballot, tally
    from cotserve.worker.reasoning_control import comparable

    json_params = SamplingParams(structured=StructuredOutput("json_object"))
    a, b = comparable('{"b": 1, "a": [1, 2]}', json_params), comparable('{"a":[1,2],"b":1}', json_params)
    assert a == b == '{"a":[1,2],"b":1}'
    assert comparable('{"a": 1', json_params) == '{"a": 1'  # cut short: as written
    assert comparable(" 81", SamplingParams()) == " 81"
    table = tally([Ballot(a, 1.0), Ballot(b, 1.0), Ballot(comparable('{"a": [2, 1], "b": 1}', json_params), 1.0)],
                  SelfConsistencyParams(8))
    assert [(e.answer, e.count) for e in table] == [('{"a":[1,2],"b":1}', 2), ('{"a":[2,1],"b":1}', 1)]


def test_a_vote_over_constrained_answers_counts_only_well_formed_ones(demo, fmt):
    from cotserve.common.sampling import SelfConsistencyParams

    engine = Engine(demo, EngineConfig(num_blocks=512, max_model_len=256, max_num_seqs=8), fmt)
    ids = demo.tokenizer.encode(PROMPT).ids
    outs = []
    engine.submit("v", ids, SamplingParams(max_new_tokens=120, temperature=1.0, seed=11,
                                           structured=StructuredOutput("choice", choices=("even", "odd"))),
                  outs.append, budget=ReasoningParams(self_consistency=SelfConsistencyParams(6, min_samples=3)))
    engine.drain_inbox(block=False)
    while engine.scheduler.has_work():
        engine.step()
    vote = outs[-1].vote
    assert vote.answer in ("even", "odd") and {e.answer for e in vote.votes} <= {"even", "odd"}
    assert sum(e.count for e in vote.votes) == vote.samples_used >= 3


def test_a_sample_that_goes_on_past_its_finished_format_is_free_after_it(demo):
    """With ignore_eos the end-of-sequence token that completes the format does not end the sample: the tokens after
    it are unconstrained (the format is done), and the step never asks the finished matcher for a mask."""
    outs = sample(demo, None, StructuredOutput("choice", choices=("yes", "no")), 4, max_new_tokens=12, ignore_eos=True)
    for out in outs:
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
        assert demo.tokenizer.decode(out.token_ids[:1]) in ("y", "n", "yes", "no") or out.text[:3] in ("yes", "no")
        assert out.text.startswith(("yes", "no"))
