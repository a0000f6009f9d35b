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
from cotserve.worker.engine import Engine
from cotserve.worker.engine_config import EngineConfig, needs_engine_text
from cotserve.worker.outputs import RequestOutput
from cotserve.worker.front_text import FrontText
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


def _run(demo, fmt, requests, detokenize: bool, front: bool, fronts: list | None = None) -> list[RequestOutput]:
    """Every output of `requests` ((prompt ids, params, budget)) on a fresh in-process engine, in order. A front's
    stop_sample reaches the engine a step late, as one through the engine process's pipe can."""
    engine = Engine(demo, EngineConfig(num_blocks=256, block_size=16, max_num_seqs=32, max_num_batched_tokens=512,
                                       max_model_len=demo.config.max_context), fmt)
    outs: list[RequestOutput] = []
    token_bytes = TokenBytes.of(demo.tokenizer)
    late: list[tuple[str, int]] = []
    for i, (ids, params, budget) in enumerate(requests):
        sink = outs.append
        if front:
            sink = FrontText(sink, demo.tokenizer, token_bytes, ids, params, demo.eos_token_ids, fmt,
                             lambda index, rid=f"r{i}": late.append((rid, index)))
            if fronts is not None:
                fronts.append(sink)
        engine.submit(f"r{i}", ids, params, sink, budget=budget, detokenize=detokenize)
    engine.drain_inbox(block=False)
    arriving: list[tuple[str, int]] = []
    while engine.scheduler.has_work() or arriving:
        engine.step()
        for rid, index in arriving:  # the stop strings found in the step before this one's outputs
            engine.stop_sample(rid, index)
        arriving, late[:] = late[:], []
        engine.drain_inbox(block=False)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a finished request leaked KV blocks"
    return outs


def _samples(outs: list[RequestOutput]) -> dict:
    """Each request's samples as a client assembles them (token ids, text, finish, split), and its usage."""
    got: dict = {}
    for o in outs:
        sample = got.setdefault((o.request_id, o.index), {"ids": [], "text": "", "finish": None, "split": None})
        assert sample["finish"] is None, f"an output after the sample's last: {o}"
        if o.token_id >= 0:
            sample["ids"].append(o.token_id)
        sample["text"] += o.text
        if o.finish_reason is not None:
            sample["finish"], sample["split"] = o.finish_reason, (o.reasoning_text, o.answer_text)
        if o.is_last:
            got[o.request_id] = (o.prompt_tokens, o.completion_tokens, o.reasoning_tokens)
    return got


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
    engine_made = [_fields(o) for o in _run(demo, fmt, requests, detokenize=True, front=False)]
    front_made = [_fields(o) for o in _run(demo, fmt, requests, detokenize=False, front=True)]
    assert front_made == engine_made
    assert sum(1 for o in engine_made if o[3]) > 50 and any(o[6] for o in engine_made)  # text and reasoning splits
    # without FrontText the engine's outputs carry no text at all: the front really makes it
    bare = [_fields(o) for o in _run(demo, fmt, requests, detokenize=False, front=False)]
    assert [o[:3] for o in bare] == [o[:3] for o in engine_made]
    assert all(o[3] == "" and o[6] is None and o[7] is None for o in bare)


def test_stop_strings_found_in_the_front_end_samples_as_the_engine_ends_them(demo):
    """The engine runs a step past a stop string the front found (its stop_sample lands before the next): the extra
    tokens never reach the client, the sample ends "stop" with the text up to the stop string, and the usage counts
    what the engine would have counted had it found the string itself."""
    fmt = ReasoningFormat.for_tokenizer(demo.tokenizer)
    prompts = [demo.tokenizer.encode(p.prompt).ids for p in problems(13, 4)]
    requests = [
        (prompts[0], SamplingParams(max_new_tokens=48, stop=("=",)), ReasoningParams()),  # inside the reasoning
        (prompts[1], SamplingParams(max_new_tokens=48, stop=(".", "never")), ReasoningParams()),
        (prompts[2], SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, n=3, stop=("+",)), ReasoningParams()),
        (prompts[3], SamplingParams(max_new_tokens=48, stop=("never in the answer",)), ReasoningParams()),  # no hit
        (prompts[3], SamplingParams(max_new_tokens=48, stop=("</think>",)), ReasoningParams()),  # the answer dropped
        (prompts[0], SamplingParams(max_new_tokens=48, stop=("=",)), ReasoningParams(max_thinking_tokens=3)),
    ]
    engine_made = _samples(_run(demo, fmt, requests, detokenize=True, front=False))
    fronts: list[FrontText] = []
    front_outs = _run(demo, fmt, requests, detokenize=False, front=True, fronts=fronts)
    assert _samples(front_outs) == engine_made
    dropped = [d for f in fronts for d in f.dropped.values()]
    assert len(dropped) >= 4 and sum(d.tokens for d in dropped) >= len(dropped)  # the engine ran on past each one
    assert any(d.reasoning_tokens for d in dropped) and any(d.tokens > d.reasoning_tokens for d in dropped)
    stopped = [k for k, v in engine_made.items() if isinstance(v, dict) and v["finish"] == "stop" and v["ids"][-1] != 1]
    assert len(stopped) >= 4  # stop strings, not the eos, ended most samples
    assert any(o.token_id < 0 and o.finish_reason == "stop" for o in front_outs)  # ended by stop_sample, tokenless
    assert all(("=" not in v["text"]) for k, v in engine_made.items() if isinstance(v, dict) and k[0] == "r0")


def test_requests_whose_text_the_engine_reads_are_detokenized_there(demo):
    plain = SamplingParams()
    assert not needs_engine_text(plain, ReasoningParams(max_thinking_tokens=8))
    assert not needs_engine_text(SamplingParams(stop=("\n",)), ReasoningParams())
    assert needs_engine_text(plain, ReasoningParams(max_thinking_steps=2))
    assert needs_engine_text(plain, ReasoningParams(early_exit=EarlyExitParams(probe_every_steps=1)))
    assert needs_engine_text(plain, ReasoningParams(self_consistency=SelfConsistencyParams(max_samples=5)))
    engine = Engine(demo, EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256,
                                       max_model_len=demo.config.max_context), ReasoningFormat.for_tokenizer(demo.tokenizer))
    with pytest.raises(ValueError, match="reasoning controls need its text"):
        engine.submit("r", [5, 6], SamplingParams(), lambda out: None, budget=ReasoningParams(max_thinking_steps=1),
                      detokenize=False)


def test_the_engine_process_front_makes_the_text_and_ends_samples_on_stop_strings_through_the_pipe():
    async def main():
        worker = await start_worker(WorkerConfig(port=0, max_num_seqs=8))
        try:
            ep = worker.engine
            ids = ep.loaded.tokenizer.encode("37+48-12=").ids
            got = {name: [] for name in ("plain", "stopped", "vote")}
            done = {name: asyncio.Event() for name in got}
            loop = asyncio.get_running_loop()

            def sink(name):
                def take(out: RequestOutput) -> None:
                    got[name].append(out)
                    if out.is_last or out.error:
                        loop.call_soon_threadsafe(done[name].set)
                return take

            ep.submit("plain", ids, SamplingParams(max_new_tokens=24), sink("plain"))
            ep.submit("stopped", ids, SamplingParams(max_new_tokens=24, stop=("=",)), sink("stopped"))
            ep.submit("vote", ids, SamplingParams(max_new_tokens=24, temperature=0.7, seed=1), sink("vote"),
                      budget=ReasoningParams(self_consistency=SelfConsistencyParams(max_samples=2, min_samples=2)))
            kinds = {rid: type(ep._sinks.get(rid)).__name__ for rid in got}
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in done.values())), 60)
            return kinds, got
        finally:
            await worker.stop()

    kinds, got = asyncio.run(main())
    assert kinds == {"plain": "FrontText", "stopped": "FrontText", "vote": "function"}  # a vote reads text: the engine's
    plain = "".join(o.text for o in got["plain"])
    stopped = "".join(o.text for o in got["stopped"])
    assert "=" in plain and stopped == plain[: plain.index("=")]
    last = got["stopped"][-1]
    assert last.finish_reason == "stop" and last.is_last and all(o.error is None for o in got["stopped"])
    tokens = [o.token_id for o in got["stopped"] if o.token_id >= 0]
    assert tokens == [o.token_id for o in got["plain"]][: len(tokens)]
    assert last.completion_tokens == len(tokens)  # the tokens the engine ran on past the stop string not counted
    assert "".join(o.text for o in got["vote"] if o.index == 0)
