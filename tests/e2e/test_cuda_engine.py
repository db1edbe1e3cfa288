"""The engine on a CUDA GPU (skipped without one): parity with transformers, and the engine's
invariants (batching, prefix caching, chunked prefill, quantized KV, speculation) on the GPU
against the same engine on the CPU."""

from __future__ import annotations

import pytest
import torch

import kvserve
from tests.conftest import ARCHITECTURES
from tests.models.test_parity import PROMPTS, check_parity

pytestmark = pytest.mark.cuda

GREEDY = kvserve.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_fp32_logits_and_greedy_match_transformers(checkpoint_factory, architecture):
    check_parity(checkpoint_factory(architecture), device="cuda")


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM",
                                          "Gemma2ForCausalLM", "DeepseekV2ForCausalLM"])
def test_bf16_logits_within_tolerance(checkpoint_factory, architecture):
    check_parity(checkpoint_factory(architecture, dtype=torch.bfloat16), torch.bfloat16,
                 device="cuda")


def test_weights_and_kv_pool_live_on_the_gpu(checkpoint_factory):
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), device="cuda")
    assert llm.model.device.type == "cuda"
    assert torch.cuda.memory_allocated() > 0


@pytest.mark.parametrize("engine_args", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=8),  # chunked prefill
    dict(max_num_seqs=1),            # one sequence at a time
    dict(block_size=1),
], ids=["default", "no-prefix-cache", "chunked-prefill", "one-at-a-time", "block-size-1"])
def test_gpu_engine_equals_cpu_engine(checkpoint_factory, engine_args):
    path = checkpoint_factory("LlamaForCausalLM")
    want = tokens(kvserve.LLM(path, **engine_args))
    got = tokens(kvserve.LLM(path, device="cuda", **engine_args))
    assert got == want


@pytest.mark.parametrize("architecture, overrides", [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", dict(head_dim=64)),  # the row kernel of paged_attention
    ("Qwen3ForCausalLM", {}),
    ("Gemma2ForCausalLM", {}),                # sliding-window layers: two groups of tables
    ("Qwen3MoeForCausalLM", {}),              # fused_moe's pointer tables, kept on the GPU
    ("MixtralForCausalLM", {}),
    ("DeepseekV2ForCausalLM", {}),            # latent attention: decode steps all absorbed
    ("DeepseekV3ForCausalLM", {}),
], ids=["llama", "llama-head-dim-64", "qwen3", "gemma2", "qwen3-moe", "mixtral", "deepseek-v2",
        "deepseek-v3"])
def test_cuda_graphs_equal_eager_steps_and_the_cpu(checkpoint_factory, architecture, overrides):
    """Decode steps replayed from CUDA graphs give the tokens of eager steps and of the CPU
    engine, while requests finish at different steps (5, 4, ... 1 sequences: graphs of 8, 4, 2
    and 1 rows, padded)."""
    path = checkpoint_factory(architecture, **overrides)
    prompts = (PROMPTS * 2)[:5]
    params = [kvserve.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (3, 9, 17, 24, 30)]
    eager_llm = kvserve.LLM(path, device="cuda", enforce_eager=True)
    graph_llm = kvserve.LLM(path, device="cuda", enforce_eager=False)
    eager = tokens(eager_llm, prompts, params)
    replayed = tokens(graph_llm, prompts, params)
    assert replayed == eager
    assert replayed == tokens(kvserve.LLM(path), prompts, params)
    assert eager_llm.llm_engine.engine.get_stats().num_cuda_graph_steps == 0
    stats = graph_llm.llm_engine.engine.get_stats()
    assert 0 < stats.num_cuda_graph_steps < stats.num_steps  # prefills run eagerly


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_lora_adapters_equal_their_merged_models(checkpoint_factory, tmp_path, enforce_eager):
    """Requests for two adapters and for none in one batch (ops::lora_add on the GPU, replayed in
    decode graphs too) give the tokens of each merged model on the CPU."""
    from tests.models.test_lora import make_adapter

    base = checkpoint_factory("LlamaForCausalLM")
    loras = []
    for i, targets in enumerate([["q_proj", "v_proj"], "all-linear"]):
        make_adapter(base, tmp_path / f"a{i}", seed=i, r=4, lora_alpha=8, target_modules=targets)
        kvserve.merge_lora(base, tmp_path / f"a{i}", tmp_path / f"m{i}")
        loras.append(kvserve.LoRARequest(f"a{i}", tmp_path / f"a{i}"))
    llm = kvserve.LLM(base, device="cuda", enable_lora=True, max_loras=2, max_lora_rank=4,
                      enforce_eager=enforce_eager)
    prompts = PROMPTS[:3]
    got = [o.outputs[0].token_ids
           for o in llm.generate(prompts, GREEDY, lora=[loras[0], None, loras[1]])]
    assert got[0] == tokens(kvserve.LLM(tmp_path / "m0"), prompts[:1])[0]
    assert got[1] == tokens(kvserve.LLM(base), prompts[1:2])[0]
    assert got[2] == tokens(kvserve.LLM(tmp_path / "m1"), prompts[2:3])[0]


def test_models_without_graph_support_decode_eagerly(checkpoint_factory, monkeypatch):
    """Latent attention forced to its expanded form (a per-batch gather of blocks) is never
    captured."""
    monkeypatch.setenv("KVSERVE_MLA_ATTENTION", "expanded")
    llm = kvserve.LLM(checkpoint_factory("DeepseekV2ForCausalLM"), device="cuda",
                      enforce_eager=False)
    assert tokens(llm) == tokens(kvserve.LLM(checkpoint_factory("DeepseekV2ForCausalLM")))
    assert llm.llm_engine.engine.get_stats().num_cuda_graph_steps == 0


def test_shared_prefixes_and_repeats(checkpoint_factory):
    """Prompts sharing a prefix (prefix cache hits, copy-on-write of a partial block)."""
    path = checkpoint_factory("Qwen3ForCausalLM")
    base = PROMPTS[2]
    prompts = [base, base + [5, 6], base[:9], base + [7], base]
    assert tokens(kvserve.LLM(path, device="cuda", block_size=4), prompts) == \
        tokens(kvserve.LLM(path, block_size=4), prompts)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_cache(checkpoint_factory, kv_cache_dtype):
    path = checkpoint_factory("LlamaForCausalLM")
    want = tokens(kvserve.LLM(path, kv_cache_dtype=kv_cache_dtype))
    got = tokens(kvserve.LLM(path, device="cuda", kv_cache_dtype=kv_cache_dtype))
    agree = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    assert agree >= 0.9 * sum(map(len, want)), (got, want)


def test_ngram_speculation_keeps_greedy_output(checkpoint_factory):
    path = checkpoint_factory("LlamaForCausalLM")
    plain = tokens(kvserve.LLM(path, device="cuda"))
    speculative = tokens(kvserve.LLM(path, device="cuda", speculative_method="ngram",
                                     num_speculative_tokens=3))
    assert speculative == plain


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Gemma2ForCausalLM",
                                          "DeepseekV2ForCausalLM"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_async_scheduling_equals_synchronous_steps(checkpoint_factory, architecture,
                                                   enforce_eager):
    """Each step launched before the last one's samples reach the host, fed them on the device
    (through a graph's inputs too): the synchronous steps' tokens and logprobs, greedy and
    seeded, while requests finish at different steps."""
    path = checkpoint_factory(architecture)
    prompts = (PROMPTS * 2)[:5]
    params = [kvserve.SamplingParams(temperature=t, seed=3, max_tokens=n, ignore_eos=True,
                                     logprobs=2)
              for t, n in zip((0, 0.9, 0, 0.9, 0), (3, 9, 17, 24, 30))]

    def run(llm):
        return [(o.outputs[0].token_ids, [(x.token_id, round(x.logprob, 3), x.rank)
                                          for x in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params)]

    sync = kvserve.LLM(path, device="cuda", enforce_eager=enforce_eager)
    launched = kvserve.LLM(path, device="cuda", enforce_eager=enforce_eager,
                           async_scheduling=True)
    assert run(launched) == run(sync)
    stats = launched.llm_engine.engine.get_stats()
    assert stats.num_async_steps == stats.num_steps
    assert (stats.num_cuda_graph_steps > 0) != enforce_eager


def test_seeded_sampling_is_reproducible(checkpoint_factory):
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), device="cuda")
    params = kvserve.SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=16,
                                    ignore_eos=True)
    assert tokens(llm, params=params) == tokens(llm, params=params)


def test_bad_device_is_a_clear_error(checkpoint_factory):
    with pytest.raises(ValueError, match="GPUs"):
        kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), device="cuda:99")
