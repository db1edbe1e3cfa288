"""Models over an int8 / fp8 KV cache (LLM(kv_cache_dtype=...)) against transformers running the
same checkpoint with a cache that rounds each (token, head) row of K and V the same way before
attention reads it: prompt logits through the contiguous KVCache, and greedy continuations of a
mixed batch through the engine's paged pool. MLA (its latent rows have no transformers
counterpart) is checked against its other attention form and against the unquantized model;
prefix caching and copy-on-write give the tokens of cold runs."""

from __future__ import annotations

import pytest
import torch

import kvserve
from kvserve.testing import reference
from tests.models.test_parity import PROMPTS, hf_model

transformers = pytest.importorskip("transformers")

KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# Relative to the largest |logit|: the two sides round the same rows, but their K before
# rounding differs by fp32 summation order, which can move an entry across a rounding boundary.
LOGIT_TOLERANCE = 2e-3
# Against the unquantized model (relative logit error, tiny random models).
NEAR_PLAIN = {"int8": 0.03, "fp8": 0.15}
NUM_GREEDY_TOKENS = 16
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {}),
    "mistral-sliding-window": ("MistralForCausalLM", dict(sliding_window=8)),
    "gemma2-hybrid-softcap": ("Gemma2ForCausalLM", {}),
}


def fake_quantized(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q, scale = reference.quantize_kv_rows(x, dtype)
    return (q.float() * scale[..., None]).to(x.dtype)


def quantizing_cache(model, dtype):
    """A transformers DynamicCache that stores (and so attends over) K and V rounded row by row."""

    class QuantizingCache(transformers.DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(fake_quantized(key_states, dtype),
                                  fake_quantized(value_states, dtype), layer_idx, *args, **kwargs)

    return QuantizingCache(config=model.config)


def hf_logits(model, prompt, dtype):
    with torch.no_grad():
        return model(torch.tensor([prompt]), past_key_values=quantizing_cache(model, dtype),
                     use_cache=True).logits[0]


def hf_greedy(model, prompt, num_tokens, dtype):
    """Greedy decoding, one token per forward over the quantizing cache (as a server decodes)."""
    cache = quantizing_cache(model, dtype)
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(ids, past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(int(logits.argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


def prompt_logits(llm, prompt, dtype):
    caches = kvserve.KVCache.for_model(1, len(prompt), llm.config, dtype)
    return llm.model(torch.tensor([prompt]), caches)[0]


def relative_error(ours, ref):
    return ((ours - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_matches_transformers_over_the_same_rounding(checkpoint_factory, name, kv):
    architecture, overrides = ARCHITECTURES[name]
    path = checkpoint_factory(architecture, **overrides)
    ref, dtype = hf_model(path), KV_DTYPES[kv]
    llm = kvserve.LLM(path, dtype="float32", kv_cache_dtype=kv)
    assert llm.llm_engine.engine.kv_cache.dtype == dtype
    for prompt in PROMPTS:
        err = relative_error(prompt_logits(llm, prompt, dtype), hf_logits(ref, prompt, dtype))
        assert err <= LOGIT_TOLERANCE, f"max relative logit error {err:.2e}"
    params = kvserve.SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NUM_GREEDY_TOKENS, dtype)


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_rounding_changes_the_logits_a_little(checkpoint_factory, kv):
    """The quantized cache is really used (logits move) and stays near the unquantized model."""
    path = checkpoint_factory("LlamaForCausalLM")
    llm = kvserve.LLM(path, dtype="float32")
    plain = prompt_logits(llm, PROMPTS[2], torch.float32)
    quantized = prompt_logits(llm, PROMPTS[2], KV_DTYPES[kv])
    assert 1e-5 < relative_error(quantized, plain) < NEAR_PLAIN[kv]


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("architecture", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_mla_latents(checkpoint_factory, monkeypatch, architecture, kv):
    """One quantized latent per token: the absorbed form (the kernel dequantizes) and the expanded
    form (the layer dequantizes the gathered blocks) agree, and stay near the unquantized run."""
    # Dense layers only: a routed expert flips on a near tie, which would hide what is measured.
    path = checkpoint_factory(architecture, first_k_dense_replace=8)
    params = kvserve.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = {}
    for attention_path in ("absorbed", "expanded"):
        monkeypatch.setenv("KVSERVE_MLA_ATTENTION", attention_path)
        llm = kvserve.LLM(path, dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=32)
        assert llm.llm_engine.engine.kv_cache.key_scales[0].shape[2] == 1
        runs[attention_path] = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(runs["absorbed"], runs["expanded"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
    monkeypatch.delenv("KVSERVE_MLA_ATTENTION")
    llm = kvserve.LLM(path, dtype="float32")
    plain = prompt_logits(llm, PROMPTS[2], torch.float32)
    assert relative_error(prompt_logits(llm, PROMPTS[2], KV_DTYPES[kv]), plain) < NEAR_PLAIN[kv]


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_prefix_cache_and_copy_on_write_give_cold_tokens(checkpoint_factory, kv):
    """Shared prompt blocks (prefix hits) and forked samples (copy-on-write of the last partial
    block, its scales included) give the tokens of runs that share nothing."""
    path = checkpoint_factory("LlamaForCausalLM")
    prefix = list(range(3, 40))
    prompts = [prefix + [50, 51], prefix + [60], prefix + [70, 71, 72]]
    sampled = kvserve.SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=10, ignore_eos=True)
    greedy = kvserve.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    shared = kvserve.LLM(path, dtype="float32", kv_cache_dtype=kv, block_size=8)
    cold = kvserve.LLM(path, dtype="float32", kv_cache_dtype=kv, block_size=8,
                       enable_prefix_caching=False)
    for params in (greedy, sampled):
        shared.generate(prompts[:1], params, use_tqdm=False)  # fills the prefix cache
        hot = shared.generate(prompts, params, use_tqdm=False)
        want = [cold.generate([p], params, use_tqdm=False)[0] for p in prompts]
        for h, w in zip(hot, want):
            assert [o.token_ids for o in h.outputs] == [o.token_ids for o in w.outputs]
    assert shared.llm_engine.get_stats().prefix_cache_hits > 0


def test_quantized_pool_holds_more_tokens(checkpoint_factory):
    """Same memory, int8 entries and their scales: ~2x the tokens of bf16, 4x fp32's (less the
    scales); the memory plan says so."""
    path = checkpoint_factory("LlamaForCausalLM")
    budget = 4 << 20
    capacity = {}
    for kv in ("auto", "int8", "fp8"):
        llm = kvserve.LLM(path, dtype="float32", kv_cache_dtype=kv, kv_cache_memory=budget)
        capacity[kv] = llm.llm_engine.engine.kv_cache.capacity_tokens
    c = kvserve.LLM(path, dtype="float32").config
    head_dim = c.head_dim
    expected = 4 * head_dim / (head_dim + 4)  # fp32 entries vs int8 entries + an fp32 scale
    assert capacity["int8"] / capacity["auto"] == pytest.approx(expected, rel=0.02)
    assert capacity["fp8"] == capacity["int8"]
    plan = kvserve.LLM(path, dtype="float32", kv_cache_dtype="int8").llm_engine.memory_plan()
    assert "int8 entries with a fp32 scale per token and head" in plan


@pytest.mark.parametrize("value, message", [
    ("int4", "kv_cache_dtype must be one of auto, int8, fp8"),
    (torch.float16, "kv_cache_dtype torch.float16 is not supported"),
])
def test_bad_kv_cache_dtype(checkpoint_factory, value, message):
    with pytest.raises(ValueError, match=message):
        kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), dtype="float32", kv_cache_dtype=value)
