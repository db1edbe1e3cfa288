"""The contiguous KVCache and its simple generation loop that uses it."""

from __future__ import annotations

import pytest
import torch

import kvserve


def caches_for(llm: kvserve.LLM, batch: int, length: int):
    c = llm.config
    return kvserve.KVCache.from_model_config(max_batch_size=batch, max_seq_len=length,
                                             num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                                             head_dim=c.head_dim, dtype=llm.dtype)


def test_shapes_and_bookkeeping():
    cache = kvserve.KVCache(max_batch_size=3, max_seq_len=17, num_kv_heads=2, head_dim=24,
                            dtype=torch.bfloat16)
    assert cache.key.shape == cache.value.shape == (3, 17, 2, 24)
    assert cache.key.dtype == torch.bfloat16 and cache.key.data_ptr() != cache.value.data_ptr()
    assert cache.nbytes == 2 * 3 * 17 * 2 * 24 * 2
    assert cache.seq_lens == [0, 0, 0]
    cache.advance(1, 5)
    cache.advance(1, 12)
    assert cache.seq_lens == [0, 17, 0] and cache.seq_len(1) == 17
    with pytest.raises(IndexError, match="max_seq_len is 17"):
        cache.advance(1, 1)
    cache.reset()
    assert cache.seq_lens == [0, 0, 0]


def test_from_model_config_returns_one_cache_per_layer():
    caches = kvserve.KVCache.from_model_config(max_batch_size=1, max_seq_len=8, num_layers=5,
                                               num_kv_heads=4, head_dim=16)
    assert len(caches) == 5
    assert len({c.key.data_ptr() for c in caches}) == 5
    assert all(c.key.dtype == torch.float32 for c in caches)


@pytest.mark.parametrize("args", [(0, 8, 2, 16), (1, 0, 2, 16), (1, 8, 0, 16), (1, 8, 2, -1)])
def test_rejects_non_positive_sizes(args):
    with pytest.raises(ValueError, match="must all be positive"):
        kvserve.KVCache(*args)


def test_simple_loop_matches_generate(checkpoint_factory):
    """The simple loop: prefill the prompt, then feed one token at a time."""
    llm = kvserve.LLM(checkpoint_factory("Qwen3ForCausalLM"))
    prompt = [1, 17, 18, 19, 99, 120]
    caches = caches_for(llm, batch=1, length=64)
    input_ids = torch.tensor([prompt])
    generated = []
    for _ in range(20):
        logits = llm.model(input_ids, kv_caches=caches)  # caches advance in place
        next_token = logits[:, -1, :].argmax(dim=-1, keepdim=True)
        generated.append(next_token.item())
        input_ids = next_token
    assert caches[0].seq_len(0) == len(prompt) + 19
    params = kvserve.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert generated == llm.generate([prompt], params)[0].outputs[0].token_ids

    kvserve.reset_all_caches(caches)
    assert all(c.seq_lens == [0] for c in caches)
    again = llm.model(torch.tensor([prompt]), kv_caches=caches)[:, -1].argmax().item()
    assert again == generated[0]


def test_batched_rows_are_independent(checkpoint_factory):
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"))
    a, b = [1, 5, 6, 7], [1, 200, 201, 202]
    batched = llm.model(torch.tensor([a, b]), kv_caches=caches_for(llm, 2, 8))
    alone = llm.model(torch.tensor([b]), kv_caches=caches_for(llm, 1, 8))
    torch.testing.assert_close(batched[1], alone[0], rtol=1e-5, atol=1e-5)


def test_overflow_and_batch_errors(checkpoint_factory):
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"))
    caches = caches_for(llm, batch=1, length=4)
    with pytest.raises(IndexError, match="exceed max_seq_len"):
        llm.model(torch.tensor([[1, 2, 3, 4, 5]]), kv_caches=caches)
    with pytest.raises(ValueError, match="exceeds max_batch_size"):
        llm.model(torch.tensor([[1], [2]]), kv_caches=caches)
    with pytest.raises(ValueError, match="one KVCache per layer"):
        llm.model(torch.tensor([[1]]), kv_caches=caches[:1])
    assert caches[0].seq_lens == [0]  # failed calls leave the cache untouched
    llm.model(torch.tensor([[1, 2, 3, 4]]), kv_caches=caches)
    assert caches[0].seq_lens == [4]
