"""The HTTP server with real clients: the official `openai` package and httpx against a server on
a loopback port (the shipped model, fp32): greedy completions and chat equal LLM.generate's,
streamed or not; n > 1, logprobs, stop strings, usage; OpenAI-shaped errors with their statuses;
a disconnect mid-stream or mid-request frees the request's blocks; /metrics parses and its
counters match the work done; many concurrent streams with cancellations lose nothing; all of it
with async scheduling too."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

import kvserve  # noqa: E402
from kvserve.async_engine import AsyncLLMEngine  # noqa: E402
from kvserve.server import ServerState  # noqa: E402
from kvserve.server.chat_template import ChatTemplate  # noqa: E402
from kvserve.server.serve import BackgroundServer  # noqa: E402
from tests.engine_loop import wait_idle  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "models" / "shakespeare-target"
NAME = "shakespeare"
TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}\n\n{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")
PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo!", "First Citizen:\nBefore we proceed"]


# Every test of the server runs on an engine that steps one step at a time and on one that
# launches each step before the last one's samples are in (async scheduling): same answers.
@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def engine(request):
    with AsyncLLMEngine(MODEL, dtype="float32", max_model_len=256, num_blocks=64,
                        async_scheduling=request.param) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    state = ServerState(NAME)
    state.ready(engine, ChatTemplate(TEMPLATE, {"eos_token": "</s>"}))
    with BackgroundServer(state) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return kvserve.LLM(MODEL, dtype="float32", max_model_len=256)


def greedy(**extra):
    return dict(temperature=0, max_tokens=24, **extra)


# ------------------------------------------------------------------------------ completions

def test_completions_equal_llm_generate(client, offline):
    want = offline.generate(PROMPTS, kvserve.SamplingParams(temperature=0, max_tokens=24),
                            use_tqdm=False)
    r = client.completions.create(model=NAME, prompt=PROMPTS, **greedy())
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [w.outputs[0].text for w in want]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert r.usage.completion_tokens == 3 * 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == NAME and r.object == "text_completion"


def test_streamed_completion_equals_the_whole(client):
    whole = client.completions.create(model=NAME, prompt=PROMPTS[1], **greedy())
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], stream=True,
                                            stream_options={"include_usage": True},
                                            **greedy()))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len([c for c in chunks if c.choices]) > 3  # one chunk per step, not one at the end
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_token_id_prompts_and_n_samples(client, offline):
    ids = offline.tokenizer.encode(PROMPTS[0])
    by_text = client.completions.create(model=NAME, prompt=PROMPTS[0], **greedy())
    by_ids = client.completions.create(model=NAME, prompt=ids, **greedy())
    assert by_ids.choices[0].text == by_text.choices[0].text
    r = client.completions.create(model=NAME, prompt=[PROMPTS[0], PROMPTS[2]], n=2,
                                  temperature=1.0, seed=7, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 4 * 8
    again = client.completions.create(model=NAME, prompt=[PROMPTS[0], PROMPTS[2]], n=2,
                                      temperature=1.0, seed=7, max_tokens=8)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded


def test_stop_strings_and_logprobs(client, offline):
    want = offline.generate([PROMPTS[0]], kvserve.SamplingParams(
        temperature=0, max_tokens=24, logprobs=2), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], logprobs=2, **greedy())
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 24
    assert lp.token_logprobs == pytest.approx([t.logprob for t in want.logprobs], abs=1e-5)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    stop = want.text[5:7]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], stop=[stop], **greedy())
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == want.text[:want.text.index(stop)]


def test_vllms_stop_fields(client, offline):
    """min_tokens, stop_token_ids, include_stop_str_in_output and allowed_token_ids, as vLLM
    takes them."""
    def offline_text(**params):
        return offline.generate([PROMPTS[2]], kvserve.SamplingParams(
            temperature=0, max_tokens=16, **params), use_tqdm=False)[0].outputs[0]

    plain = offline_text()
    stop_id = plain.token_ids[2]
    for params in (dict(stop_token_ids=[stop_id]), dict(stop_token_ids=[stop_id], min_tokens=6),
                   dict(stop=[plain.text[4:7]], include_stop_str_in_output=True)):
        want = offline_text(**params)
        r = client.completions.create(model=NAME, prompt=PROMPTS[2], temperature=0,
                                      max_tokens=16, extra_body=params)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, want.finish_reason)
        assert r.usage.completion_tokens == len(want.token_ids)
    assert offline_text(stop_token_ids=[stop_id]).token_ids == plain.token_ids[:3]
    assert len(offline_text(stop_token_ids=[stop_id], min_tokens=6).token_ids) > 3
    allowed = plain.token_ids[3:5]
    want = offline_text(allowed_token_ids=allowed)
    assert set(want.token_ids) <= set(allowed)
    r = client.completions.create(model=NAME, prompt=PROMPTS[2], temperature=0, max_tokens=16,
                                  extra_body={"allowed_token_ids": allowed})
    assert r.choices[0].text == want.text
    long = PROMPTS[2] * 40  # past max_model_len (256) unless truncated
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=NAME, prompt=long, max_tokens=4)
    r = client.completions.create(model=NAME, prompt=long, max_tokens=4, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 100})
    want = offline.generate([offline.tokenizer.encode(long)[-100:]], kvserve.SamplingParams(
        temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == 100
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": long}],
                                       temperature=0, extra_body={"truncate_prompt_tokens": 50})
    assert r.usage.prompt_tokens == 50 and r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens must be"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"truncate_prompt_tokens": 0})
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids must not be empty"):
        client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=4,
                                  extra_body={"allowed_token_ids": []})
    with pytest.raises(openai.BadRequestError, match="min_tokens must be in"):
        client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=4,
                                  extra_body={"min_tokens": 5})


def test_logit_bias_as_openai_sends_it(client, offline):
    """Token ids as JSON strings; the same tokens and (raw) logprobs as LLM.generate's."""
    plain = offline.generate([PROMPTS[1]], kvserve.SamplingParams(temperature=0, max_tokens=8),
                             use_tqdm=False)[0].outputs[0].token_ids
    bias = {plain[0]: -100.0, plain[2]: 100.0}
    want = offline.generate([PROMPTS[1]], kvserve.SamplingParams(
        temperature=0, max_tokens=8, logprobs=1, logit_bias=bias), use_tqdm=False)[0].outputs[0]
    assert want.token_ids == [plain[2]] * 8
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], logprobs=1,
                                  logit_bias={str(t): b for t, b in bias.items()},
                                  temperature=0, max_tokens=8)
    assert r.choices[0].text == want.text
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(
        [t.logprob for t in want.logprobs], abs=1e-5)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       temperature=0, max_tokens=4,
                                       logit_bias={str(plain[2]): 100})
    assert r.choices[0].message.content == offline.tokenizer.decode([plain[2]] * 4)


def test_bad_words_as_vllm_takes_them(client, offline):
    """vLLM's bad_words (completions and chat): the output LLM.generate gives with them."""
    free = offline.generate([PROMPTS[1]], kvserve.SamplingParams(temperature=0, max_tokens=16),
                            use_tqdm=False)[0].outputs[0].text
    words = [w for w in free.split() if w.isalpha()][:3]
    want = offline.generate([PROMPTS[1]], kvserve.SamplingParams(
        temperature=0, max_tokens=16, bad_words=words), use_tqdm=False)[0].outputs[0].text
    assert want != free
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], temperature=0, max_tokens=16,
                                  extra_body={"bad_words": words})
    assert r.choices[0].text == want
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       temperature=0, max_tokens=8,
                                       extra_body={"bad_words": words})
    assert r.choices[0].message.content == offline.chat(
        [{"role": "user", "content": "hi"}], kvserve.SamplingParams(
            temperature=0, max_tokens=8, bad_words=words), use_tqdm=False,
        chat_template=TEMPLATE)[0].outputs[0].text


def test_tokenize_and_detokenize_as_vllm_serves_them(server, offline):
    def post(path, **body):
        return httpx.post(server.url + path, json=body, timeout=30)

    text = PROMPTS[1]
    r = post("/tokenize", model=NAME, prompt=text, return_token_strs=True).json()
    want = offline.tokenizer.encode(text)
    assert r["tokens"] == want and r["count"] == len(want) and r["max_model_len"] == 256
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(MODEL / "tokenizer.json"))
    assert r["token_strs"] == hf.convert_ids_to_tokens(want)
    r = post("/tokenize", prompt=text, add_special_tokens=False).json()
    assert r["tokens"] == offline.tokenizer.encode(text, add_special_tokens=False)
    assert "token_strs" not in r
    messages = [{"role": "user", "content": "Speak, speak."}]
    r = post("/tokenize", model=NAME, messages=messages).json()
    chat = offline.chat(messages, kvserve.SamplingParams(max_tokens=1), use_tqdm=False,
                        chat_template=TEMPLATE)[0]
    assert r["tokens"] == chat.prompt_token_ids
    r = post("/detokenize", model=NAME, tokens=want).json()
    assert r["prompt"] == offline.tokenizer.decode(want)
    assert httpx.get(server.url + "/version").json()["version"]
    for path, body, status, param in [
            ("/tokenize", dict(prompt="x", messages=messages), 400, "prompt"),
            ("/tokenize", dict(), 400, "prompt"),
            ("/tokenize", dict(messages=[]), 400, "messages"),
            ("/tokenize", dict(prompt="x", model="other"), 404, "model"),
            ("/detokenize", dict(tokens=[1, 10**6]), 400, "tokens"),
            ("/detokenize", dict(tokens=[-1]), 400, "tokens"),
            ("/detokenize", dict(tokens="abc"), 400, "tokens")]:
        r = post(path, **body)
        assert r.status_code == status, (path, body, r.text)
        assert r.json()["error"]["param"] == param, (path, body, r.text)


def test_unset_fields_take_the_generation_config_defaults(client, offline):
    """The shipped model's generation_config.json says temperature 0.8 and top_k 50: a request
    that leaves them unset samples with them (vLLM's server does the same); a field it sets
    wins."""
    def sampled(**params):
        return offline.generate([PROMPTS[0]], kvserve.SamplingParams(
            seed=7, max_tokens=12, **params), use_tqdm=False)[0].outputs[0].text

    want = sampled(temperature=0.8, top_k=50)
    assert want != sampled(temperature=1.0)
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], seed=7, max_tokens=12)
    assert r.choices[0].text == want
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], seed=7, max_tokens=12,
                                  temperature=1.0, extra_body={"top_k": -1})
    assert r.choices[0].text == sampled(temperature=1.0)


def test_echo_puts_the_prompt_and_its_logprobs_first(client, offline):
    """echo with logprobs, as lm-evaluation-harness scores a continuation: the prompt's text and
    tokens lead each choice, the first token's logprob null, the others the prompt logprobs of
    LLM.generate (transformers' in tests/engine/test_prompt_logprobs.py), streamed or not."""
    prompt = PROMPTS[2]
    want = offline.generate([prompt], kvserve.SamplingParams(
        temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1), use_tqdm=False)[0]
    ids = want.prompt_token_ids
    r = client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1,
                                  temperature=0, max_tokens=3)
    choice = r.choices[0]
    assert choice.text == prompt + want.outputs[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    expected = [e.logprob for e in want.prompt_logprobs[1:]] + \
        [e.logprob for e in want.outputs[0].logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert lp.tokens[:len(ids)] == [offline.tokenizer.decode([t], skip_special_tokens=False)
                                    for t in ids]
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    chunks = list(client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1,
                                            temperature=0, max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:])
    # Without logprobs, only the text; with n > 1, every choice starts with its prompt; a
    # token-id prompt echoes its decoded text.
    r = client.completions.create(model=NAME, prompt=[prompt, PROMPTS[0]], echo=True, n=2,
                                  temperature=1.0, seed=3, max_tokens=2)
    assert all(c.text.startswith(p)
               for c, p in zip(r.choices, [prompt] * 2 + [PROMPTS[0]] * 2, strict=True))
    assert all(c.logprobs is None for c in r.choices) and r.usage.completion_tokens == 4 * 2
    r = client.completions.create(model=NAME, prompt=ids, echo=True, temperature=0,
                                  max_tokens=3)
    assert r.choices[0].text == offline.tokenizer.decode(ids, skip_special_tokens=False) + \
        want.outputs[0].text


# ------------------------------------------------------------------------------------ chat

def test_chat_renders_the_template_and_streams(client, offline):
    messages = [{"role": "user", "content": "Speak, speak."}]
    prompt = "USER:\nSpeak, speak.\n\nASSISTANT:\n"
    want = offline.generate([prompt], kvserve.SamplingParams(temperature=0, max_tokens=24),
                            use_tqdm=False)[0]
    r = client.chat.completions.create(model=NAME, messages=messages, **greedy())
    # The template writes no BOS: the prompt is the rendered text without special tokens.
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) - 1
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, stream=True,
                                                 **greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == r.choices[0].message.content
    r = client.chat.completions.create(model=NAME, messages=messages, logprobs=True,
                                       top_logprobs=3, max_completion_tokens=5, temperature=0)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 == r.usage.completion_tokens
    assert all(len(t.top_logprobs) <= 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6
               for t in content)


def test_chat_continues_a_final_message_and_takes_template_variables(server, client, offline):
    # vLLM's continue_final_message and chat_template_kwargs give the prompt LLM.chat gives.
    template = TEMPLATE + "{% if style is defined %}({{ style }})\n{% endif %}"
    messages = [{"role": "user", "content": "Speak, speak."},
                {"role": "assistant", "content": "O, speak again, "}]
    cases = [(messages, dict(add_generation_prompt=False, continue_final_message=True)),
             (messages[:1], dict(chat_template_kwargs={"style": "verse"}))]
    kept, server.state.chat_template = server.state.chat_template, ChatTemplate(template)
    try:
        for chat, options in cases:
            want = offline.chat(chat, kvserve.SamplingParams(temperature=0, max_tokens=24),
                                use_tqdm=False, chat_template=template, **options)[0]
            r = client.chat.completions.create(model=NAME, messages=chat, extra_body=options,
                                               **greedy())
            assert r.usage.prompt_tokens == len(want.prompt_token_ids)
            assert r.choices[0].message.content == want.outputs[0].text
    finally:
        server.state.chat_template = kept


@pytest.mark.parametrize("extra, param", [
    (dict(continue_final_message=True), "continue_final_message"),
    (dict(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
])
def test_chat_template_options_that_cannot_render_are_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, extra_body=extra)
    assert info.value.body["param"] == param


@pytest.mark.parametrize("extra, param", [
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (dict(functions=[{"name": "f", "parameters": {}}]), "functions"),
    (dict(function_call={"name": "f"}), "function_call"),
    (dict(modalities=["text", "audio"]), "modalities"),
    (dict(audio={"voice": "alloy", "format": "wav"}), "audio"),
    (dict(response_format={"type": "json_object"}), "response_format"),
])
def test_chat_fields_that_would_change_the_answer_are_a_400_not_ignored(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, extra_body=extra)
    assert info.value.body["param"] == param
    # Their defaults are no request for anything: answered.
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, temperature=0, extra_body=dict(
                                           function_call="none", modalities=["text"]))
    assert r.choices[0].finish_reason in ("length", "stop")


def test_chat_without_a_template_is_a_400(server, client):
    template, server.state.chat_template = server.state.chat_template, None
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model=NAME, messages=[{"role": "user",
                                                                  "content": "hi"}])
    finally:
        server.state.chat_template = template


# ---------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(temperature=-1.0), "BadRequestError", "temperature"),
    (dict(top_p=0.0), "BadRequestError", "top_p"),
    (dict(n=0), "BadRequestError", "n must be"),
    (dict(max_tokens=1000), "BadRequestError", "max_model_len"),
    (dict(prompt="x" * 5000), "BadRequestError", "max_model_len"),
    (dict(prompt=[10 ** 9]), "BadRequestError", "vocabulary"),
    (dict(prompt=[]), "BadRequestError", "empty"),
    (dict(prompt=[[1, 5, 9], [10 ** 9]], max_tokens=200), "BadRequestError", "vocabulary"),
    (dict(suffix="the end"), "BadRequestError", "suffix"),
    (dict(echo=True, logprobs=10 ** 6), "BadRequestError", "logprobs must be at most"),
    (dict(logit_bias={"five": 1.0}), "BadRequestError", "logit_bias keys must be token ids"),
    (dict(logit_bias={"1" * 30: 1.0}), "BadRequestError", "logit_bias keys must be token ids"),
    (dict(logit_bias={"5": 101}), "BadRequestError", r"logit_bias values must be in \[-100"),
    (dict(logit_bias={"-5": 1}), "BadRequestError", "non-negative"),
    (dict(logit_bias={"99999": 1}), "BadRequestError", "outside the vocabulary"),
    (dict(model="gpt-4"), "NotFoundError", "does not exist"),
])
def test_bad_requests_get_openai_errors(client, engine, kwargs, error, match):
    args = dict(model=NAME, prompt=PROMPTS[0], max_tokens=4) | kwargs
    with pytest.raises(getattr(openai, error), match=match) as info:
        client.completions.create(**args)
    body = info.value.body
    assert set(body) >= {"message", "type", "param", "code"}
    wait_idle(engine)


def test_malformed_json_is_a_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME})  # no prompt
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]


def test_api_key_and_loading(engine):
    state = ServerState(NAME, api_key="secret")
    with BackgroundServer(state) as s:
        assert httpx.get(s.url + "/health").status_code == 503  # still loading
        r = httpx.get(s.url + "/v1/models", headers={"authorization": "Bearer secret"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        state.ready(engine, None)
        assert httpx.get(s.url + "/health").status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = httpx.get(s.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong",
                          max_retries=0).models.list()
        models = openai.OpenAI(base_url=s.url + "/v1", api_key="secret").models.list()
        assert [m.id for m in models.data] == [NAME]
        assert httpx.get(s.url + "/metrics").status_code == 200  # outside /v1: no key


# ------------------------------------------------------------------------ disconnects

# The disconnect tests' requests ask for 1,000 tokens (seconds of decoding, where 200 took 0.65 s
# on a fast machine and could finish before the server saw the disconnect): a server of its own
# with the context for them.
LONG_TOKENS = 1000


@pytest.fixture(scope="module")
def long_engine():
    with AsyncLLMEngine(MODEL, dtype="float32", max_model_len=1024, num_blocks=80) as e:
        yield e


@pytest.fixture(scope="module")
def long_server(long_engine):
    state = ServerState(NAME)
    state.ready(long_engine, None)
    with BackgroundServer(state) as s:
        yield s


def test_a_disconnect_mid_stream_frees_the_request(long_server, long_engine):
    server, engine = long_server, long_engine
    wait_idle(engine)
    before = engine.get_stats().num_aborted_requests
    body = dict(model=NAME, prompt=PROMPTS[2], max_tokens=LONG_TOKENS, temperature=0,
                stream=True, ignore_eos=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert engine.engine.has_unfinished_requests()
    wait_idle(engine)
    assert engine.get_stats().num_aborted_requests == before + 1


def test_a_disconnect_before_the_answer_frees_the_request(long_server, long_engine):
    server, engine = long_server, long_engine
    wait_idle(engine)
    before = engine.get_stats().num_aborted_requests
    body = dict(model=NAME, prompt=PROMPTS[2], max_tokens=LONG_TOKENS, temperature=0,
                ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    wait_idle(engine)
    assert engine.get_stats().num_aborted_requests == before + 1


# -------------------------------------------------------------------------------- metrics

def scrape(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"[{v}]" for k, v in sorted(sample.labels.items())
                                        if k not in ("model_name", "le"))
            if "le" not in sample.labels:
                values[key] = values.get(key, 0.0) + sample.value
    return values


def test_metrics_count_the_work_done(server, client, engine):
    wait_idle(engine)
    before = scrape(server)
    r = client.completions.create(model=NAME, prompt=PROMPTS, n=2, temperature=0.8, seed=1,
                                  max_tokens=10, extra_body={"ignore_eos": True})
    after = scrape(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["kvserve:prompt_tokens_total"] == r.usage.prompt_tokens
    assert delta["kvserve:generation_tokens_total"] == r.usage.completion_tokens == 60
    assert delta["kvserve:request_success_total[length]"] == 6
    assert delta["kvserve:time_to_first_token_seconds_count"] == 3
    assert delta["kvserve:e2e_request_latency_seconds_count"] == 3
    assert after["kvserve:num_requests_running"] == 0 == after["kvserve:num_requests_waiting"]
    assert 0 <= after["kvserve:kv_cache_usage_perc"] <= 1
    assert after["kvserve:prefix_cache_queries_total"] >= after["kvserve:prefix_cache_hits_total"]


# ------------------------------------------------------------------------------------ load

def test_concurrent_streams_with_cancellations_lose_nothing(server, engine, offline):
    """Streams of greedy completions, a third cancelled at a random point: every stream that
    finishes has exactly LLM.generate's text, the rest end early, and every block is free."""
    count, rng = 60, random.Random(0)
    prompts = [PROMPTS[i % 3] + " " * (i % 5) for i in range(count)]
    lengths = [rng.randrange(4, 40) for _ in range(count)]
    want = offline.generate(prompts, [kvserve.SamplingParams(temperature=0, max_tokens=n,
                                                             ignore_eos=True) for n in lengths],
                            use_tqdm=False)
    cancel_after = {i: rng.randrange(1, 4) for i in rng.sample(range(count), count // 3)}

    async def one(http, i):
        body = dict(model=NAME, prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                    ignore_eos=True, stream=True)
        text, chunks, finish = "", 0, None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                text, chunks = text + choice["text"], chunks + 1
                finish = choice["finish_reason"] or finish
                if i in cancel_after and chunks == cancel_after[i]:
                    return i, text, "cancelled"
        return i, text, finish

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(count)))

    results = asyncio.run(run())
    for i, text, finish in results:
        if finish == "cancelled":
            assert want[i].outputs[0].text.startswith(text)
        else:
            assert (text, finish) == (want[i].outputs[0].text, "length"), i
    wait_idle(engine)


# --------------------------------------------------------------------------- command line

def test_the_serve_command(tmp_path):
    """`python -m kvserve serve`: 503 while loading, then the API, with its API key (from
    KVSERVE_API_KEY) and its limits; a chat template path that does not exist fails at once."""
    import os
    import subprocess
    import sys

    from kvserve.server.serve import free_port

    missing = subprocess.run(
        [sys.executable, "-m", "kvserve", "serve", "--model", str(MODEL), "--chat-template",
         str(tmp_path / "no-such-template.jinja")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "serve", "--model", str(MODEL), "--port", str(port),
         "--served-model-name", NAME, "--chat-template", TEMPLATE,
         "--max-model-len", "128", "--threads", "1", "--max-prompts-per-request", "2",
         "--max-stop-strings", "2"],
        env={**os.environ, "PYTHONUNBUFFERED": "1", "KVSERVE_API_KEY": "k"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline, statuses = time.monotonic() + 60, set()
        while 200 not in statuses:
            assert server.poll() is None and time.monotonic() < deadline, server.stdout.read()
            try:
                statuses.add(httpx.get(url + "/health").status_code)
            except httpx.TransportError:
                time.sleep(0.05)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert client.models.list().data[0].max_model_len == 128
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user",
                                                                  "content": "Speak."}],
                                           max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5
        with pytest.raises(openai.BadRequestError, match="at most 2 prompts"):
            client.completions.create(model=NAME, prompt=["a", "b", "c"], max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="at most 2 stop strings"):
            client.completions.create(model=NAME, prompt="a", stop=["x", "y", "z"], max_tokens=2)
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        server.terminate()
        server.wait(timeout=30)
    # The start-up log names the sampling defaults the model's generation_config.json gives.
    assert ("default sampling parameters from generation_config.json: temperature=0.8, top_k=50"
            in server.stdout.read())


def test_speculative_counters_appear_with_speculation():
    from prometheus_client import generate_latest

    from kvserve.server.metrics import ServerMetrics

    llm = kvserve.LLM(MODEL, dtype="float32", max_model_len=128, speculative_method="ngram",
                      num_speculative_tokens=3)
    metrics = ServerMetrics(NAME)
    metrics.attach(llm.llm_engine)
    llm.generate([PROMPTS[1] * 3], kvserve.SamplingParams(temperature=0, max_tokens=24),
                 use_tqdm=False)
    values = {s.name: s.value for f in prometheus_parser.text_string_to_metric_families(
        generate_latest(metrics.registry).decode()) for s in f.samples}
    stats = llm.llm_engine.get_stats()
    assert values["kvserve:spec_decode_num_drafts_total"] == stats.num_drafts > 0
    assert values["kvserve:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert values["kvserve:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens


def test_lora_adapters_are_models_of_their_own(tmp_path, offline):
    """--lora-modules: each adapter is a model in /v1/models (its parent the base) and a request
    names it in "model"; its completions are the merged adapter's, the base model's the base's."""
    from kvserve.cli import _lora_modules
    from kvserve.server.serve import lora_requests
    from tests.models.test_lora import make_adapter

    make_adapter(MODEL, tmp_path / "adapter", r=4, lora_alpha=8,
                 target_modules=["q_proj", "v_proj", "down_proj"])
    kvserve.merge_lora(MODEL, tmp_path / "adapter", tmp_path / "merged")
    state = ServerState(NAME, lora_modules=lora_requests(
        _lora_modules([f"sonnets={tmp_path / 'adapter'}"])))
    with AsyncLLMEngine(MODEL, dtype="float32", max_model_len=256, num_blocks=64,
                        enable_lora=True, max_loras=2, max_lora_rank=4) as engine:
        state.ready(engine, None)
        with BackgroundServer(state) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            models = client.models.list().data
            assert [m.id for m in models] == [NAME, "sonnets"]
            assert models[1].parent == NAME
            r = client.completions.create(model="sonnets", prompt=PROMPTS[:2], **greedy())
            assert r.model == "sonnets"
            merged = kvserve.LLM(tmp_path / "merged", dtype="float32", max_model_len=256)
            params = kvserve.SamplingParams(temperature=0, max_tokens=24)
            want = merged.generate(PROMPTS[:2], params, use_tqdm=False)
            assert [c.text for c in r.choices] == [w.outputs[0].text for w in want]
            base = client.completions.create(model=NAME, prompt=PROMPTS[:1], **greedy())
            assert base.choices[0].text == offline.generate(
                PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].text
            with pytest.raises(openai.NotFoundError, match="'sonnets'"):
                client.completions.create(model="poems", prompt="x", max_tokens=2)
    with pytest.raises(ValueError, match="NAME=PATH"):
        _lora_modules(["sonnets"])
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        lora_requests({"x": tmp_path})
