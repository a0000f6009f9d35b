"""The text of a request that the engine runs without detokenizing, made in the worker front as the engine would
have made it. No torch, no grpc."""

from __future__ import annotations

from typing import Any, Callable

from cotserve.worker.detokenizer import IncrementalDetokenizer, TokenBytes
from cotserve.worker.outputs import NO_TOKEN, RequestOutput, Sink
from cotserve.worker.reasoning import Part
from cotserve.worker.scheduler import is_stop_token
from cotserve.worker.sequence import SamplingParams


class FrontText:
    """The text of a request the engine runs without detokenizing (`needs_engine_text` False: no vote, no budget or
    early exit by reasoning steps), made here in the front as the engine would have made it: the same incremental
    detokenizer per sample, a stop token's text dropped, what was held back added to each sample's last output,
    and, for a reasoning model, that output's reasoning/answer split. It fills in the outputs the front has just
    unpickled, before the request's sink sees them. Moving this out of the engine process takes the per-token
    detokenization (and the reasoning tracker's step-delimiter search) off the process that runs the model, as
    vLLM's API process detokenizes for its engine core.

    Stop strings are found here too: the output whose text completes one goes out with the text up to it, and
    `stop_sample(index)` tells the engine to end that sample. Until it has, the engine may generate a token or two
    more (vLLM's output processor does the same): they are dropped, the engine's last output of the sample goes out
    as a tokenless "stop", and the request's usage leaves them out (completion and reasoning tokens)."""

    __slots__ = ("sink", "tokenizer", "token_bytes", "prompt_ids", "params", "eos_token_ids", "fmt",
                 "thinking_at_start", "detoks", "stop_sample", "dropped")

    def __init__(self, sink: Sink, tokenizer: Any, token_bytes: TokenBytes | None, prompt_ids: list[int],
                 params: SamplingParams, eos_token_ids: frozenset[int], fmt: Any,
                 stop_sample: Callable[[int], None] | None = None) -> None:
        if params.stop and stop_sample is None:
            raise ValueError("FrontText: stop strings need stop_sample, to end a sample in the engine")
        self.sink, self.tokenizer, self.token_bytes, self.prompt_ids = sink, tokenizer, token_bytes, prompt_ids
        self.params, self.eos_token_ids, self.stop_sample = params, eos_token_ids, stop_sample
        self.fmt = fmt  # the model's ReasoningFormat, or None
        self.thinking_at_start = fmt is not None and fmt.opens_thinking(prompt_ids)
        self.detoks: dict[int, IncrementalDetokenizer] = {}
        self.dropped: dict[int, _Dropped] = {}  # samples ended here on a stop string: what the engine sent after it

    def __call__(self, out: RequestOutput) -> None:
        if out.error is None:
            dropped = self.dropped.get(out.index)
            if dropped is None:
                self._text(out)
            elif dropped.take(out):
                self._split(out)
            else:
                return
            if out.is_last and self.dropped:
                out.completion_tokens -= sum(d.tokens for d in self.dropped.values())
                out.reasoning_tokens -= sum(d.reasoning_tokens for d in self.dropped.values())
        self.sink(out)

    def _text(self, out: RequestOutput) -> None:
        detok = self.detoks.get(out.index)
        if detok is None:
            channels = self.fmt.channels(self.prompt_ids) if self.fmt is not None else None
            detok = self.detoks[out.index] = IncrementalDetokenizer(self.tokenizer, self.prompt_ids, self.params.stop,
                                                                    self.token_bytes, channels)
        if out.token_id != NO_TOKEN and not is_stop_token(self.params, self.eos_token_ids, out.token_id):
            out.text = detok.add_token(out.token_id)  # up to a stop string, all of it: nothing is held back then
            if detok.stopped_by_string:
                if out.finish_reason is None:  # the engine runs on until told: its last output will end the sample
                    self.dropped[out.index] = _Dropped()
                    self.stop_sample(out.index)
                    return
                out.finish_reason = "stop"  # as the engine ends a sample on a stop string, even at its length
        if out.finish_reason is not None:
            out.text += detok.flush()
            self._split(out)

    def _split(self, out: RequestOutput) -> None:
        """A sample's last output: its reasoning/answer split, for a reasoning model."""
        if self.fmt is not None:
            out.reasoning_text, out.answer_text = self.fmt.split_sample(self.detoks[out.index], self.thinking_at_start)


class _Dropped:
    """What the engine sent of a sample after the front ended it on a stop string."""

    __slots__ = ("tokens", "reasoning_tokens", "events")

    def __init__(self) -> None:
        self.tokens = self.reasoning_tokens = 0
        self.events: tuple[tuple[str, int], ...] = ()

    def take(self, out: RequestOutput) -> bool:
        """Count `out`'s token as dropped; True for the sample's last output from the engine, made a tokenless
        "stop" (its trace events joined by the dropped outputs'), which still goes out: it may carry the usage."""
        if out.token_id != NO_TOKEN:
            self.tokens += 1
            self.reasoning_tokens += out.part == Part.REASONING
        self.events += out.events
        if out.finish_reason is None:
            return False
        out.token_id, out.text, out.logprob, out.top_logprobs, out.finish_reason = NO_TOKEN, "", None, None, "stop"
        out.events, self.events = self.events, ()
        return True
