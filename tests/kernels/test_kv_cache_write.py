"""kv_cache_write against kvserve.testing.reference. A write is a copy, or a quantization whose
arithmetic the contract fixes (fp32 max, scale and division), so results must be exact (no
tolerance table): every written slot equals its token, and every other slot keeps the NaN it was
poisoned with (quantized caches: the NaN of its scale). The op has a single CPU body (a memcpy
or a scalar loop per row, no per-capability variants), so unlike the other kernel tests this file
has no CPU-capability test."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.cuda_ops import host_check

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
        host_check(bad(slots=(0, 16, 1)), "slot 16 is outside the cache of 16 slots"),
        host_check(bad(slots=(0, -2, 1)), "slot -2 is outside the cache"),
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


# ------------------------------------------------------------------------- int8 / fp8 caches

KV_DTYPES = [torch.int8, torch.float8_e4m3fn]


def poisoned_quantized(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype):
    """Zero entries and NaN scales: a slot the op does not write keeps a NaN scale."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.zeros(shape).to(cache_dtype), torch.zeros(shape).to(cache_dtype),
            torch.full(shape[:3], float("nan")), torch.full(shape[:3], float("nan")))


def assert_same_quantized(actual, expected):
    for a, e in zip(actual, expected):
        if a.dtype == torch.float8_e4m3fn:
            a, e = a.view(torch.uint8), e.view(torch.uint8)
        assert_same(a, e)


@pytest.mark.parametrize("cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES)
def test_quantized_write(num_heads, num_kv_heads, head_dim, block_size, dtype, cache_dtype):
    num_blocks, num_tokens = 40 // block_size + 3, 29
    key, value = fused_kv(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    key[3, 0] = 0  # a row of zeros: scale 0, entries 0
    caches = poisoned_quantized(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)
    slots = random_slots(num_tokens, num_blocks * block_size, num_padding=4)
    last = num_blocks * block_size - 1
    slots[slots == last] = -1
    slots[3] = last
    want = reference.kv_cache_write(key, value, *caches[:2], slots, *caches[2:])
    ops.kv_cache_write(key, value, caches[0], caches[1], slots, caches[2], caches[3])
    assert_same_quantized(caches, want)
    key_scale = caches[2]
    assert key_scale.isnan().any(), "the test must leave unwritten slots"
    assert key_scale[-1, -1, 0] == 0 and not caches[0][-1, -1, 0].float().any()
    # Entries times scales are the values, to the format's precision.
    step = {torch.int8: 0.5 / 127, torch.float8_e4m3fn: 2.0 ** -4}[cache_dtype]
    written = slots >= 0
    rows = key_scale.view(-1, num_kv_heads)[slots[written]]  # [written, heads]
    values = caches[0].view(-1, num_kv_heads, head_dim)[slots[written]].float() * rows[..., None]
    amax = key[written].float().abs().amax(-1, keepdim=True)
    assert ((values - key[written].float()).abs() <= step * amax * 1.0001).all()


@pytest.mark.parametrize("cache_dtype", KV_DTYPES)
def test_quantized_latent_cache(cache_dtype):
    """One cache and one scale tensor passed twice (MLA): the keys are the entries."""
    entry = torch.randn(5, 1, 36)
    cache = torch.zeros(3, 4, 1, 36).to(cache_dtype)
    scale = torch.full((3, 4, 1), float("nan"))
    slots = torch.tensor([4, 5, 6, -1, 11])
    want = reference.kv_cache_write(entry, entry, cache, cache, slots, scale, scale)
    ops.kv_cache_write(entry, entry, cache, cache, slots, scale, scale)
    assert_same_quantized((cache, scale), want[::2])
    with pytest.raises(RuntimeError, match="one scale tensor for both"):
        ops.kv_cache_write(entry, entry, cache, cache, slots, scale, scale.clone())


def test_int8_rounds_half_to_even_and_fp8_saturates_nothing():
    """A row whose max is 127 has scale 1: entries are x rounded half to even; the max of an fp8
    row maps to 448 exactly."""
    x = torch.tensor([[[127.0, 0.5, 1.5, 2.5, -2.5, -126.5, 3.49, 0.0]]])
    cache = torch.zeros(1, 1, 1, 8, dtype=torch.int8)
    scale = torch.zeros(1, 1, 1)
    ops.kv_cache_write(x, x, cache, cache.clone(), torch.tensor([0]), scale, scale.clone())
    assert scale.item() == 1.0
    assert cache.flatten().tolist() == [127, 0, 2, 2, -2, -126, 3, 0]
    fp8 = torch.zeros(1, 1, 1, 8, dtype=torch.float8_e4m3fn)
    ops.kv_cache_write(x, x, fp8, fp8.clone(), torch.tensor([0]), scale, scale.clone())
    assert fp8.float()[0, 0, 0, 0] == 448 and scale.item() == pytest.approx(127 / 448)


def bad_quantized(cache_dtype=torch.int8, scale_shape=(4, 4, 2), scale_dtype=torch.float32,
                  scales=True):
    key, value, _, _, slots = bad()
    cache = torch.zeros(4, 4, 2, 8).to(cache_dtype)
    scale = torch.zeros(scale_shape, dtype=scale_dtype) if scales else None
    return key, value, cache, cache.clone(), slots, scale, None if scale is None else scale.clone()


@pytest.mark.parametrize(
    "args, match",
    [
        (bad_quantized(scales=False), "needs its scales"),
        (bad_quantized(scale_shape=(4, 4)), "scales of key_cache must be contiguous fp32"),
        (bad_quantized(scale_shape=(4, 2, 2)), "scales of key_cache must be contiguous fp32"),
        (bad_quantized(scale_dtype=torch.float16), "scales of key_cache must be contiguous fp32"),
        (bad_quantized(cache_dtype=torch.uint8), "int8 / float8_e4m3fn"),
        (bad()[:5] + (torch.zeros(4, 4, 2), None), "takes no scales"),
    ],
    ids=["no-scales", "scale-rank", "scale-shape", "scale-dtype", "cache-dtype",
         "plain-with-scales"],
)
def test_quantized_write_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        ops.kv_cache_write(*args)
