"""Chat templates rendered as Hugging Face renders them: each template here uses what the common families' templates
use (system turns, loops, conditionals on roles, the generation prompt, special tokens, a thinking block, tools,
`raise_exception`, namespaces, loop controls), and each render is compared with transformers' `apply_chat_template`
on the same tokenizer."""

from __future__ import annotations

import json

import pytest

from cotserve.common.errors import InvalidArgument
from cotserve.worker.chat_template import ChatTemplate, ChatTemplateError
from cotserve.worker.config import DEMO_MODEL

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA_LIKE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system = 'You are helpful.' %}
    {%- set rest = messages %}
{%- endif %}
{{- '<|system|>' + system + '<|end|>' }}
{%- for message in rest %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- '<|user|>' + message['content'] | trim + '<|end|>' }}
    {%- elif message['role'] == 'assistant' %}
        {%- generation %}{{ '<|assistant|>' + message['content'] | trim + eos_token }}{% endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"""

THINKING = """{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- if tools %}
<tools>{{ tools | tojson }}</tools>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
<|assistant|>
{%- if message.reasoning_content and loop.index0 > ns.last_user %}
<think>
{{ message.reasoning_content.strip() }}
</think>
{%- endif %}
{{ message.content }}
{%- elif message.role == 'tool' %}
<tool_response>{{ message.content }}</tool_response>
{%- else %}
<|{{ message.role }}|>
{{ message.content }}
{%- endif %}
{%- if loop.index0 > 8 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>
{%- endif %}
{%- endif %}"""

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "What is 37+48-12?"}],
    "system and turns": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
                         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sum 2 and 3."}],
    "reasoning after the last user turn": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": " two and two "},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "three and three"},
        {"role": "tool", "content": "{\"ok\": true}"}],
}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers (é, <b>)",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    config = json.loads((DEMO_MODEL / "tokenizer_config.json").read_text())
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(DEMO_MODEL / "tokenizer.json"),
                                                bos_token=config["bos_token"], eos_token=config["eos_token"],
                                                pad_token=config["pad_token"])


def ours(template: str) -> ChatTemplate:
    config = json.loads((DEMO_MODEL / "tokenizer_config.json").read_text())
    return ChatTemplate(template, {k: config[k] for k in ("bos_token", "eos_token", "pad_token")})


@pytest.mark.parametrize("template", [CHATML, LLAMA_LIKE, THINKING], ids=["chatml", "llama-like", "thinking"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS), ids=list(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_renders_as_transformers_does(hf_tokenizer, template, conversation, generation_prompt):
    messages = CONVERSATIONS[conversation]
    if template == LLAMA_LIKE and conversation == "reasoning after the last user turn":
        messages = messages[:4]  # (the tool turn would break its alternation rule: tested below)
    expected = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                add_generation_prompt=generation_prompt)
    assert ours(template).render(messages, add_generation_prompt=generation_prompt) == expected


@pytest.mark.parametrize("thinking", [True, False])
def test_tools_and_extra_variables_as_transformers_passes_them(hf_tokenizer, thinking):
    messages = CONVERSATIONS["one user turn"]
    expected = hf_tokenizer.apply_chat_template(messages, chat_template=THINKING, tokenize=False, add_generation_prompt=True,
                                                tools=TOOLS, enable_thinking=thinking)
    got = ours(THINKING).render(messages, tools=TOOLS, enable_thinking=thinking)
    assert got == expected
    assert '"Add two numbers (é, <b>)"' in got  # tojson: no HTML escaping, no ASCII escaping
    assert ("<think>\n\n</think>" in got) is (not thinking)


def test_raise_exception_becomes_an_error_naming_messages():
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="messages: the model's chat template refused them: Conversation roles "
                                                "must alternate"):
        ours(LLAMA_LIKE).render(bad)


def test_a_template_tripping_over_the_messages_is_their_error_not_the_servers():
    """A null content added to a string (ChatML's `'...' + message['content']`) raises TypeError inside the template:
    an error naming messages (400), not an unexpected exception (500)."""
    with pytest.raises(ChatTemplateError, match=r"messages: the model's chat template failed on them \(TypeError: "):
        ours(CHATML).render([{"role": "user", "content": None}])


@pytest.mark.parametrize("escape", ["{{ ''.__class__.__mro__ }}", "{{ messages.append(1) }}",
                                    "{{ raise_exception.__globals__ }}"])
def test_the_sandbox_holds(escape):
    """An attribute starting with `_` is undefined (it renders as nothing or fails the render when used), and the
    values passed in cannot be changed; either way nothing of the process reaches the prompt."""
    try:
        out = ours(escape).render([{"role": "user", "content": "x"}])
    except ChatTemplateError as exc:
        assert "sandbox forbids" in exc.message or "refused them" in exc.message
    else:
        assert out == ""


@pytest.mark.parametrize("messages, field", [
    ([], "messages: must be a non-empty list"),
    ([{"content": "x"}], "messages\\[0\\].role: must be a non-empty string"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": 3}], "messages\\[1\\].content: must be a string"),
    (["hi"], "messages\\[0\\]: must be an object"),
])
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(InvalidArgument, match=field):
        ours(CHATML).render(messages)


def test_a_folder_template_and_the_demo_models(tmp_path):
    demo = ChatTemplate.from_folder(DEMO_MODEL)
    assert demo is not None
    assert demo.render([{"role": "system", "content": "ignored"}, {"role": "user", "content": "37+48-12="}]) == "<s>37+48-12="
    # tokenizer_config.json's list of named templates, and a chat_template.jinja file that takes precedence
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "</s>", "lstrip": False}, "chat_template": [
            {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0].content }}{{ eos_token }}"}]}))
    assert ChatTemplate.from_folder(tmp_path).render([{"role": "user", "content": "x"}]) == "x</s>"
    (tmp_path / "chat_template.jinja").write_text("[{{ messages | length }}]")
    assert ChatTemplate.from_folder(tmp_path).render([{"role": "user", "content": "x"}]) == "[1]"
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ValueError, match="chat_template.jinja: not a valid Jinja2 template"):
        ChatTemplate.from_folder(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.from_folder(tmp_path) is None
