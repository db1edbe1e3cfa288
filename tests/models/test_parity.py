"""kvserve's C++ runtime against Hugging Face transformers on tiny random checkpoints of every
supported architecture: prompt logits, and greedy continuations as one mixed-length batch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import kvserve
from tests.conftest import ARCHITECTURES

transformers = pytest.importorskip("transformers")

# Tolerances on logits, relative to the largest |logit| of the reference. fp32 differs only by
# summation order; bf16 rounds every activation (kvserve rounds once per fused op, transformers
# after each elementwise op), so it gets a looser bound and is compared on the first tokens only.
LOGIT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-2, torch.float16: 8e-3}
PROMPTS = [
    [1, 5, 9, 200, 31, 7, 8, 9, 10, 11, 12],
    [1, 77],
    [1, 3, 4, 5, 6, 300, 301, 302, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 7],
    [1, 250, 251, 13, 14, 15, 16],
]
NUM_GREEDY_TOKENS = 40

# Variants that exercise config paths beyond the defaults.
VARIANTS = {
    "mistral-sliding-window": ("MistralForCausalLM", dict(sliding_window=8)),
    "llama3-rope-tied-bias": ("LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                         "rope_theta": 500000.0},
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "llama-mqa-linear-rope": ("LlamaForCausalLM", dict(
        num_key_value_heads=1, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 10000.0})),
    "qwen2-yarn": ("Qwen2ForCausalLM", dict(
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                         "rope_theta": 10000.0})),
}


def hf_model(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding by full forward passes: no cache, no generate() heuristics."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(num_tokens):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def kvserve_prompt_logits(llm: kvserve.LLM, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position through the notes' KVCache loop."""
    c = llm.config
    caches = kvserve.KVCache.from_model_config(1, len(prompt), c.num_layers, c.num_kv_heads,
                                               c.head_dim, llm.dtype)
    return llm.model(torch.tensor([prompt]), caches)[0]


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype):
    ref = ref.float()
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err <= LOGIT_TOLERANCE[dtype], f"max relative logit error {err:.2e}"


def check_parity(path, dtype=torch.float32):
    ref = hf_model(path, dtype)
    llm = kvserve.LLM(path, dtype=dtype)
    for prompt in PROMPTS:
        with torch.no_grad():
            ref_logits = ref(torch.tensor([prompt])).logits[0]
        assert_logits_close(kvserve_prompt_logits(llm, prompt), ref_logits, dtype)
    if dtype != torch.float32:
        return
    params = kvserve.SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)  # one batch of mixed lengths
    for prompt, out in zip(PROMPTS, outputs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NUM_GREEDY_TOKENS)
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_fp32_logits_and_greedy_match_transformers(checkpoint_factory, architecture):
    check_parity(checkpoint_factory(architecture))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(checkpoint_factory, variant):
    architecture, overrides = VARIANTS[variant]
    check_parity(checkpoint_factory(architecture, **overrides))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_bf16_logits_within_tolerance(checkpoint_factory, architecture):
    check_parity(checkpoint_factory(architecture, dtype=torch.bfloat16), torch.bfloat16)


def test_fp16_logits_within_tolerance(checkpoint_factory):
    check_parity(checkpoint_factory("Qwen3ForCausalLM", dtype=torch.float16), torch.float16)


def test_bf16_greedy_starts_like_transformers(checkpoint_factory):
    """bf16 rounding differs op by op, so only the first tokens must agree."""
    path = checkpoint_factory("LlamaForCausalLM", dtype=torch.bfloat16)
    ref = hf_model(path, torch.bfloat16)
    llm = kvserve.LLM(path)  # dtype "auto" -> the checkpoint's bf16
    assert llm.dtype == torch.bfloat16
    params = kvserve.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert out.outputs[0].token_ids[:2] == hf_greedy(ref, prompt, 2)


def test_eos_and_stop_tokens_end_generation(checkpoint_factory, tmp_path):
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"))
    prompt = PROMPTS[2]
    free = llm.generate([prompt], kvserve.SamplingParams(temperature=0, max_tokens=30,
                                                         ignore_eos=True))[0].outputs[0].token_ids
    stop_at = free[6]
    out = llm.generate([prompt], kvserve.SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == free[:free.index(stop_at) + 1] and out.finish_reason == "stop"

    # A copy of the checkpoint whose EOS is a token the model produces greedily.
    eos = free[9]
    eos_dir = tmp_path / "eos"
    shutil.copytree(llm.model_dir, eos_dir)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((eos_dir / name).read_text())
        (eos_dir / name).write_text(json.dumps({**config, "eos_token_id": eos}))
    eos_llm = kvserve.LLM(eos_dir)
    out = eos_llm.generate([prompt], kvserve.SamplingParams(temperature=0, max_tokens=30))[0]
    assert out.outputs[0].token_ids == free[:free.index(eos) + 1]
    assert out.outputs[0].finish_reason == "stop"
    ignored = eos_llm.generate([prompt], kvserve.SamplingParams(temperature=0, max_tokens=30,
                                                                ignore_eos=True))[0]
    assert ignored.outputs[0].token_ids == free


def test_requests_must_fit_max_model_len(checkpoint_factory):
    """prompt + max_tokens may reach max_model_len, not exceed it (rejected when added)."""
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), max_model_len=16)
    fits = 16 - len(PROMPTS[0])
    out = llm.generate([PROMPTS[0]], kvserve.SamplingParams(temperature=0, max_tokens=fits,
                                                            ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == fits and out.finish_reason == "length"
    with pytest.raises(ValueError, match="exceeds max_model_len 16"):
        llm.generate([PROMPTS[0]], kvserve.SamplingParams(max_tokens=fits + 1))


def test_long_prompt_mlp_chunks_match_transformers(checkpoint_factory):
    """A prompt whose gate_up output passes the MLP's 16 MiB chunk (700 tokens x 2 x 4,096 fp32
    = 22 MiB) runs in chunks; its logits must not change."""
    path = checkpoint_factory("LlamaForCausalLM", intermediate_size=4096, num_hidden_layers=1,
                              max_position_embeddings=1024, initializer_range=0.05)
    prompt = [1] + [3 + (i * 37) % 380 for i in range(699)]
    with torch.no_grad():
        ref_logits = hf_model(path)(torch.tensor([prompt])).logits[0]
    assert_logits_close(kvserve_prompt_logits(kvserve.LLM(path), prompt), ref_logits, torch.float32)
