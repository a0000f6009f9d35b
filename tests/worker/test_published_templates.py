"""The models' own published chat templates (tests/data/templates, sources in its README): rendered by the worker
byte for byte as transformers renders them, and each reasoning model's rendered reply split into reasoning and answer
by its family's parser, whole and streamed in pieces of every size."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("openai_harmony")

from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

from cotserve.worker.chat_template import ChatTemplate  # noqa: E402
from cotserve.worker.reasoning import ReasoningFormat  # noqa: E402
from tests.worker.harmony_helpers import tokenizer_json  # noqa: E402
from tests.worker.reasoning_helpers import gateway_split, worker_pieces  # noqa: E402

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
SPECIAL = {  # each template's special tokens, as its model's tokenizer_config.json names them
    "Qwen-Qwen3-0.6B": {"eos_token": "<|im_end|>"},
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "deepseek-ai-DeepSeek-V3.1": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "microsoft-Phi-3.5-mini-instruct": {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
    "openai-gpt-oss-120b": {"eos_token": "<|return|>"},
}
REASONING, ANSWER = "17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 = 391. Héllo, 世界.", "It is **391**."
SYSTEM = {"role": "system", "content": "You are terse."}
FIRST = [SYSTEM, {"role": "user", "content": "What is 2 + 2?"},
         {"role": "assistant", "content": "4", "reasoning_content": "2 + 2 = 4.", "thinking": "2 + 2 = 4."},
         {"role": "user", "content": "What is 17 * 23?"}]
CASES = [  # (template, template variables)
    ("Qwen-Qwen3-0.6B", {}), ("Qwen-Qwen3-0.6B", {"enable_thinking": False}),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {}), ("deepseek-ai-DeepSeek-V3.1", {"thinking": True}),
    ("deepseek-ai-DeepSeek-V3.1", {}), ("microsoft-Phi-3.5-mini-instruct", {}),
    ("openai-gpt-oss-120b", {"reasoning_effort": "low"}), ("openai-gpt-oss-120b", {}),
]


def template(name: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), SPECIAL[name], name)


@pytest.mark.parametrize("name, variables", CASES, ids=[f"{n}-{v}" for n, v in CASES])
@pytest.mark.parametrize("generation", [True, False], ids=["prompt", "whole"])
def test_the_worker_renders_a_published_template_as_transformers_does(name, variables, generation):
    """A conversation with a system message, an earlier turn that thought, and a question: the prompt (generation
    prompt added) or the whole conversation with the reply (as a training example renders it), byte for byte."""
    messages = FIRST if generation else FIRST + [{"role": "assistant", "content": ANSWER, "reasoning_content": REASONING,
                                                  "thinking": REASONING}]
    ours = template(name).render(messages, add_generation_prompt=generation, **variables)
    theirs = render_jinja_template([messages], chat_template=(TEMPLATES / f"{name}.jinja").read_text(),
                                   add_generation_prompt=generation, **SPECIAL[name], **variables)[0][0]
    assert ours == theirs


def think_tokenizer() -> Tokenizer:
    """A stand-in for Qwen3's and DeepSeek's tokenizers: o200k (a real byte-level vocabulary) with their markers and
    turn tokens added as their tokenizers have them, so the parser sees each marker as the single token it is."""
    tok = Tokenizer.from_file(str(tokenizer_json()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in
                            ("<|im_start|>", "<|im_end|>", "<｜Assistant｜>", "<｜User｜>", "<｜end▁of▁sentence｜>",
                             "<｜begin▁of▁sentence｜>")])
    return tok


def rendered_reply(name: str, variables: dict) -> tuple[str, str]:
    """(prompt, reply): the template's prompt for the question and the text the whole conversation adds to it (the
    reply as the model writes it, its end-of-turn token included)."""
    t = template(name)
    prompt = t.render(FIRST, add_generation_prompt=True, **variables)
    whole = t.render(FIRST + [{"role": "assistant", "content": ANSWER, "reasoning_content": REASONING,
                               "thinking": REASONING}], add_generation_prompt=False, **variables)
    return prompt, whole


@pytest.mark.parametrize("name, variables, expected", [
    ("Qwen-Qwen3-0.6B", {}, (REASONING, ANSWER)),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {}, ("", ANSWER)),  # its template drops the reply's thinking
    ("openai-gpt-oss-120b", {"reasoning_effort": "low"}, (REASONING, ANSWER)),
], ids=["qwen3", "deepseek-r1", "gpt-oss"])
def test_a_rendered_reply_splits_exactly_streamed_in_pieces_of_every_size(name, variables, expected, monkeypatch,
                                                                            tmp_path):
    """The reply the template renders after its own prompt, token by token through the worker's text path (the
    family's parser), then through the gateway's split in pieces of every size: the reasoning and the
    answer the conversation gave, exactly. DeepSeek-R1's prompt opens <think> itself (the reply starts inside the
    thinking)."""
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", "unset-after-the-test")
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE")
    monkeypatch.setenv("COTSERVE_CACHE_DIR", str(tmp_path))
    tok = Tokenizer.from_file(str(tokenizer_json())) if name.startswith("openai") else think_tokenizer()
    fmt = ReasoningFormat.for_tokenizer(tok, parser="harmony" if name.startswith("openai") else "think")
    prompt, whole = rendered_reply(name, variables)
    if name.startswith("deepseek"):  # the reply past the prompt's <think>: the model's own text
        whole = prompt + f"{REASONING}\n</think>\n\n{ANSWER}<｜end▁of▁sentence｜>"
    assert whole.startswith(prompt)
    prompt_ids = tok.encode(prompt, add_special_tokens=False).ids
    reply_ids = tok.encode(whole[len(prompt):], add_special_tokens=False).ids
    stops = {tok.token_to_id(t) for t in ("<|im_end|>", "<｜end▁of▁sentence｜>", "<|return|>")} - {None}
    assert reply_ids[-1] in stops or tok.decode(reply_ids[-2:], skip_special_tokens=False).startswith("<|im_end|>")
    pieces, detok, tracker = worker_pieces(fmt, tok, prompt_ids, reply_ids, stops)
    if name.startswith("deepseek"):
        expected = (REASONING, ANSWER)  # what the model wrote after the prompt's <think>
    assert fmt.split_sample(detok, tracker.thinking_at_start) == expected
    for size in range(1, len(pieces) + 1):
        assert gateway_split(fmt, pieces, size) == expected, size
