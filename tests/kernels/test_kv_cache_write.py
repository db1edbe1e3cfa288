"""kv_cache_write against kvserve.testing.reference. A write is a copy, so results must be exact
(no tolerance table): every written slot equals its token, and every other slot keeps the NaN it
was poisoned with. The op has a single CPU body (a memcpy per row, no per-capability variants),
so unlike the other kernel tests this file has no CPU-capability test."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference

ops = torch.ops.kvserve

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCK_SIZES = [1, 8, 16, 32]
# (num_heads, num_kv_heads, head_dim): the caches hold only the kv heads
SHAPES = [(4, 4, 64), (8, 2, 80), (8, 1, 96), (4, 2, 128), (2, 1, 256), (6, 3, 24), (4, 4, 40)]


def poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype),
            torch.full(shape, float("nan"), dtype=dtype))


def fused_kv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """Key and value as column views of a fused qkv [T, num_heads + 2 * num_kv_heads, head_dim]:
    strided rows, contiguous heads."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    return qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]


def random_slots(num_tokens, num_slots, num_padding, seed=0):
    """Distinct random slots (block 0 included) with num_padding tokens marked -1."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g)[:num_padding]] = -1
    return slots


def assert_same(actual, expected):
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES)
def test_kv_cache_write(num_heads, num_kv_heads, head_dim, block_size, dtype):
    num_blocks, num_tokens = 40 // block_size + 3, 29
    key, value = fused_kv(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    assert not key.is_contiguous()
    key_cache, value_cache = poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    slots = random_slots(num_tokens, num_blocks * block_size, num_padding=4)
    want_key, want_value = reference.kv_cache_write(key, value, key_cache, value_cache, slots)
    ops.kv_cache_write(key, value, key_cache, value_cache, slots)
    assert_same(key_cache, want_key)
    assert_same(value_cache, want_value)
    assert key_cache.isnan().any(), "the test must leave unwritten slots"
    written = key_cache.view(-1, num_kv_heads, head_dim)[slots[slots >= 0]]
    assert not written.isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_inputs_and_last_slot(dtype):
    key, value = torch.randn(3, 2, 16).to(dtype), torch.randn(3, 2, 16).to(dtype)
    key_cache, value_cache = poisoned_caches(4, 8, 2, 16, dtype)
    slots = torch.tensor([31, 0, -1])  # the last and the first slot of the cache, and padding
    want_key, want_value = reference.kv_cache_write(key, value, key_cache, value_cache, slots)
    ops.kv_cache_write(key, value, key_cache, value_cache, slots)
    assert_same(key_cache, want_key)
    assert_same(value_cache, want_value)
    assert torch.equal(key_cache[3, 7], key[0]) and torch.equal(value_cache[0, 0], value[1])


def test_batched_equals_per_sequence():
    """Writing a batch of sequences at once equals writing each sequence on its own."""
    key, value = fused_kv(20, 4, 2, 64, torch.bfloat16)
    slots = random_slots(20, 10 * 16, num_padding=3)
    batched = poisoned_caches(10, 16, 2, 64, torch.bfloat16)
    ops.kv_cache_write(key, value, *batched, slots)
    separate = poisoned_caches(10, 16, 2, 64, torch.bfloat16)
    for begin, end in [(0, 7), (7, 8), (8, 20)]:
        ops.kv_cache_write(key[begin:end], value[begin:end], *separate, slots[begin:end].clone())
    assert_same(batched[0], separate[0])
    assert_same(batched[1], separate[1])


def test_empty_batch():
    caches = poisoned_caches(2, 4, 1, 8, torch.float32)
    ops.kv_cache_write(torch.empty(0, 1, 8), torch.empty(0, 1, 8), *caches,
                       torch.empty(0, dtype=torch.long))
    assert caches[0].isnan().all() and caches[1].isnan().all()


def bad(num_tokens=3, heads=2, head_dim=8, dtype=torch.float32, cache_dtype=torch.float32,
        value_cache_dtype=None, slots=(0, 5, -1), slot_dtype=torch.long, value_heads=None,
        key_transform=None):
    key = torch.randn(num_tokens, heads, head_dim, dtype=dtype)
    if key_transform is not None:
        key = key_transform(key)
    value = torch.randn(num_tokens, value_heads or heads, head_dim, dtype=dtype)
    key_cache = torch.zeros(4, 4, 2, 8, dtype=cache_dtype)  # 16 slots
    value_cache = torch.zeros(4, 4, 2, 8, dtype=value_cache_dtype or cache_dtype)
    return key, value, key_cache, value_cache, torch.tensor(slots, dtype=slot_dtype)


@pytest.mark.parametrize(
    "args, match",
    [
        (bad(slots=(0, 16, 1)), "slot 16 is outside the cache of 16 slots"),
        (bad(slots=(0, -2, 1)), "slot -2 is outside the cache"),
        (bad(slots=(0, 1)), "number of tokens"),
        (bad(slot_dtype=torch.int32), "slot_mapping must be Long"),
        (bad(dtype=torch.bfloat16), "dtype"),
        (bad(value_cache_dtype=torch.float16), "dtype"),
        (bad(heads=3), "key must be"),
        (bad(head_dim=16), "key must be"),
        (bad(value_heads=1), "value must be"),
        (bad(num_tokens=3, key_transform=lambda k: k.transpose(0, 1).contiguous().transpose(0, 1)),
         "contiguous heads"),
    ],
    ids=["slot-too-large", "slot-negative", "token-count", "slot-dtype", "key-dtype",
         "cache-dtypes", "heads", "head-dim", "value-shape", "strided-heads"],
)
def test_kv_cache_write_rejects_bad_arguments(args, match):
    key, value, key_cache, value_cache, slots = args
    with pytest.raises(RuntimeError, match=match):
        ops.kv_cache_write(key, value, key_cache, value_cache, slots)
    assert not key_cache.any() and not value_cache.any(), "a rejected call must write nothing"


def test_rejects_non_contiguous_cache():
    cache = torch.zeros(4, 2, 4, 8).transpose(1, 2)  # [4, 4, 2, 8] viewed with swapped strides
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.kv_cache_write(torch.randn(1, 2, 8), torch.randn(1, 2, 8), cache, cache.clone(),
                           torch.tensor([0]))
