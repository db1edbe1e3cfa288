"""Checkpoint loading: sharded safetensors, bf16 checkpoints, tied embeddings, dtype choice."""

from __future__ import annotations

import json

import pytest
import torch

import kvserve

PROMPT = [1, 40, 41, 42, 43, 44, 45]
GREEDY = kvserve.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def greedy(path, **kwargs) -> list[int]:
    return kvserve.LLM(path, **kwargs).generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def test_sharded_checkpoint_equals_single_file(checkpoint_factory):
    single = checkpoint_factory("Qwen2ForCausalLM", seed=3)
    sharded = checkpoint_factory("Qwen2ForCausalLM", seed=3, max_shard_size="60KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "fixture should produce several shards"
    assert not (sharded / "model.safetensors").exists()
    assert greedy(sharded) == greedy(single)


def test_bf16_checkpoint_loads_as_bf16_and_upcasts(checkpoint_factory):
    path = checkpoint_factory("LlamaForCausalLM", dtype=torch.bfloat16)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    llm = kvserve.LLM(path)
    assert llm.dtype == torch.bfloat16 and llm.model.dtype == torch.bfloat16
    assert kvserve.LLM(path, dtype="float32").model.dtype == torch.float32


def test_tied_embeddings_need_no_lm_head(checkpoint_factory):
    from safetensors import safe_open

    path = checkpoint_factory("LlamaForCausalLM", tie_word_embeddings=True)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    llm = kvserve.LLM(path)
    assert llm.config.tie_word_embeddings
    # Untying must change the weight bytes by exactly one embedding matrix.
    untied = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"))
    embedding_bytes = llm.config.vocab_size * llm.config.hidden_size * 4
    assert untied.model.weight_bytes - llm.model.weight_bytes == embedding_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", torch.float32])
def test_dtype_argument(checkpoint_factory, dtype):
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), dtype=dtype)
    expected = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    assert llm.model.dtype == expected


def test_text_prompts_round_trip_through_the_tokenizer(checkpoint_factory):
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"))
    out = llm.generate("Once upon a time", kvserve.SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.prompt == "Once upon a time"
    assert out.prompt_token_ids[0] == 1  # BOS from the tokenizer's template
    assert llm.tokenizer.decode(out.prompt_token_ids) == "Once upon a time"
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
