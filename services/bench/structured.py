"""`cotserve bench structured`: what a structured-output constraint costs, measured in one process.

- Engine alone on a model (the demo model by default): output tokens/s at each batch size with every request under a
  JSON Schema, against the same requests unconstrained, both generating the same number of tokens (the schema asks
  for more than `max_new_tokens`, so every constrained request runs to its length; the unconstrained ones ignore
  end-of-sequence). The runs alternate, `repeats` times each, and the medians are compared.
- Grammar compile time per schema: the first compile of a schema (cold) and a cached one (warm).
- The grammar engines themselves: the time to fill the token bitmask of `batch` sequences per step, each sequence
  writing its own document of a schema of nested objects, for xgrammar (what the worker uses) and llguidance (when
  it is installed), over the model's tokenizer or any `tokenizer.json`.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

NESTED = {  # a schema of a few nested objects (the mask measurement's)
    "type": "object", "additionalProperties": False, "required": ["name", "age", "address", "tags", "employer"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {"type": "object", "additionalProperties": False, "required": ["street", "city", "geo"],
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "geo": {"type": "object", "additionalProperties": False, "required": ["lat", "lon"],
                                           "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}}}},
        "tags": {"type": "array", "maxItems": 5, "items": {"enum": ["a", "bb", "ccc"]}},
        "employer": {"type": "object", "additionalProperties": False, "required": ["company", "since"],
                     "properties": {"company": {"type": "string"}, "since": {"type": "integer"}}}}}


def long_schema(items: int) -> dict[str, Any]:
    """An array of exactly `items` small objects: more tokens than a run generates, so no request ends early."""
    return {"type": "array", "minItems": items, "maxItems": items, "items": {
        "type": "object", "additionalProperties": False, "required": ["op", "value", "ok"],
        "properties": {"op": {"enum": ["+", "-", "*"]}, "value": {"type": "integer", "minimum": 0, "maximum": 999},
                       "ok": {"type": "boolean"}}}}


def documents(count: int, seed: int = 0) -> list[str]:
    """`count` different documents of NESTED (so each sequence's matcher is in a state of its own)."""
    rng = random.Random(seed)

    def text(alphabet: str, low: int, high: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(low, high)))

    return [json.dumps({"name": text("abcdefghij XYZ", 3, 30), "age": rng.randrange(150),
                        "address": {"street": text("klmnop qrs", 5, 25), "city": text("London Paris", 3, 12),
                                    "geo": {"lat": round(rng.uniform(-90, 90), rng.randrange(1, 6)),
                                            "lon": round(rng.uniform(-180, 180), 3)}},
                        "tags": [rng.choice(["a", "bb", "ccc"]) for _ in range(rng.randrange(5))],
                        "employer": {"company": text("tuvw xyz", 2, 20), "since": rng.randrange(1900, 2026)}})
            for _ in range(count)]


@dataclass(slots=True)
class EngineRow:
    batch: int
    free: float  # output tok/s unconstrained (median of the repeats)
    constrained: float  # output tok/s under the schema


def engine_rates(model: Path, batches: list[int], max_new_tokens: int, repeats: int,
                 say: Callable[[str], None]) -> list[EngineRow]:
    import torch

    from cotserve.common.sampling import StructuredOutput
    from cotserve.worker.engine import Engine
    from cotserve.worker.engine_config import EngineConfig
    from cotserve.worker.grammar import grammars_for
    from cotserve.worker.models.loader import load_model
    from cotserve.worker.sequence import SamplingParams

    loaded = load_model(model, device=torch.device("cpu"))
    prompt = loaded.tokenizer.encode("12+30-7+5+61-20=").ids
    fmt = StructuredOutput("json_schema", json.dumps(long_schema(max_new_tokens)))
    grammars = grammars_for(loaded, None)
    grammars.compile(fmt)  # the compile is timed apart (compile_times), not here
    rows = []
    for batch in batches:
        engine = Engine(loaded, EngineConfig(num_blocks=batch * (-(-(len(prompt) + max_new_tokens) // 16) + 1),
                                             max_model_len=len(prompt) + max_new_tokens, max_num_seqs=batch))
        engine.grammars = grammars
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for constrained in (False, True):
                say(f"batch {batch}, {'under the schema' if constrained else 'free'} ...")
                params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=not constrained,
                                        structured=fmt if constrained else None)
                done: list[int] = []
                start = time.perf_counter()
                for i in range(batch):
                    engine.submit(f"r{i}", prompt, params, lambda out: done.append(1))
                engine.drain_inbox(block=False)
                while engine.scheduler.has_work():
                    engine.step()
                times[constrained].append(len(done) / (time.perf_counter() - start))
        rows.append(EngineRow(batch, statistics.median(times[False]), statistics.median(times[True])))
    return rows


def compile_times(model: Path, schemas: int) -> tuple[float, float]:
    """(cold, warm) milliseconds to compile a schema for the model's tokenizer: `schemas` schemas each new, then each
    again (xgrammar's cache); the tokenizer's own preparation is not in them."""
    import torch

    from cotserve.common.sampling import StructuredOutput
    from cotserve.worker.grammar import grammars_for
    from cotserve.worker.models.loader import load_model

    loaded = load_model(model, device=torch.device("cpu"))
    grammars = grammars_for(loaded, None)
    grammars.compiler  # noqa: B018 - the tokenizer's preparation, once, outside the timing
    formats = [StructuredOutput("json_schema", json.dumps({**NESTED, "title": f"schema {i}"})) for i in range(schemas)]
    cold, warm = [], []
    for times in (cold, warm):
        for fmt in formats:
            start = time.perf_counter()
            grammars.compile(fmt)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(cold), statistics.median(warm)


@dataclass(slots=True)
class MaskRow:
    library: str
    prepare_ms: float  # the tokenizer's preparation, once per model
    compile_ms: float  # the schema and `batch` matchers
    mean_ms: float  # bitmask of the batch, per step
    p90_ms: float
    tokens: int


def mask_times(tokenizer_json: Path, batch: int, say: Callable[[str], None]) -> list[MaskRow]:
    """Each installed engine's bitmask fill for `batch` sequences writing NESTED documents, step by step."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    seqs = [tok.encode(text, add_special_tokens=False) for text in documents(batch)]
    rows = []
    for name, run in (("xgrammar", _xgrammar), ("llguidance", _llguidance)):
        try:
            __import__(name)
        except ImportError:
            say(f"{name}: not installed, left out")
            continue
        say(f"{name}: {batch} sequences, {sum(map(len, seqs))} tokens ...")
        prepare, compile_ms, steps = run(tok, seqs)
        rows.append(MaskRow(name, prepare, compile_ms, statistics.mean(steps),
                            sorted(steps)[int(0.9 * len(steps))], sum(map(len, seqs))))
    return rows


def _xgrammar(tok, seqs: list[list[int]]) -> tuple[float, float, list[float]]:
    import xgrammar as xgr

    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)), max_threads=1)
    prepare = time.perf_counter() - start
    start = time.perf_counter()
    grammar = compiler.compile_json_schema(json.dumps(NESTED), any_whitespace=False)
    matchers = [xgr.GrammarMatcher(grammar) for _ in seqs]
    compiled = time.perf_counter() - start
    mask = xgr.allocate_token_bitmask(len(seqs), len(tok))
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    steps = []
    for step in range(max(map(len, seqs))):
        live = [i for i, s in enumerate(seqs) if step < len(s)]
        start = time.perf_counter()
        batch.batch_fill_next_token_bitmask([matchers[i] for i in live], mask, indices=live)
        steps.append((time.perf_counter() - start) * 1e3)
        for i in live:
            if not matchers[i].accept_token(seqs[i][step]):
                raise RuntimeError(f"xgrammar refused token {step} of document {i}")
    return prepare * 1e3, compiled * 1e3, steps


def _llguidance(tok, seqs: list[list[int]]) -> tuple[float, float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    prepare = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(NESTED, defaults={
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})  # json.dumps' spacing, as xgrammar's
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in seqs]
    compiled = time.perf_counter() - start
    mask = lt.allocate_token_bitmask(len(seqs), lltok.vocab_size)
    executor = llguidance.LLExecutor()
    steps = []
    for step in range(max(map(len, seqs))):
        live = [i for i, s in enumerate(seqs) if step < len(s)]
        start = time.perf_counter()
        lt.fill_next_token_bitmask_par(executor, [(matchers[i], i) for i in live], mask)
        steps.append((time.perf_counter() - start) * 1e3)
        for i in live:
            if not matchers[i].consume_token(seqs[i][step]):
                raise RuntimeError(f"llguidance refused token {step} of document {i}: {matchers[i].get_error()}")
    return prepare * 1e3, compiled * 1e3, steps
