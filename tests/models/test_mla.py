"""Multi-head latent attention: the absorbed form (MQA over cached latents, W_UK and W_UV folded
into query and output) equals the expanded form on the same cache, in the kernels and in whole
models; the paged cache of an MLA model holds only latents."""

from __future__ import annotations

import math

import pytest
import torch

import kvserve
from kvserve.testing import reference

ops = torch.ops.kvserve


def latent_batch(seqs, kv_lora_rank, rope, block_size, seed=0):
    """A latent cache [num_blocks, block_size, 1, kv_lora_rank + rope] holding the contexts of
    `seqs` ((context, query_len) each) in shuffled blocks, everything else NaN."""
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(context / block_size) for context, _ in seqs]
    num_blocks = 1 + sum(blocks)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    cache = torch.full((num_blocks, block_size, 1, kv_lora_rank + rope), float("nan"))
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    latents = []
    for b, (context, _) in enumerate(seqs):
        table = [free.pop() for _ in range(blocks[b])]
        tables[b, :len(table)] = torch.tensor(table, dtype=torch.int32)
        rows = torch.randn(context, kv_lora_rank + rope, generator=g)
        for p in range(context):
            cache[table[p // block_size], p % block_size, 0] = rows[p]
        latents.append(rows)
    qsl = torch.tensor([0] + [q for _, q in seqs]).cumsum(0).int()
    lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    return cache, tables, qsl, lens, latents, g


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads, nope, rope, v, kv_lora_rank", [(4, 16, 8, 16, 32),
                                                                 (16, 24, 8, 20, 48),
                                                                 (3, 8, 4, 12, 40)])
def test_absorbed_form_equals_expanded_attention(heads, nope, rope, v, kv_lora_rank, block_size):
    """q W_UK over latents, softmax, then W_UV: the expanded attention of transformers' MLA."""
    seqs = [(1, 1), (37, 1), (70, 1), (20, 5), (9, 9)]
    cache, tables, qsl, lens, latents, g = latent_batch(seqs, kv_lora_rank, rope, block_size)
    kv_b = torch.randn(heads * (nope + v), kv_lora_rank, generator=g) / kv_lora_rank ** 0.5
    w_uk = kv_b.view(heads, nope + v, kv_lora_rank)[:, :nope]            # [H, nope, L]
    w_uv = kv_b.view(heads, nope + v, kv_lora_rank)[:, nope:]            # [H, v, L]
    tokens = int(qsl[-1])
    q_nope = torch.randn(tokens, heads, nope, generator=g)
    q_rope = torch.randn(tokens, heads, rope, generator=g)
    scale = (nope + rope) ** -0.5
    query = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), q_rope], dim=-1)
    latent_out = torch.empty(tokens, heads, kv_lora_rank)
    ops.paged_attention(latent_out, query.contiguous(), cache, cache, qsl, lens, tables, scale, 0,
                        0.0)
    out = torch.einsum("thl,hvl->thv", latent_out, w_uv)
    for b, (context, q) in enumerate(seqs):
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        want = reference.mla_attention(q_nope[rows], q_rope[rows], latents[b], kv_b, scale,
                                       kv_lora_rank)
        torch.testing.assert_close(out[rows].double(), want, atol=2e-5, rtol=2e-5)


PROMPTS = [[1, 5, 9, 200, 31, 7, 8, 9, 10, 11, 12], [1, 77],
           [1] + list(range(3, 60)), [1, 250, 251, 13, 14, 15, 16]]


def llm_with_path(path, monkeypatch, attention_path, **kwargs):
    monkeypatch.setenv("KVSERVE_MLA_ATTENTION", attention_path)
    return kvserve.LLM(path, dtype="float32", log_memory_plan=False, **kwargs)


@pytest.mark.parametrize("architecture", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_absorbed_expanded_and_auto_agree_in_the_engine(checkpoint_factory, monkeypatch,
                                                       architecture):
    """Every decode step and prefill of a mixed batch through each form: logits of the prompt
    within fp32 rounding, and the same greedy tokens (auto mixes both forms in one step)."""
    path = checkpoint_factory(architecture)
    params = kvserve.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    results = {}
    for attention_path in ("absorbed", "expanded", "auto"):
        llm = llm_with_path(path, monkeypatch, attention_path, max_num_batched_tokens=32)
        assert llm.config.mla.attention_path == attention_path
        results[attention_path] = llm.generate(PROMPTS, params, use_tqdm=False)
    for attention_path in ("expanded", "auto"):
        for a, b in zip(results["absorbed"], results[attention_path]):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)


def test_the_paged_cache_holds_only_latents(checkpoint_factory):
    path = checkpoint_factory("DeepseekV2ForCausalLM")
    llm = kvserve.LLM(path, dtype="float32", log_memory_plan=False)
    c = llm.config
    kv = llm.kv_cache
    latent = c.mla.kv_lora_rank + c.mla.qk_rope_head_dim
    assert kv.layout.latent and kv.num_kv_heads == 1 and kv.head_dim == latent
    assert kv.bytes_per_token == c.num_layers * latent * 4
    assert kv.nbytes == kv.num_blocks * kv.block_size * kv.bytes_per_token
    for key, value in zip(kv.key_caches, kv.value_caches):
        assert key.data_ptr() == value.data_ptr() and key.shape[-2:] == (1, latent)
    plain = kvserve._C.KVCacheLayout.multi_head_equivalent(c).bytes_per_token(torch.float32)
    assert plain == c.num_layers * c.num_heads * (c.mla.qk_head_dim + c.mla.v_head_dim) * 4
    assert f"{plain:,} bytes/token" in llm.llm_engine.memory_plan()


def test_attention_path_must_be_known(checkpoint_factory, monkeypatch):
    monkeypatch.setenv("KVSERVE_MLA_ATTENTION", "sideways")
    with pytest.raises(ValueError, match="KVSERVE_MLA_ATTENTION must be auto, absorbed or"):
        kvserve.LLM(checkpoint_factory("DeepseekV2ForCausalLM"), dtype="float32")
