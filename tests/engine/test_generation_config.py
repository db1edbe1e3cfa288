"""Default sampling parameters from a checkpoint's generation_config.json (vLLM's
--generation-config auto): read as vLLM reads the file, used by LLM.generate without
parameters, LLMEngine.add_request and the server's requests that leave a field unset (max_tokens
from max_new_tokens), and by `kvserve generate`; off with generation_config="none"; a bad file is
a ValueError naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import kvserve
from kvserve import SamplingParams
from kvserve.sampling_params import generation_defaults

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "models" / "shakespeare-target"  # temperature 0.8, top_k 50, do_sample true
PROMPT = "ROMEO:\n"


def write(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_the_fields_vllm_reads_and_nothing_else(tmp_path):
    d = write(tmp_path / "g", {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0,
                               "repetition_penalty": 1.05, "do_sample": False, "bos_token_id": 1,
                               "max_new_tokens": 512, "presence_penalty": 1.5, "top_a": None})
    assert generation_defaults("auto", d) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                              "min_p": 0.0, "repetition_penalty": 1.05,
                                              "max_tokens": 512}
    assert generation_defaults("auto", tmp_path / "elsewhere") == {}  # no file: no defaults
    assert generation_defaults(str(d), tmp_path / "elsewhere")["top_k"] == 20  # a directory
    for off in ("none", "vllm"):
        assert generation_defaults(off, d) == {}
    # transformers' spellings of "off": top_k 0 and null.
    assert generation_defaults("auto", write(tmp_path / "z", {"top_k": 0})) == {"top_k": 0}
    assert generation_defaults("auto", write(tmp_path / "n", {"top_k": None})) == {}


@pytest.mark.parametrize("config, message", [
    ({"temperature": -1}, "temperature must be a finite number >= 0"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"max_new_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
    ({"top_k": 10**30}, "top_k"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"repetition_penalty": True}, "repetition_penalty must be a number"),
    ([1, 2], "expected a JSON object"),
])
def test_a_bad_file_is_a_value_error_naming_it(tmp_path, config, message):
    d = write(tmp_path / "bad", config)
    with pytest.raises(ValueError, match=message) as info:
        generation_defaults("auto", d)
    assert str(d / "generation_config.json") in str(info.value)


def test_a_missing_directory_or_broken_json_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        generation_defaults(str(tmp_path / "nowhere"), SHIPPED)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        generation_defaults("auto", tmp_path)


def test_llm_generate_without_parameters_samples_with_the_files_defaults(tmp_path):
    llm = kvserve.LLM(SHIPPED, dtype="float32", max_model_len=128)
    want = SamplingParams(temperature=0.8, top_k=50)
    assert repr(llm.get_default_sampling_params()) == repr(want)
    assert repr(llm.llm_engine.get_default_sampling_params()) == repr(want)
    # The default is what is used: seeded by hand, the same tokens as the explicit parameters.
    seeded = llm.get_default_sampling_params()
    seeded.seed, seeded.max_tokens = 3, 12
    explicit = SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=12)
    assert (llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
            == llm.generate([PROMPT], explicit, use_tqdm=False)[0].outputs[0].token_ids)
    llm.llm_engine.add_request("r", PROMPT)  # params None: the defaults, 16 tokens
    out = [o for _ in range(40) for o in llm.llm_engine.step() if o.finished]
    assert len(out[0].outputs[0].token_ids) == 16
    plain = kvserve.LLM(SHIPPED, dtype="float32", max_model_len=128, generation_config="none")
    assert repr(plain.get_default_sampling_params()) == repr(SamplingParams())


def test_an_engine_with_a_bad_file_does_not_start(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(SHIPPED, model)
    write(model, {"temperature": float("nan")})
    with pytest.raises(ValueError, match="generation_config.json: SamplingParams: temperature"):
        kvserve.LLM(model, dtype="float32")
    assert kvserve.LLM(model, dtype="float32", generation_config="none")  # the file ignored


def test_max_new_tokens_is_the_default_length_everywhere(tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from kvserve.async_engine import AsyncLLMEngine
    from kvserve.server import ServerState
    from kvserve.server.chat_template import ChatTemplate
    from kvserve.server.serve import BackgroundServer

    model = tmp_path / "model"
    shutil.copytree(SHIPPED, model)
    write(model, {"temperature": 0.0, "max_new_tokens": 5})
    llm = kvserve.LLM(model, dtype="float32", max_model_len=128)
    assert llm.get_default_sampling_params().max_tokens == 5
    assert len(llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids) == 5
    with AsyncLLMEngine(model, dtype="float32", max_model_len=128) as engine:
        state = ServerState("m")
        state.ready(engine, ChatTemplate("{{ messages[0]['content'] }}", {}))
        with BackgroundServer(state) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
            r = client.completions.create(model="m", prompt=PROMPT)
            assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
            r = client.completions.create(model="m", prompt=PROMPT, max_tokens=7)
            assert r.usage.completion_tokens == 7  # the request's own wins
            r = client.chat.completions.create(model="m", messages=[{"role": "user",
                                                                     "content": PROMPT}])
            assert r.usage.completion_tokens == 5  # at most max_new_tokens of the context
