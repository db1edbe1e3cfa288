"""rotary_embedding (neox rotate-half and interleaved, full and partial) against
kvserve.testing.reference."""


import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.cuda_ops import host_check
from tests.kernels.capability import CAPABILITIES, check_variant

ops = torch.ops.kvserve

# One tolerance per dtype: fp32 rotation, then one rounding to the dtype.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
DTYPES = list(TOLERANCES)
MAX_POSITION = 4099
# (head_dim, rot_dim): full rotary for the usual and odd head dims, partial rotary for some.
HEAD_DIMS = [(24, 24), (40, 40), (64, 64), (80, 80), (96, 96), (128, 128), (256, 256),
             (64, 32), (80, 20), (128, 64), (40, 2)]
# (num_heads, num_kv_heads): MHA, GQA 2/4/8, MQA
HEADS = [(2, 2), (4, 2), (8, 2), (8, 1)]


def make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """A fused qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] and its q and k column views,
    whose rows are strided (as the model hands them to the op)."""
    g = torch.Generator().manual_seed(seed)
    q_width, k_width = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_width + 2 * k_width, generator=g).to(dtype)
    return qkv, qkv[:, :q_width], qkv[:, q_width:q_width + k_width]


def make_positions(num_tokens, seed=0):
    """Random positions, both ends of the cache included and one repeated (as in a batch)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=g)
    positions[0], positions[-1] = 0, MAX_POSITION - 1
    if num_tokens > 3:
        positions[1] = positions[2]
    return positions


@pytest.fixture(scope="module")
def cos_sin_caches():
    return {rot_dim: reference.rotary_cos_sin_cache(MAX_POSITION, rot_dim)
            for rot_dim in {r for _, r in HEAD_DIMS}}


def check_rotary(num_tokens, heads, head_dim, rot_dim, is_neox, dtype, cache):
    num_heads, num_kv_heads = heads
    qkv, query, key = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    value_before = qkv[:, query.size(1) + key.size(1):].clone()
    positions = make_positions(num_tokens)
    want_q, want_k = reference.rotary_embedding(positions, query, key, head_dim, cache, is_neox)
    ops.rotary_embedding(positions, query, key, head_dim, cache, is_neox)
    torch.testing.assert_close(query.double(), want_q, **TOLERANCES[dtype])
    torch.testing.assert_close(key.double(), want_k, **TOLERANCES[dtype])
    assert torch.equal(qkv[:, query.size(1) + key.size(1):], value_before), "v was modified"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("head_dim, rot_dim", HEAD_DIMS)
def test_rotary_embedding(head_dim, rot_dim, is_neox, dtype, cos_sin_caches):
    check_rotary(7, (4, 2), head_dim, rot_dim, is_neox, dtype, cos_sin_caches[rot_dim])


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 2, 33])
def test_rotary_embedding_heads_and_tokens(num_tokens, heads, is_neox, cos_sin_caches):
    check_rotary(num_tokens, heads, 64, 64, is_neox, torch.bfloat16, cos_sin_caches[64])


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_contiguous_inputs_and_batch_invariance(is_neox, cos_sin_caches):
    """Contiguous q/k give what strided views give, and each token is rotated on its own."""
    cache = cos_sin_caches[128]
    _, query, key = make_qkv(9, 4, 2, 128, torch.float32)
    positions = make_positions(9)
    strided_q, strided_k = query.clone(), key.clone()  # contiguous copies
    ops.rotary_embedding(positions, query, key, 128, cache, is_neox)
    ops.rotary_embedding(positions, strided_q, strided_k, 128, cache, is_neox)
    assert torch.equal(query, strided_q) and torch.equal(key, strided_k)
    _, q2, k2 = make_qkv(9, 4, 2, 128, torch.float32)
    for t in range(9):
        q_t, k_t = q2[t:t + 1].clone(), k2[t:t + 1].clone()
        ops.rotary_embedding(positions[t:t + 1], q_t, k_t, 128, cache, is_neox)
        assert torch.equal(q_t, query[t:t + 1]) and torch.equal(k_t, key[t:t + 1]), f"token {t}"


def test_reference_matches_complex_rotation():
    """Self-check of the reference: interleaved RoPE is multiplication by e^(i * angle) of the
    complex numbers x[2j] + i x[2j+1] (Meta's Llama), and neox RoPE is the same on halves."""
    positions, head_dim = torch.tensor([0, 3, 17]), 16
    cache = reference.rotary_cos_sin_cache(32, head_dim)
    x = torch.randn(3, head_dim, dtype=torch.float64)
    angle = torch.complex(cache[positions, :8].double(), cache[positions, 8:].double())
    interleaved = torch.view_as_real(torch.view_as_complex(x.view(3, 8, 2)) * angle).view(3, 16)
    got, _ = reference.rotary_embedding(positions, x, x, head_dim, cache, is_neox=False)
    torch.testing.assert_close(got, interleaved, atol=1e-6, rtol=1e-6)
    halves = torch.complex(x[:, :8], x[:, 8:]) * angle
    got, _ = reference.rotary_embedding(positions, x, x, head_dim, cache, is_neox=True)
    want = torch.cat([halves.real, halves.imag], dim=1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def bad(num_tokens=3, width=64, key_width=32, head_dim=16, rot_dim=16, max_position=8,
        positions=None, dtype=torch.float32, key_dtype=None, cache_dtype=torch.float32):
    positions = torch.arange(num_tokens) if positions is None else positions
    return (positions, torch.randn(num_tokens, width, dtype=dtype),
            torch.randn(num_tokens, key_width, dtype=key_dtype or dtype), head_dim,
            torch.ones(max_position, rot_dim, dtype=cache_dtype))


@pytest.mark.parametrize(
    "args, match",
    [
        host_check(bad(positions=torch.tensor([0, 8, 1])),
                   "position 8 is outside the rotary cache"),
        host_check(bad(positions=torch.tensor([0, -1, 1])),
                   "position -1 is outside the rotary cache"),
        (bad(positions=torch.tensor([0, 1, 2], dtype=torch.int32)), "positions must be Long"),
        (bad(positions=torch.tensor([0, 1])), "one row per position"),
        (bad(key_dtype=torch.bfloat16), "dtype"),
        (bad(cache_dtype=torch.float64), "cos_sin_cache must be Float"),
        (bad(width=60), "multiples of head_dim"),
        (bad(rot_dim=32), "rot_dim <= head_dim"),
        (bad(rot_dim=5), "even rot_dim"),
        (bad(dtype=torch.float64), "dtype"),
    ],
    ids=["position-too-large", "position-negative", "positions-int32", "rows", "key-dtype",
         "cache-dtype", "width", "rot-dim-too-large", "rot-dim-odd", "unsupported-dtype"],
)
def test_rotary_embedding_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        ops.rotary_embedding(*args, True)


# ------------------------------------------------------------------ every CPU capability variant



def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    caches = {r: reference.rotary_cos_sin_cache(MAX_POSITION, r) for r in (40, 64, 128)}
    for dtype in DTYPES:
        for is_neox in (True, False):
            for head_dim, rot_dim in [(40, 40), (128, 128), (128, 64)]:
                check_rotary(5, (4, 2), head_dim, rot_dim, is_neox, dtype, caches[rot_dim])




@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)
