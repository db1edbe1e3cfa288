"""Chat templates and LLM.chat against transformers' apply_chat_template (the reference): the
rendered text and the prompt's token ids for ChatML- and Llama-3-style templates, with
add_generation_prompt, continue_final_message and chat_template_kwargs; LLM.chat generates what
generate does on those ids; bad messages and options are a ValueError / TypeError before anything
runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import kvserve
from kvserve.server.chat_template import ChatTemplate, ChatTemplateError

transformers = pytest.importorskip("transformers")

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "shakespeare-target"

# A ChatML template with a thinking switch (as Qwen3's reads enable_thinking), written here.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
# A Llama-3-style template: BOS, headers, stripped content, end-of-turn marks.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

CONVERSATION = [
    {"role": "system", "content": "You speak in verse."},
    {"role": "user", "content": "ROMEO:\nWhat light through yonder window breaks?"},
    {"role": "assistant", "content": "It is the east, and Juliet "},
]
CASES = [
    (CHATML, CONVERSATION[:2], dict(add_generation_prompt=True)),
    (CHATML, CONVERSATION[:2], dict(add_generation_prompt=True,
                                    chat_template_kwargs=dict(enable_thinking=False))),
    (CHATML, CONVERSATION, dict(add_generation_prompt=False, continue_final_message=True)),
    (LLAMA3, CONVERSATION[:2], dict(add_generation_prompt=True)),
    (LLAMA3, CONVERSATION, dict(add_generation_prompt=False, continue_final_message=True)),
    (LLAMA3, CONVERSATION[:2], dict(add_generation_prompt=False)),
]


def reference_tokenizer(template: str):
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(SHIPPED / "tokenizer.json"),
                                               bos_token="<s>", eos_token="</s>")
    tok.chat_template = template
    return tok


def reference(template: str, messages: list[dict], options: dict, tokenize: bool):
    kwargs = dict(options)
    extra = kwargs.pop("chat_template_kwargs", None) or {}
    return reference_tokenizer(template).apply_chat_template(
        messages, tokenize=tokenize, return_dict=False, **kwargs, **extra)


@pytest.fixture(scope="module")
def llm():
    return kvserve.LLM(SHIPPED, dtype="float32", max_model_len=256)


@pytest.mark.parametrize("template, messages, options", CASES)
def test_rendering_equals_transformers(template, messages, options):
    ours = ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"})
    kwargs = dict(options)
    extra = kwargs.pop("chat_template_kwargs", None) or {}
    assert ours.render(messages, **kwargs, variables=extra) == reference(template, messages, options,
                                                                 tokenize=False)


@pytest.mark.parametrize("template, messages, options", CASES)
def test_chat_prompts_equal_transformers_and_generate_as_generate_does(llm, template, messages,
                                                                       options):
    params = kvserve.SamplingParams(temperature=0, max_tokens=6)
    out = llm.chat(messages, params, use_tqdm=False, chat_template=template, **options)[0]
    assert out.prompt_token_ids == list(reference(template, messages, options, tokenize=True))
    want = llm.generate([out.prompt_token_ids], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_several_conversations_text_parts_and_the_checkpoints_own_template(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(SHIPPED, model)
    (model / "chat_template.jinja").write_text(CHATML)
    llm = kvserve.LLM(model, dtype="float32", max_model_len=256)
    params = kvserve.SamplingParams(temperature=0, max_tokens=4)
    parts = [{"role": "user", "content": [{"type": "text", "text": "ROMEO:"},
                                          {"type": "text", "text": " Speak."}]}]
    plain = [{"role": "user", "content": "ROMEO: Speak."}]
    outs = llm.chat([parts, plain, plain[:1] + [{"role": "user", "content": None}]], params,
                    use_tqdm=False)
    assert len(outs) == 3
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == list(
        reference(CHATML, plain, {"add_generation_prompt": True}, tokenize=True))
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert llm.get_tokenizer() is llm.tokenizer
    assert llm.get_tokenizer().decode(outs[1].prompt_token_ids).startswith("<|im_start|>user")


@pytest.mark.parametrize("messages, options, error, match", [
    ([], {}, TypeError, "non-empty list"),
    ("hello", {}, TypeError, "non-empty list"),
    ([[]], {}, TypeError, "non-empty list"),
    ([{"content": "hi"}], {}, ValueError, "string role"),
    ([{"role": "user", "content": 5}], {}, ValueError, "string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     ValueError, "only text content parts"),
    ([{"role": "user", "content": "hi"}], dict(continue_final_message=True), ChatTemplateError,
     "exclude each other"),
    ([{"role": "user", "content": "hi"}],
     dict(chat_template_kwargs={"messages": []}), ChatTemplateError, "may not set messages"),
    ([{"role": "user", "content": "  "}],
     dict(add_generation_prompt=False, continue_final_message=True), ChatTemplateError,
     "needs a last message with text"),
])
def test_bad_messages_and_options_are_refused_before_running(llm, messages, options, error,
                                                             match):
    steps = llm.llm_engine.get_stats().num_steps
    with pytest.raises(error, match=match):
        llm.chat(messages, use_tqdm=False, chat_template=CHATML, **options)
    assert llm.llm_engine.get_stats().num_steps == steps


def test_a_template_that_drops_the_final_message_cannot_continue_it(llm):
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False,
                 chat_template="{{ 'fixed text' }}", add_generation_prompt=False,
                 continue_final_message=True)


def test_a_model_without_a_template_says_so(llm):
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
