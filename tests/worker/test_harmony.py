"""gpt-oss's harmony format: the reasoning parser (openai-harmony's own streaming parser), the vocabulary it is given
from the checkpoint's tokenizer, and the reasoning controls on a gpt-oss model."""

from __future__ import annotations

import gzip

import pytest
import torch
from tokenizers import Tokenizer

pytest.importorskip("openai_harmony")
transformers = pytest.importorskip("transformers")

from openai_harmony import (  # noqa: E402
    Conversation, DeveloperContent, Message, ReasoningEffort, RenderConversationConfig, Role, SystemContent,
)

from cotserve.common.sampling import ReasoningParams  # noqa: E402
from cotserve.worker import harmony  # noqa: E402
from cotserve.worker.reasoning import Part, ReasoningFormat  # noqa: E402
from tests.worker.harmony_helpers import VOCAB_SIZE, VOCABULARY, encoding, tokenizer_json  # noqa: E402
from tests.worker.reasoning_helpers import gateway_split, worker_pieces  # noqa: E402

REASONING = "The user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51; 340 + 51 = 391. Héllo, 世界 — done."
ANSWER = "17 × 23 = **391**."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_json()))


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A cache folder of its own and no TIKTOKEN_ENCODINGS_BASE (what `load_encoding` sets is undone after)."""
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", "unset-after-the-test")
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE")
    monkeypatch.setenv("COTSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def fmt(tok, cache) -> ReasoningFormat:
    return ReasoningFormat.for_tokenizer(tok)


def conversation(reply: bool) -> list[int]:
    """A conversation as harmony renders it: for completion (the prompt, ending <|start|>assistant), or with the
    assistant's analysis and final messages (the reply's tokens follow the prompt's)."""
    enc = encoding()
    messages = [Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(ReasoningEffort.LOW)),
                Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("Be brief.")),
                Message.from_role_and_content(Role.USER, "What is 17 * 23?")]
    if not reply:
        return enc.render_conversation_for_completion(Conversation.from_messages(messages), Role.ASSISTANT)
    messages += [Message.from_role_and_content(Role.ASSISTANT, REASONING).with_channel("analysis"),
                 Message.from_role_and_content(Role.ASSISTANT, ANSWER).with_channel("final")]
    keep = RenderConversationConfig(auto_drop_analysis=False)  # the reply's own thinking, as the model wrote it
    return enc.render_conversation_for_training(Conversation.from_messages(messages), keep)


def test_the_vocabulary_is_written_from_the_tokenizer_and_harmony_accepts_it(tok, cache):
    """The checkpoint's tokenizer.json gives o200k_base byte for byte (harmony checks it by hash on load), written
    once to the cache and named to the package there; a tokenizer that is not gpt-oss's is refused by name."""
    assert harmony.o200k_vocabulary(tok) == gzip.decompress(VOCABULARY.read_bytes())
    enc = harmony.load_encoding(tok)
    (written,) = (cache / "tiktoken").glob("*/o200k_base.tiktoken")
    assert written.read_bytes() == gzip.decompress(VOCABULARY.read_bytes())
    text = "<|start|>assistant<|channel|>final<|message|>Héllo 世界<|return|>"
    assert enc.encode(text, allowed_special="all") == tok.encode(text, add_special_tokens=False).ids
    from tests.worker.engine_helpers import build_tokenizer

    with pytest.raises(ValueError, match="harmony, but the tokenizer has no <\\|channel\\|>"):
        ReasoningFormat.for_tokenizer(build_tokenizer(), parser="harmony")


def test_the_parser_is_chosen_from_the_tokenizer_and_can_be_named(tok, cache):
    fmt = ReasoningFormat.for_tokenizer(tok)  # auto: harmony's control tokens
    assert fmt.harmony is not None and fmt.text_markers == ("", "")
    assert fmt.start_ids == (200005, 35644, 200008)  # <|channel|>analysis<|message|>
    assert fmt.end_ids == (200007, 200006, 173781, 200005, 17196, 200008)  # <|end|><|start|>assistant<|channel|>final<|message|>
    assert ReasoningFormat.for_tokenizer(tok, parser="none") is None
    with pytest.raises(ValueError, match="reasoning_parser: think, but the tokenizer has no <think> / </think>"):
        ReasoningFormat.for_tokenizer(tok, parser="think")  # no <think> tokens in o200k
    with pytest.raises(ValueError, match="reasoning_parser: 'r1', allowed: auto, think, harmony, none"):
        ReasoningFormat.for_tokenizer(tok, parser="r1")
    with pytest.raises(ValueError, match="the harmony parser's markers are its channel headers"):
        ReasoningFormat.for_tokenizer(tok, "<a>", "</a>", parser="harmony")


def stream(fmt: ReasoningFormat, tok: Tokenizer, prompt: list[int], reply: list[int]):
    """The reply through the worker's text path, up to <|return|> (the end of the sample)."""
    return worker_pieces(fmt, tok, prompt, reply, {200002})


def test_a_rendered_reply_splits_exactly_whole_and_streamed_in_pieces_of_every_size(fmt, tok):
    """harmony's own rendering of an analysis and a final message, as the model writes it: the sample's reasoning and
    answer are the two messages' text; its streamed text carries no header; the gateway's split of the stream, in
    pieces of every size (the worker sends one piece per part per write), gives the same two texts."""
    prompt, full = conversation(False), conversation(True)
    assert full[:len(prompt)] == prompt
    reply = full[len(prompt):]
    assert reply[:3] == list(fmt.start_ids) and reply[-1] == 200002
    pieces, detok, tracker = stream(fmt, tok, prompt, reply)
    assert fmt.split_sample(detok) == (REASONING, ANSWER)
    assert "".join(text for text, _ in pieces) == REASONING + ANSWER  # no header's words
    end = reply.index(200008, 3) + 1  # the final channel's <|message|>
    assert [part for _, part in pieces] == [Part.ANSWER] * 2 + [Part.REASONING] * (end - 2) + [Part.ANSWER] * (len(reply) - 1 - end)
    assert tracker.num_reasoning_tokens == end and tracker.num_thinking_tokens == end - 3 - 6
    for size in range(1, len(reply) + 1):
        assert gateway_split(fmt, pieces, size) == (REASONING, ANSWER), size


def test_a_reply_that_leaves_the_format_is_answer_text_from_there(fmt, tok):
    """A model off its format (text where a header should be): the text is kept, as answer, never an error."""
    prompt = conversation(False)
    reply = tok.encode("<|channel|>analysis<|message|>think<|end|>then plain words", add_special_tokens=False).ids
    _, detok, _ = stream(fmt, tok, prompt, reply)
    assert fmt.split_sample(detok) == ("think", "then plain words")
    _, detok, _ = stream(fmt, tok, prompt, tok.encode("no header at all", add_special_tokens=False).ids)
    assert fmt.split_sample(detok) == ("", "no header at all")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny gpt-oss checkpoint with gpt-oss's tokenizer (o200k_harmony, 201,088 ids)."""
    from tests.worker.engine_helpers import save_tiny_checkpoint

    folder = tmp_path_factory.mktemp("gpt-oss-o200k")
    save_tiny_checkpoint(transformers.GptOssConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=512, tie_word_embeddings=False), folder, seed=1)
    (folder / "tokenizer.json").write_bytes(tokenizer_json().read_bytes())
    return folder


def test_a_thinking_budget_on_gpt_oss_forces_the_switch_to_the_final_channel(gpt_oss, cache):
    """A prompt that opens the analysis channel for the model and a budget of 4 thinking tokens: after them the
    engine writes harmony's switch to the final channel, the model answers from there; the reasoning is those 4
    tokens' text, the answer the rest, and usage counts the switch as reasoning."""
    from cotserve.worker.engine import Engine
    from cotserve.worker.engine_config import EngineConfig
    from cotserve.worker.models.loader import load_model
    from cotserve.worker.sequence import SamplingParams

    loaded = load_model(gpt_oss)
    fmt = ReasoningFormat.for_tokenizer(loaded.tokenizer)
    engine = Engine(loaded, EngineConfig(num_blocks=64, block_size=8, max_model_len=512), fmt)
    prompt = conversation(False) + list(fmt.start_ids)
    outs = []
    engine.submit("r", prompt, SamplingParams(max_new_tokens=14, ignore_eos=True), outs.append,
                  budget=ReasoningParams(max_thinking_tokens=4))
    engine.drain_inbox(block=False)
    while engine.scheduler.has_work():
        engine.step()
    ids, last = [o.token_id for o in outs], outs[-1]
    assert last.error is None and len(ids) == 14
    assert ids[4:10] == list(fmt.end_ids)
    tok = loaded.tokenizer
    assert last.reasoning_text == tok.decode(ids[:4], skip_special_tokens=True).strip()
    assert last.answer_text == tok.decode(ids[10:], skip_special_tokens=True).strip()
    assert "".join(o.text for o in outs) == tok.decode(ids[:4] + ids[10:], skip_special_tokens=True)
    assert last.reasoning_tokens == 10 and [o.part for o in outs] == [Part.REASONING] * 10 + [Part.ANSWER] * 4
    with torch.no_grad():
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# A stand-in for gpt-oss's published template (not available offline): harmony's message layout, the reasoning
# effort in the system message, and, as DeepSeek-R1's template opens <think>, the analysis channel opened for the model.
TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
            "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant<|channel|>analysis<|message|>{% endif %}")


def test_gpt_oss_served_over_http_splits_its_reasoning_and_answers_under_a_budget(gpt_oss, tmp_path):
    """A gpt-oss worker behind the gateway, the official OpenAI client: under a budget of 4 thinking tokens the
    reply's `reasoning` (and `reasoning_content`) is the text of transformers' greedy 4 tokens after the prompt the
    template renders (`reasoning_effort` reaching it through chat_template_kwargs), the content that of its greedy tokens after harmony's switch to
    the final channel, the usage counts the switch as reasoning; streamed, the deltas add up to the same two texts."""
    import openai

    from cotserve.common.procs import free_port
    from tests.conftest import start_gateway, stop_process
    from tests.conftest import start_worker as start
    from tests.worker.models.test_oracle import greedy

    folder = tmp_path / "served"
    folder.mkdir()
    for f in gpt_oss.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    hf = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss, attn_implementation="eager").eval()
    tok = Tokenizer.from_file(str(tokenizer_json()))
    prompt = tok.encode("<|start|>system<|message|>Reasoning: low<|end|><|start|>user<|message|>Hi<|end|>"
                        "<|start|>assistant<|channel|>analysis<|message|>", add_special_tokens=False).ids
    thinking = greedy(hf, prompt, 4)
    end = [200007, 200006, 173781, 200005, 17196, 200008]
    answer = greedy(hf, prompt + thinking + end, 4)
    procs = []
    try:
        worker, address = start("--model", str(folder), "--served-model-name", "tiny-gpt-oss",
                                env={"COTSERVE_CACHE_DIR": str(tmp_path / "cache")})
        procs.append(worker)
        port = free_port()
        gateway, _ = start_gateway(address, extra=("--http-port", str(port)))
        procs.append(gateway)
        body = dict(model="tiny-gpt-oss", messages=[{"role": "user", "content": "Hi"}], max_tokens=14, temperature=0,
                    extra_body={"ignore_eos": True, "max_thinking_tokens": 4,
                                "chat_template_kwargs": {"reasoning_effort": "low"}})
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60) as http:
            whole = http.chat.completions.create(**body)
            chunks = list(http.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    finally:
        for proc in reversed(procs):
            stop_process(proc)
    message = whole.choices[0].message.model_dump()
    want_reasoning = tok.decode(thinking, skip_special_tokens=True).strip()
    want_answer = tok.decode(answer, skip_special_tokens=True).strip()
    assert message["reasoning"] == message["reasoning_content"] == want_reasoning
    assert message["content"].strip() == want_answer
    assert whole.usage.completion_tokens == 14 and whole.usage.completion_tokens_details.reasoning_tokens == 10
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert "".join(d.get("reasoning") or "" for d in deltas).strip() == want_reasoning
    assert "".join(d.get("content") or "" for d in deltas).strip() == want_answer
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 10
