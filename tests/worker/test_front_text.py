"""The worker front makes a request's text when the engine need not (`needs_engine_text`): outputs equal, field for
field, to the engine's own detokenization, and the engine process is asked for none."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cotserve.common.sampling import EarlyExitParams, ReasoningParams, SelfConsistencyParams
from cotserve.demo.arithmetic import problems
from cotserve.worker.config import DEMO_MODEL, WorkerConfig
from cotserve.worker.detokenizer import TokenBytes
from cotserve.worker.engine import Engine, EngineConfig, RequestOutput, needs_engine_text
from cotserve.worker.engine_process import FrontText
from cotserve.worker.models.loader import load_model
from cotserve.worker.reasoning import ReasoningFormat
from cotserve.worker.sequence import SamplingParams
from cotserve.worker.server import start_worker


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_MODEL, device=torch.device("cpu"))


def _fields(out: RequestOutput) -> tuple:
    return (out.request_id, out.index, out.token_id, out.text, out.finish_reason, out.part, out.reasoning_text,
            out.answer_text, out.is_last, out.completion_tokens)


def _run(demo, fmt, requests, detokenize: bool, front: bool) -> list[tuple]:
    """Every output of `requests` ((prompt ids, params, budget)) on a fresh in-process engine, in order."""
    engine = Engine(demo, EngineConfig(num_blocks=256, block_size=16, max_num_seqs=32, max_num_batched_tokens=512,
                                       max_model_len=demo.config.max_context), fmt)
    outs: list[RequestOutput] = []
    token_bytes = TokenBytes.of(demo.tokenizer)
    for i, (ids, params, budget) in enumerate(requests):
        sink = outs.append
        if front:
            sink = FrontText(sink, demo.tokenizer, token_bytes, ids, params, demo.eos_token_ids, fmt)
        engine.submit(f"r{i}", ids, params, sink, budget=budget, detokenize=detokenize)
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work():
        engine.step()
        engine._drain_inbox(block=False)
    return [_fields(o) for o in outs]


def test_the_fronts_text_is_the_engines_to_the_field(demo):
    fmt = ReasoningFormat.for_tokenizer(demo.tokenizer)
    assert fmt is not None  # the demo model reasons: every output's part and each sample's split are checked too
    prompts = [demo.tokenizer.encode(p.prompt).ids for p in problems(11, 6)]
    no_budget = ReasoningParams()
    requests = [(ids, SamplingParams(max_new_tokens=48), no_budget) for ids in prompts[:3]]  # greedy, to the eos
    requests += [
        (prompts[3], SamplingParams(max_new_tokens=40, temperature=1.0, seed=5, n=3), no_budget),  # three samples
        (prompts[4], SamplingParams(max_new_tokens=20, ignore_eos=True), no_budget),  # past the eos, to the length
        (prompts[5], SamplingParams(max_new_tokens=48, stop_token_ids=(13,)), no_budget),  # a stop token of its own
        (prompts[0], SamplingParams(max_new_tokens=48), ReasoningParams(max_thinking_tokens=3)),  # forced end of thinking
        (prompts[1], SamplingParams(max_new_tokens=48), ReasoningParams(early_exit=EarlyExitParams(probe_every_tokens=2, agree=1))),
        (prompts[2] + list(fmt.start_ids), SamplingParams(max_new_tokens=48), no_budget),  # the prompt opens the thinking
    ]
    assert not any(needs_engine_text(p, b) for _, p, b in requests)
    engine_made = _run(demo, fmt, requests, detokenize=True, front=False)
    front_made = _run(demo, fmt, requests, detokenize=False, front=True)
    assert front_made == engine_made
    assert sum(1 for o in engine_made if o[3]) > 50 and any(o[6] for o in engine_made)  # text and reasoning splits
    # without FrontText the engine's outputs carry no text at all: the front really makes it
    bare = _run(demo, fmt, requests, detokenize=False, front=False)
    assert [o[:3] for o in bare] == [o[:3] for o in engine_made]
    assert all(o[3] == "" and o[6] is None and o[7] is None for o in bare)


def test_requests_whose_text_the_engine_reads_are_detokenized_there(demo):
    plain = SamplingParams()
    assert not needs_engine_text(plain, ReasoningParams(max_thinking_tokens=8))
    assert needs_engine_text(SamplingParams(stop=("\n",)), ReasoningParams())
    assert needs_engine_text(plain, ReasoningParams(max_thinking_steps=2))
    assert needs_engine_text(plain, ReasoningParams(early_exit=EarlyExitParams(probe_every_steps=1)))
    assert needs_engine_text(plain, ReasoningParams(self_consistency=SelfConsistencyParams(max_samples=5)))
    engine = Engine(demo, EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256,
                                       max_model_len=demo.config.max_context))
    with pytest.raises(ValueError, match="stop strings or reasoning controls need its text"):
        engine.submit("r", [5, 6], SamplingParams(stop=("x",)), lambda out: None, detokenize=False)


def test_the_engine_process_front_detokenizes_plain_requests_and_leaves_stop_strings_to_the_engine():
    async def main():
        worker = await start_worker(WorkerConfig(port=0, max_num_seqs=4))
        try:
            ep = worker.engine
            ids = ep.loaded.tokenizer.encode("37+48-12=").ids
            done = {name: asyncio.Event() for name in ("front", "engine")}
            texts = {name: "" for name in done}
            loop = asyncio.get_running_loop()

            def sink(name):
                def take(out: RequestOutput) -> None:
                    texts[name] += out.text
                    if out.is_last or out.error:
                        loop.call_soon_threadsafe(done[name].set)
                return take

            ep.submit("front", ids, SamplingParams(max_new_tokens=24), sink("front"))
            ep.submit("engine", ids, SamplingParams(max_new_tokens=24, stop=("never in the answer",)), sink("engine"))
            kinds = {rid: type(ep._sinks.get(rid)).__name__ for rid in done}
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in done.values())), 60)
            return kinds, texts
        finally:
            await worker.stop()

    kinds, texts = asyncio.run(main())
    assert kinds == {"front": "FrontText", "engine": "function"}
    assert texts["front"] == texts["engine"] and "=" in texts["front"]
