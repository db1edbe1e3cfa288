"""PagedKVCache: sizing, block copies, and the model's forward over scattered blocks, which must
equal the contiguous KVCache path exactly."""

from __future__ import annotations

import pytest
import torch

import kvserve
from kvserve import _C


def test_shapes_capacity_and_bytes():
    cache = _C.PagedKVCache(num_layers=3, num_blocks=10, block_size=16, num_kv_heads=2,
                            head_dim=24, dtype=torch.bfloat16)
    assert len(cache.key_caches) == len(cache.value_caches) == 3
    assert all(k.shape == (10, 16, 2, 24) and k.dtype == torch.bfloat16 for k in cache.key_caches)
    assert len({t.data_ptr() for t in cache.key_caches + cache.value_caches}) == 6
    assert cache.capacity_tokens == 9 * 16  # block 0 is the null block
    assert cache.bytes_per_token == 2 * 3 * 2 * 24 * 2
    assert cache.nbytes == cache.bytes_per_token * 10 * 16
    assert _C.PagedKVCache.bytes_per_block(3, 16, 2, 24, torch.bfloat16) == cache.bytes_per_token * 16
    assert "capacity_tokens=144" in repr(cache)


def test_from_memory_fits_the_budget():
    per_block = _C.PagedKVCache.bytes_per_block(2, 8, 4, 32, torch.float32)
    cache = _C.PagedKVCache.from_memory(per_block * 7 + per_block - 1, num_layers=2, block_size=8,
                                        num_kv_heads=4, head_dim=32)
    assert cache.num_blocks == 7 and cache.nbytes <= per_block * 8
    with pytest.raises(ValueError, match="at least 2 are needed"):
        _C.PagedKVCache.from_memory(per_block, 2, 8, 4, 32)


@pytest.mark.parametrize("args", [(0, 4, 16, 2, 8), (1, 1, 16, 2, 8), (1, 4, 0, 2, 8),
                                  (1, 4, 16, 0, 8), (1, 4, 16, 2, 0)])
def test_rejects_bad_sizes(args):
    with pytest.raises(ValueError):
        _C.PagedKVCache(*args)


def test_copy_blocks_moves_every_layer():
    cache = _C.PagedKVCache(2, 6, 4, 1, 8)
    for i, t in enumerate(cache.key_caches + cache.value_caches):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t) + 1000 * i)
    before = [t.clone() for t in cache.key_caches + cache.value_caches]
    cache.copy_blocks([(1, 4), (2, 5)])
    for t, old in zip(cache.key_caches + cache.value_caches, before):
        assert t[4].equal(old[1]) and t[5].equal(old[2]) and t[:4].equal(old[:4])
    with pytest.raises(RuntimeError, match="outside the pool"):
        cache.copy_blocks([(1, 6)])


def latent_layout(num_layers=3, kv_lora_rank=32, rope=8):
    layout = _C.KVCacheLayout()
    layout.num_layers, layout.num_kv_heads = num_layers, 1
    layout.head_dim, layout.value_head_dim, layout.latent = kv_lora_rank + rope, kv_lora_rank, True
    return layout


def test_a_latent_layout_allocates_one_tensor_per_layer():
    """MLA: the latent is both key and value; the pool and its bytes count it once."""
    cache = _C.PagedKVCache(latent_layout(), num_blocks=10, block_size=16)
    assert cache.layout.latent and cache.num_kv_heads == 1 and cache.head_dim == 40
    assert all(k.shape == (10, 16, 1, 40) for k in cache.key_caches)
    assert [k.data_ptr() for k in cache.key_caches] == [v.data_ptr() for v in cache.value_caches]
    assert len({k.data_ptr() for k in cache.key_caches}) == 3
    assert cache.bytes_per_token == 3 * 40 * 4
    assert cache.nbytes == 3 * 10 * 16 * 40 * 4 == sum(k.nbytes for k in cache.key_caches)
    assert _C.PagedKVCache.bytes_per_block(latent_layout(), 16) == 16 * cache.bytes_per_token
    for i, key in enumerate(cache.key_caches):
        key.copy_(torch.arange(key.numel(), dtype=torch.float32).view_as(key) + 1000 * i)
    before = [k.clone() for k in cache.key_caches]
    cache.copy_blocks([(1, 4), (2, 5)])
    for key, old in zip(cache.key_caches, before):
        assert key[4].equal(old[1]) and key[5].equal(old[2]) and key[:4].equal(old[:4])


@pytest.mark.parametrize("change", [dict(num_kv_heads=2), dict(value_head_dim=41),
                                    dict(num_layers=0)])
def test_rejects_bad_latent_layouts(change):
    layout = latent_layout()
    for name, value in change.items():
        setattr(layout, name, value)
    with pytest.raises(ValueError, match="layout"):
        _C.PagedKVCache(layout, 4, 16)


def test_kv_cache_write_of_a_latent_writes_the_entry_once():
    cache = torch.full((3, 4, 1, 6), float("nan"))
    entries = torch.arange(12.0).view(2, 1, 6)
    torch.ops.kvserve.kv_cache_write(entries, torch.full_like(entries, -1.0), cache, cache,
                                     torch.tensor([5, 0]))
    assert cache[1, 1, 0].equal(entries[0, 0]) and cache[0, 0, 0].equal(entries[1, 0])
    assert cache.isnan().sum() == cache.numel() - 12  # the value argument is not written


def run_paged(llm, cache, sequences, block_tables):
    """One forward of several sequences' new tokens; returns each sequence's last-token logits.

    sequences: list of (new_tokens, num_cached)."""
    builder = _C.ForwardBatchBuilder(cache.block_size)
    for (tokens, num_cached), table in zip(sequences, block_tables):
        builder.add(tokens, num_cached, table)
    batch = builder.build()
    hidden = llm.model.forward(batch.input_ids, batch.positions, batch.metadata, cache)
    return llm.model.compute_logits(hidden[batch.logits_indices])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_forward_over_scattered_blocks_equals_contiguous(checkpoint_factory, block_size):
    """Two prompts prefilled together into shuffled blocks, then decoded token by token (a decode
    batch mixed with a prefill chunk at one step), against the contiguous KVCache loop."""
    llm = kvserve.LLM(checkpoint_factory("Qwen2ForCausalLM"), dtype="float32")
    c = llm.config
    prompts = [[1, 5, 9, 200, 31, 7, 8, 9, 10, 11, 12], [1, 77, 78, 79, 80]]
    max_len = 40
    blocks_per_seq = -(-max_len // block_size)
    num_blocks = 2 * blocks_per_seq + 1
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(block_size)) + 1
    tables = [order[:blocks_per_seq].tolist(), order[blocks_per_seq:].tolist()]
    cache = _C.PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)
    for t in cache.key_caches + cache.value_caches:
        t.fill_(float("nan"))  # block 0 and unwritten slots must never be read

    # Reference: the contiguous cache, one row per sequence, prompts fed separately.
    expected = []
    for prompt in prompts:
        caches = kvserve.KVCache.from_model_config(1, max_len, c.num_layers, c.num_kv_heads,
                                                   c.head_dim)
        seq, logits = list(prompt), []
        step_logits = llm.model(torch.tensor([seq]), caches)[0, -1]
        for _ in range(12):
            logits.append(step_logits)
            seq.append(int(step_logits.argmax()))
            step_logits = llm.model(torch.tensor([[seq[-1]]]), caches)[0, -1]
        expected.append((seq, logits))

    # Paged: sequence 0 prefills in two chunks while sequence 1 prefills and starts decoding.
    seqs = [list(prompts[0]), list(prompts[1])]
    cached = [0, 0]
    step = 0
    got = [[], []]
    first_chunk = 6
    out = run_paged(llm, cache, [(seqs[0][:first_chunk], 0), (seqs[1], 0)], tables)
    cached = [first_chunk, len(seqs[1])]
    got[1].append(out[1])
    seqs[1].append(int(out[1].argmax()))
    while len(got[0]) < 12 or len(got[1]) < 12:
        step += 1
        pending = [(seqs[i][cached[i]:], cached[i]) for i in range(2)]
        out = run_paged(llm, cache, pending, tables)
        for i in range(2):
            cached[i] = len(seqs[i])
            if len(got[i]) < 12:
                got[i].append(out[i])
                seqs[i].append(int(out[i].argmax()))
    for i in range(2):
        assert seqs[i][:len(expected[i][0])] == expected[i][0]
        torch.testing.assert_close(torch.stack(got[i]), torch.stack(expected[i][1]),
                                   rtol=1e-5, atol=1e-5)
    assert cache.key_caches[0][0].isnan().all(), "the null block is never written"
