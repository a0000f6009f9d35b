"""Structured output: the format a request asks for (`common.sampling.StructuredOutput`) compiled to a grammar over
the model's tokens and enforced token by token, through xgrammar.

Why xgrammar (over llguidance, the other maintained engine vLLM and SGLang use): on this project's CPU it fills the
token bitmask of 32 sequences in a third to a quarter of llguidance's time for a JSON schema of nested objects, with
a 200k-token vocabulary and with the demo model's (docs/design-notes.md has the measurement and the command).

- `Grammars` compiles a format once per tokenizer (xgrammar's compiler caches by the format's text); a format it
  cannot compile is a ValueError naming the field, which the worker answers with INVALID_ARGUMENT before any compute.
- `GrammarState` is one sequence's place in its grammar. For a reasoning model the thinking stays free: the grammar
  starts after the end-of-thinking marker (a budget's forced end hands over to it the same way); before the model
  has said whether it thinks, its first token may be the start marker or one the grammar allows. A probe or a
  recomputed sequence replays its tokens, so the state never depends on how it was scheduled.
- `fill_masks` computes the bitmask of every constrained row of a step in one batched call; the sampler applies it.
  The reasoning markers are no token of any grammar: an answer cannot reopen the thinking.
"""

from __future__ import annotations

import enum
import json
import re
import threading
from typing import Any

import numpy as np
import torch

from cotserve.common.sampling import StructuredOutput

_ANY_JSON_OBJECT = '{"type": "object"}'


class Phase(enum.IntEnum):
    UNDECIDED = 0  # a reasoning model's first token: the thinking's start marker or the grammar's
    THINKING = 1  # free text until the end marker
    ACTIVE = 2  # every token from the grammar
    OFF = 3  # no constraint any more: a token the grammar refused was forced in (the reply left the format)
    DONE = 4  # the format is complete (its stop token taken; a sample that goes on, with ignore_eos, is free)


class Grammars:
    """xgrammar's compiler for one tokenizer and vocabulary size (the logits' width), built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: frozenset[int] | tuple[int, ...],
                 reserved: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.reserved = reserved  # token ids no grammar may produce (special tokens, the reasoning markers)
        self._compiler = None
        self.json_safe: np.ndarray | None = None  # bitmask words of the tokens free of control characters
        self.batch: Any = None  # xgrammar's BatchGrammarMatcher (`fill_masks`), made on first use
        self._lock = threading.Lock()

    def _build(self):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
        vocab = list(info.decoded_vocab)
        for token in self.reserved:  # an empty token is special to xgrammar: never part of a match
            if 0 <= token < len(vocab):
                vocab[token] = b""
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
        safe = np.zeros(-(-self.vocab_size // 32) * 32, dtype=bool)
        safe[:len(vocab)] = [not any(b < 0x20 for b in piece) for piece in vocab]
        self.json_safe = np.packbits(safe.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32).ravel()
        return xgr.GrammarCompiler(info, max_threads=1)

    @property
    def compiler(self):
        with self._lock:
            if self._compiler is None:
                self._compiler = self._build()
            return self._compiler

    def compile(self, fmt: StructuredOutput):
        """The compiled grammar of `fmt`; ValueError naming the field when it cannot be compiled."""
        c = self.compiler
        where = "tools" if fmt.kind == "tool_calls" else f"sampling.structured_output.{fmt.kind}"
        try:
            if fmt.kind == "json_object":
                return c.compile_json_schema(_ANY_JSON_OBJECT, any_whitespace=False, strict_mode=False)
            if fmt.kind == "json_schema":
                return c.compile_json_schema(fmt.spec, any_whitespace=False, strict_mode=fmt.strict)
            if fmt.kind == "regex":
                return c.compile_regex(fmt.spec)
            if fmt.kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(choice) for choice in fmt.choices))
            if fmt.kind == "grammar":
                return c.compile_grammar(fmt.spec)
            if fmt.kind == "tool_calls":
                return c.compile_grammar(_tool_calls_grammar(json.loads(fmt.spec)))
        except (RuntimeError, ValueError) as exc:  # xgrammar's parse and compile errors
            where += ".schema" if fmt.kind == "json_schema" else ""
            raise ValueError(f"{where}: cannot be compiled: {_first_line(exc)}") from None
        raise ValueError(f"sampling.structured_output: unknown kind {fmt.kind!r}")

    def state(self, fmt: StructuredOutput, reasoning: Any, prompt_ids: list[int],
              output_ids: list[int]) -> GrammarState:
        """A sequence's grammar state after `output_ids` (a new sample: none; a probe or a fork: what it has)."""
        import xgrammar as xgr

        compiled = self.compile(fmt)
        # JSON never needs a raw control character (whitespace between tokens is off, and inside strings they are
        # escaped), yet xgrammar's length-bounded strings take them: such tokens are left out of JSON formats
        state = GrammarState(xgr.GrammarMatcher(compiled), reasoning, prompt_ids,
                             self.json_safe if fmt.is_json else None)
        for token in output_ids:
            state.accept(token)
        return state


def _tool_calls_grammar(spec: dict[str, Any]):
    """Hermes' tool calls (`common.tools`): 1..max_calls blocks `<tool_call>` + {"name": one of the functions,
    "arguments": its parameters' schema} + `</tool_call>`, a newline between two."""
    import xgrammar as xgr

    schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": c["name"]}, "arguments": c["parameters"]}}
                        for c in spec["calls"]]}
    call = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'),
                              xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
                              xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
    newline = xgr.Grammar.from_ebnf('root ::= "\\n"')
    counts = [xgr.Grammar.concat(call, *[g for _ in range(k) for g in (newline, call)]) if k else call
              for k in range(spec["max_calls"])]
    return counts[0] if len(counts) == 1 else xgr.Grammar.union(*counts)


def grammars_for(loaded: Any, reasoning: Any) -> Grammars:
    """The compiler for a loaded model: its special tokens (but its end-of-sequence ones, which end a finished
    format) and its single-token reasoning markers are in no grammar."""
    reserved = {i for i, t in loaded.tokenizer.get_added_tokens_decoder().items() if t.special}
    if reasoning is not None:
        reserved |= {ids[0] for ids in (reasoning.start_ids, reasoning.end_ids) if len(ids) == 1}
    return Grammars(loaded.tokenizer, loaded.config.vocab_size, loaded.eos_token_ids,
                    tuple(sorted(reserved - set(loaded.eos_token_ids))))


def _first_line(exc: Exception) -> str:
    """xgrammar's message without its log prefix (`[time] file.cc:line: `)."""
    text = str(exc).strip()
    text = text.splitlines()[0] if text else type(exc).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text)


class GrammarState:
    """One sequence's matcher and where it stands in its reasoning (`Phase`)."""

    __slots__ = ("matcher", "phase", "start_ids", "end_ids", "allowed", "_recent")

    def __init__(self, matcher: Any, reasoning: Any, prompt_ids: list[int], allowed: np.ndarray | None = None) -> None:
        self.matcher = matcher
        self.allowed = allowed  # bitmask words every mask of it is narrowed to (None: the grammar's alone)
        self.start_ids: tuple[int, ...] = reasoning.start_ids if reasoning is not None else ()
        self.end_ids: tuple[int, ...] = reasoning.end_ids if reasoning is not None else ()
        self._recent: list[int] = []
        if not self.start_ids or not self.end_ids:
            self.phase = Phase.ACTIVE
        elif reasoning.opens_thinking(prompt_ids):
            self.phase = Phase.THINKING
        elif reasoning.closes_thinking(prompt_ids):
            self.phase = Phase.ACTIVE
        else:
            self.phase = Phase.UNDECIDED

    @property
    def constrained(self) -> bool:
        """The next token is the grammar's (or, undecided, the thinking's start)."""
        return self.phase in (Phase.ACTIVE, Phase.UNDECIDED)

    def accept(self, token: int) -> None:
        """Advance by one output token (sampled or forced)."""
        if self.phase == Phase.UNDECIDED:
            if token == self.start_ids[0]:
                self.phase = Phase.THINKING
                return
            self.phase = Phase.ACTIVE
        if self.phase == Phase.THINKING:
            self._recent = (self._recent + [token])[-len(self.end_ids):]
            if tuple(self._recent) == self.end_ids:
                self.phase = Phase.ACTIVE
            return
        if self.phase == Phase.ACTIVE:
            if not self.matcher.accept_token(token):
                self.phase = Phase.OFF
            elif self.matcher.is_terminated():
                self.phase = Phase.DONE


def fill_masks(grammars: Grammars, states: list[GrammarState | None]) -> tuple[torch.Tensor, list[int]]:
    """The int32 token bitmask [len(states), ceil(vocab / 32)] of a step's rows and the rows it constrains (those
    whose state is constrained), filled in one batched call; an undecided state may also take its thinking's start
    marker."""
    import xgrammar as xgr

    rows = [r for r, s in enumerate(states) if s is not None and s.constrained]
    mask = xgr.allocate_token_bitmask(len(states), grammars.vocab_size)
    if grammars.batch is None:
        grammars.batch = xgr.BatchGrammarMatcher(max_threads=1)
    grammars.batch.batch_fill_next_token_bitmask([states[r].matcher for r in rows], mask, indices=rows)
    narrowed = [r for r in rows if states[r].allowed is not None]
    undecided = [r for r in rows if states[r].phase == Phase.UNDECIDED]
    if narrowed or undecided:
        bits = mask.numpy().view(np.uint32)
        if narrowed:
            bits[narrowed] &= states[narrowed[0]].allowed  # (one model: one set of tokens free of control characters)
        for row in undecided:
            token = states[row].start_ids[0]
            bits[row, token // 32] |= np.uint32(1 << (token % 32))
    return mask, rows


def apply_masks(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """Tokens a row's mask leaves out get -inf, in place, in `rows` (the mask's rows are the logits')."""
    import xgrammar as xgr

    indices = None if len(rows) == logits.shape[0] else rows
    xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device), vocab_size=logits.shape[-1], indices=indices)
