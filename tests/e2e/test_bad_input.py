"""Bad input raises a clear Python exception at the API boundary, and the LLM keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

import kvserve

GREEDY = kvserve.SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture
def checkpoint_copy(checkpoint_factory, tmp_path):
    """A private copy of a tiny Llama checkpoint that a test may damage."""
    path = tmp_path / "model"
    shutil.copytree(checkpoint_factory("LlamaForCausalLM"), path)
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for key, value in changes.items():
        if value is None:
            config.pop(key)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kvserve.LLM(tmp_path / "nowhere")


def test_missing_config(checkpoint_copy):
    (checkpoint_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        kvserve.LLM(checkpoint_copy)


def test_missing_weights(checkpoint_copy):
    (checkpoint_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        kvserve.LLM(checkpoint_copy)


def test_config_that_is_not_json(checkpoint_copy):
    (checkpoint_copy / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        kvserve.LLM(checkpoint_copy)


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": None}, "missing required field 'hidden_size'"),
    ({"num_hidden_layers": "two"}, "'num_hidden_layers' must be a positive integer"),
    ({"num_key_value_heads": 3}, "must divide num_attention_heads"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ({"hidden_size": 128}, "has shape"),  # config disagrees with the weights
])
def test_malformed_config(checkpoint_copy, changes, message):
    edit_config(checkpoint_copy, **changes)
    with pytest.raises(ValueError, match=message):
        kvserve.LLM(checkpoint_copy)


def test_unsupported_architecture_names_supported_ones(checkpoint_copy):
    edit_config(checkpoint_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as info:
        kvserve.LLM(checkpoint_copy)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message


def test_truncated_safetensors(checkpoint_copy):
    weights = checkpoint_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="safetensors"):
        kvserve.LLM(checkpoint_copy)


def test_garbage_safetensors(checkpoint_copy):
    (checkpoint_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        kvserve.LLM(checkpoint_copy)


def test_missing_tensor(checkpoint_copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(checkpoint_copy / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, checkpoint_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        kvserve.LLM(checkpoint_copy)


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "int8"}, "dtype must be"),
    ({"max_model_len": 10_000}, "max_model_len must be"),
    ({"max_model_len": 1}, "max_model_len must be"),
    ({"max_num_seqs": 0}, "max_num_seqs must be"),
    ({"device": "tpu"}, "device must be 'cpu' or 'cuda"),
    ({"device": "not a device"}, "device must be 'cpu' or 'cuda"),
    ({"device": "cuda:64"}, "cuda"),  # no CUDA build, no GPU, or no 65th GPU
])
def test_bad_llm_arguments(checkpoint_factory, kwargs, message):
    with pytest.raises(ValueError, match=message):
        kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kvserve.SamplingParams(**kwargs)


def test_bad_prompts_raise_and_the_llm_keeps_serving(checkpoint_factory, tmp_path):
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), max_model_len=32)
    good = [1, 20, 21, 22]
    expected = llm.generate([good], GREEDY)[0].outputs[0].token_ids
    vocab = llm.config.vocab_size
    cases = [
        ([[1] * 32], ValueError, "exceeds max_model_len 32"),
        ([[1] * 40], ValueError, "exceeds max_model_len 32"),
        ([good, [1] * 40], ValueError, "exceeds max_model_len 32"),  # the good one is taken back
        ([[1, vocab]], ValueError, f"outside the vocabulary \\[0, {vocab}\\)"),
        ([[1, -1]], ValueError, "outside the vocabulary"),
        ([[]], ValueError, "prompt is empty"),
        ([], TypeError, "prompts must be"),
        ([[1.5, 2]], TypeError, "a prompt must be"),
        (None, TypeError, "prompts must be"),
        ([{"prompt_token_ids": good, "prompt": "x"}], ValueError, "not both"),
        ([{"prompt": "x", "multi_modal_data": {}}], ValueError, "not supported: multi_modal_data"),
        ([good, {}], ValueError, 'either "prompt"'),
        ({"prompt_token_ids": [1.5]}, TypeError, "a prompt must be"),
    ]
    for prompts, error, message in cases:
        with pytest.raises(error, match=message):
            llm.generate(prompts, GREEDY)
        # A bad prompt in a batch rejects the batch before any work; the good ones still run after.
        assert llm.generate([good], GREEDY)[0].outputs[0].token_ids == expected
    with pytest.raises(ValueError, match="one SamplingParams or a list of 2"):
        llm.generate([good, good], [GREEDY])
    with pytest.raises(ValueError, match="lora or lora_request"):
        llm.generate([good], GREEDY, lora=kvserve.LoRARequest("a", "/nowhere"),
                     lora_request=kvserve.LoRARequest("a", "/nowhere"))
    # A params object broken after construction is caught when it is used.
    broken = kvserve.SamplingParams(temperature=0)
    broken.top_p = 7.0
    with pytest.raises(ValueError, match="top_p"):
        llm.generate([good], broken)


def test_vllm_prompt_dicts_are_prompts(checkpoint_factory):
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), max_model_len=32)
    good = [1, 20, 21, 22]
    want = [o.outputs[0].token_ids for o in llm.generate([good, "hello"], GREEDY)]
    got = llm.generate([{"prompt_token_ids": good}, {"prompt": "hello"}], GREEDY)
    assert [o.outputs[0].token_ids for o in got] == want
    assert llm.generate({"prompt_token_ids": good}, GREEDY)[0].outputs[0].token_ids == want[0]


def test_text_prompt_without_tokenizer(checkpoint_copy):
    (checkpoint_copy / "tokenizer.json").unlink()
    llm = kvserve.LLM(checkpoint_copy)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        llm.generate("hello", GREEDY)
    assert len(llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids) >= 1
