"""kv_cache_copy_blocks against kvserve.testing.reference: copies are exact, every layer's key and
value caches move together, blocks outside the mapping (NaN-poisoned) stay untouched, and bad
mappings raise."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference

ops = torch.ops.kvserve


def layer_caches(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
    """Random blocks, with the even blocks >= 2 poisoned with NaN to show that they stay as they
    are unless a pair names them."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(2 * num_layers)]
    for cache in caches:
        cache[2::2] = float("nan")
    return caches[:num_layers], caches[num_layers:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size, num_kv_heads, head_dim", [(1, 1, 64), (8, 2, 80), (16, 4, 128), (32, 1, 24)])
def test_matches_reference(dtype, block_size, num_kv_heads, head_dim):
    keys, values = layer_caches(3, 12, block_size, num_kv_heads, head_dim, dtype)
    mapping = torch.tensor([[1, 4], [3, 2], [1, 7], [0, 9]])
    want_keys, want_values = reference.kv_cache_copy_blocks(keys, values, mapping)
    ops.kv_cache_copy_blocks(keys, values, mapping)
    for got, want in zip(keys + values, want_keys + want_values):
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
    assert keys[0][4].equal(keys[0][1]) and not keys[0][6].isnan().logical_not().any()


def test_empty_mapping_is_a_no_op():
    keys, values = layer_caches(1, 4, 4, 1, 8, torch.float32)
    before = [k.clone() for k in keys]
    ops.kv_cache_copy_blocks(keys, values, torch.zeros(0, 2, dtype=torch.long))
    torch.testing.assert_close(keys[0], before[0], equal_nan=True)


@pytest.mark.cpu_only  # the CUDA op checks a host mapping; CudaOps moves it to the GPU
@pytest.mark.parametrize("mapping, message", [
    ([[1, 12]], "outside the pool"),
    ([[-1, 2]], "outside the pool"),
    ([[1, 2], [3, 2]], "destination twice"),
    ([[1, 2], [2, 3]], "both a source and a destination"),
])
def test_bad_mappings_raise(mapping, message):
    keys, values = layer_caches(2, 12, 4, 1, 8, torch.float32)
    with pytest.raises(RuntimeError, match=message):
        ops.kv_cache_copy_blocks(keys, values, torch.tensor(mapping))


def test_mismatched_caches_raise():
    keys, values = layer_caches(2, 12, 4, 1, 8, torch.float32)
    with pytest.raises(RuntimeError, match="one value cache per layer or none"):
        ops.kv_cache_copy_blocks(keys, values[:1], torch.tensor([[1, 2]]))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.kv_cache_copy_blocks([keys[0], keys[1][:6]], values, torch.tensor([[1, 2]]))
    with pytest.raises(RuntimeError, match="block_mapping"):
        ops.kv_cache_copy_blocks(keys, values, torch.tensor([1, 2]))


def test_latent_caches_have_no_values():
    """MLA layers pass their latent caches as keys and no values: each block is copied once."""
    keys, _ = layer_caches(3, 12, 4, 1, 40, torch.bfloat16)
    mapping = torch.tensor([[1, 5], [7, 2]])
    want, _ = reference.kv_cache_copy_blocks(keys, [], mapping)
    ops.kv_cache_copy_blocks(keys, [], mapping)
    for got, expected in zip(keys, want):
        torch.testing.assert_close(got, expected, equal_nan=True)
