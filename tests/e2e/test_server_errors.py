"""Every bad input to the HTTP server, as an attacker would send it, gets a 4xx in OpenAI's error
shape ({"error": {"message", "type", "param", "code"}}) without hanging, and the server goes on
serving: bodies that do not parse or are not UTF-8, lone surrogates, unknown routes and methods,
numbers past 64 bits, oversized bodies (announced or chunked), too many prompts or stop strings,
a full waiting queue (429 with Retry-After); the API key is checked before the body is read."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvserve.async_engine import AsyncLLMEngine  # noqa: E402
from kvserve.server import ServerState  # noqa: E402
from kvserve.server.chat_template import ChatTemplate  # noqa: E402
from kvserve.server.guard import bearer_token_matches  # noqa: E402
from kvserve.server.limits import ServerLimits  # noqa: E402
from kvserve.server.serve import BackgroundServer  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "models" / "shakespeare-target"
NAME = "shakespeare"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
LIMITS = ServerLimits(max_body_bytes=4096, max_prompts_per_request=3, max_prompt_chars=500)


@pytest.fixture(scope="module")
def engine():
    with AsyncLLMEngine(MODEL, dtype="float32", max_model_len=256, num_blocks=64,
                        max_stop_strings=4, max_stop_string_length=16) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    state = ServerState(NAME, api_key="secret", limits=LIMITS)
    state.ready(engine, ChatTemplate(TEMPLATE))
    with BackgroundServer(state) as s:
        yield s


AUTH = {"authorization": "Bearer secret"}


def post(server, path, body=None, content=None, headers=None, timeout=30.0):
    """A POST with the key; `timeout` bounds a hang (how fast a rejection is, the chaos
    benchmark measures: timing is not asserted in tests)."""
    if body is not None:  # json.dumps escapes lone surrogates (httpx would refuse them)
        content = json.dumps(body).encode()
        headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, content=content, headers={**AUTH, **(headers or {})},
                      timeout=timeout)


def assert_openai_error(r, status: int, match: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if match is not None:
        assert match in error["message"], error["message"]
    return error


def completion(**extra):
    return {"model": NAME, "prompt": "ROMEO:", "max_tokens": 4, **extra}


def chat(content, **extra):
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            **extra}


@pytest.mark.parametrize("body, match", [
    (completion(seed=-1), "seed"),
    (completion(seed=2**64), "seed"),
    (completion(max_tokens=0), "max_tokens"),
    (completion(max_tokens=2**70), "max_tokens"),
    (completion(n=2**64), "n"),
    (completion(top_k=-2**70), "top_k"),
    (completion(prompt=[[1, 2], [2**80]]), "prompt"),
    (completion(prompt=["a", "b", "c", "d"]), "at most 3 prompts"),
    (completion(prompt="x" * 501), "more than 500"),
    (completion(stop=["a", "b", "c", "d", "e"]), "at most 4 stop strings"),
    (completion(stop=["x" * 17]), "at most 16 characters"),
    (completion(prompt="\ud800ROMEO"), "lone surrogate"),
    (completion(stop=["\udfff"]), "lone surrogate"),
    (completion(bad_words=["\udfff"]), "lone surrogate"),
    (completion(bad_words=[" "]), "bad_words must not be empty or blank"),
    (completion(bad_words="thou"), "bad_words"),
    (completion(bad_words=["z"] * 129), "at most 128 bad_words"),
    (chat("\ud83d"), "lone surrogate"),
    (chat([{"type": "image_url", "image_url": {"url": "x"}}]), "only text content parts"),
    (chat("hi", max_completion_tokens=0), "max_completion_tokens"),
    (chat("hi", chat_template_kwargs={"x": ["\udc00"]}), "lone surrogate"),
    (chat("hi", chat_template_kwargs={"messages": []}), "may not set messages"),
    (chat("hi", chat_template_kwargs=["enable_thinking"]), "chat_template_kwargs"),
    (chat("hi", continue_final_message=True), "exclude each other"),
    (chat(5), "content"),
    (chat("y" * 600), "more than 500"),
    (completion(temperature=float("nan")), "temperature"),
])
def test_bad_values_are_400s(server, engine, body, match):
    assert_openai_error(post(server, body=body, path="/v1/chat/completions" if "messages" in body
                             else "/v1/completions"), 400, match)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2]", b"",
                                     b'{"prompt": "\\ud800"', b"null"])
def test_bodies_that_do_not_parse_are_400s(server, content):
    r = post(server, "/v1/completions", content=content,
             headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_unknown_routes_and_methods_are_openai_errors(server):
    error = assert_openai_error(httpx.get(server.url + "/v1/nothing", headers=AUTH), 404)
    assert error["code"] == "not_found"
    assert_openai_error(httpx.get(server.url + "/v1/completions", headers=AUTH), 405)
    # Without the key a client learns nothing, not even which routes exist.
    assert_openai_error(httpx.get(server.url + "/v1/nothing"), 401)


def test_the_key_is_checked_before_the_body(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 401)
    assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(server.url + "/v1/completions", content=b"x" * 100_000)
    assert_openai_error(r, 401)  # not 413: nothing about the server before the key
    for header in ("bearer secret", "BEARER secret", "Bearer  secret"):
        r = httpx.post(server.url + "/v1/completions", json=completion(),
                       headers={"authorization": header})
        assert r.status_code == 200, header
    for header in ("Basic secret", "Bearer secre", "Bearer secret2", "secret", "Bearer"):
        assert_openai_error(httpx.post(server.url + "/v1/completions", json=completion(),
                                       headers={"authorization": header}), 401)


def test_tokenize_routes_sit_behind_the_key_and_the_limits(server):
    for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
        assert_openai_error(httpx.post(server.url + path, json=body), 401)
        assert post(server, path, body=body).status_code == 200
    assert_openai_error(post(server, "/tokenize", body={"prompt": "x" * 501}), 400,
                        "more than 500")
    assert_openai_error(post(server, "/tokenize", body={"messages": [
        {"role": "user", "content": "y" * 600}]}), 400, "more than 500")
    assert_openai_error(post(server, "/tokenize", body={"prompt": "\ud800"}), 400,
                        "lone surrogate")


def test_bearer_tokens_compare_in_constant_time_and_any_case():
    assert bearer_token_matches("bEaReR k", "k")
    assert not bearer_token_matches(None, "k")
    assert not bearer_token_matches("Bearer \u00e9", "k")


def test_docs_and_openapi_are_off_by_default(server):
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert_openai_error(httpx.get(server.url + path, headers=AUTH), 404)


def test_docs_when_enabled_sit_behind_the_key(engine):
    state = ServerState(NAME, api_key="secret", enable_docs=True)
    state.ready(engine, None)
    with BackgroundServer(state) as s:
        assert_openai_error(httpx.get(s.url + "/openapi.json"), 401)
        assert httpx.get(s.url + "/openapi.json", headers=AUTH).json()["info"]["title"]
        assert httpx.get(s.url + "/health").status_code == 200


def test_oversized_bodies_are_413s(server):
    big = completion(prompt="z" * 5000)
    assert_openai_error(post(server, "/v1/completions", body=big), 413, "4096 bytes")

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b"z" * 1000

    r = httpx.post(server.url + "/v1/completions", content=chunks(),
                   headers={**AUTH, "content-type": "application/json"})
    assert_openai_error(r, 413)


def test_a_full_waiting_queue_is_a_429_with_retry_after(engine):
    with AsyncLLMEngine(MODEL, dtype="float32", max_model_len=256, num_blocks=64,
                        max_waiting_requests=1, max_num_seqs=1) as small:
        state = ServerState(NAME)
        state.ready(small, None)
        with BackgroundServer(state) as s:
            # Three prompts of one call: with one sequence running (the first, or none yet), the
            # third finds the second (or the first) waiting. Each takes 32 steps: none finishes
            # while the call submits the next.
            r = httpx.post(s.url + "/v1/completions",
                           json=completion(prompt=["a", "b", "c"], max_tokens=32))
            error = assert_openai_error(r, 429, "max_waiting_requests")
            assert error["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
            assert httpx.post(s.url + "/v1/completions", json=completion()).status_code == 200
            deadline = time.monotonic() + 10
            while small.engine.has_unfinished_requests():  # the refused call's first prompts
                assert time.monotonic() < deadline
                time.sleep(0.02)


def test_a_missing_chat_template_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        ChatTemplate.from_model_dir(MODEL, tmp_path / "tmeplate.jinja")
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert ChatTemplate.from_model_dir(MODEL, tmp_path / "t.jinja").render(
        [{"role": "user", "content": "hi"}]) == "user: hi\n"
    assert ChatTemplate.from_model_dir(MODEL, "{{ messages[0]['content'] }}").render(
        [{"role": "user", "content": "hi"}]) == "hi"


def test_the_server_still_serves_after_all_that(server, engine):
    r = post(server, "/v1/completions", body=completion(max_tokens=3))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 10
    while engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    blocks = engine.engine.block_manager
    assert blocks.num_free_blocks() == blocks.num_usable_blocks()


def test_lora_adapters_that_fail_to_load_are_openai_errors(tmp_path, checkpoint_factory):
    """A missing weights file is the server's fault (500), an adapter that does not fit the
    model the client's choice (400); both in OpenAI's shape, and the server goes on."""
    import shutil

    from kvserve.lora_serving import LoRARequest
    from tests.models.test_lora import make_adapter

    base = checkpoint_factory("LlamaForCausalLM")
    make_adapter(base, tmp_path / "good", r=4, lora_alpha=8, target_modules=["q_proj"])
    (tmp_path / "no-weights").mkdir()
    shutil.copy(tmp_path / "good" / "adapter_config.json", tmp_path / "no-weights")
    make_adapter(base, tmp_path / "big", r=32, lora_alpha=8, target_modules=["q_proj"])
    with AsyncLLMEngine(base, dtype="float32", max_model_len=64, num_blocks=32,
                        enable_lora=True, max_loras=2, max_lora_rank=8) as engine:
        state = ServerState(NAME, lora_modules={
            name: LoRARequest(name, tmp_path / name) for name in ("good", "no-weights", "big")})
        state.ready(engine, None)
        with BackgroundServer(state) as s:
            def ask(model):
                return httpx.post(s.url + "/v1/completions", timeout=30, json={
                    "model": model, "prompt": [1, 5, 9], "max_tokens": 2})
            assert_openai_error(ask("no-weights"), 500, "failed to load")
            assert_openai_error(ask("big"), 400, "max_lora_rank")
            assert ask("good").status_code == 200


def test_the_fault_injection_route_exists_only_when_asked(server, engine):
    assert_openai_error(post(server, "/fault/step_failures", body={"count": 1}), 404)
    state = ServerState(NAME, fault_injection=True)
    state.ready(engine, None)
    with BackgroundServer(state) as s:
        assert httpx.post(s.url + "/fault/step_failures", json={"count": 1}).json() == {
            "count": 1}
        assert_openai_error(httpx.post(s.url + "/fault/step_failures", json={}), 400)
        r = httpx.post(s.url + "/v1/completions", json=completion(), timeout=30)
        assert_openai_error(r, 500, "injected step failure")
        assert httpx.post(s.url + "/v1/completions", json=completion(),
                          timeout=30).status_code == 200


def test_a_long_conversation_is_not_a_list_of_prompts(server):
    messages = [{"role": "user", "content": "hi"}] * 10  # more messages than prompts allowed
    r = post(server, "/v1/chat/completions", body={"model": NAME, "messages": messages,
                                                    "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_ignored_fields_are_named_once_in_the_log(server, caplog, monkeypatch):
    from kvserve.server import protocol
    monkeypatch.setattr(protocol, "_warned_fields", set())  # whatever other tests sent
    body = completion()
    body.update(guided_json={"type": "object"}, guided_regex="x+", bad_words=["x"],
                temperature=0)
    with caplog.at_level("WARNING", logger="kvserve.server"):
        for _ in range(2):
            assert post(server, "/v1/completions", body=body).status_code == 200
    warned = [r.getMessage() for r in caplog.records if r.name == "kvserve.server"]
    assert len(warned) == 1 and "'guided_json', 'guided_regex'" in warned[0]
    assert "temperature" not in warned[0] and "bad_words" not in warned[0]  # both taken
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvserve.server"):
        protocol._warn_ignored([f"f{i}" for i in range(400)])
        protocol._warn_ignored(["another"])
    assert len(protocol._warned_fields) == protocol._MAX_WARNED_FIELDS
    assert len([r for r in caplog.records if r.name == "kvserve.server"]) == 1
