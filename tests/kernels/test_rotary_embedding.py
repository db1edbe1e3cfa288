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


# ------------------------------------------------------ per-head RMSNorm first (Qwen3, Gemma 3)


def make_norms(head_dim, weight_dtype, sides, seed=1):
    """Norm weights around 1 (Gemma 3's fp32 1 + w, or the model dtype's) for the given sides."""
    g = torch.Generator().manual_seed(seed)
    weights = [(1 + 0.5 * torch.randn(head_dim, generator=g)).to(weight_dtype) for _ in range(2)]
    return (weights[0] if "q" in sides else None), (weights[1] if "k" in sides else None)


def check_normed_rotary(num_tokens, heads, head_dim, rot_dim, is_neox, dtype, cache,
                        weight_dtype=None, sides="qk", epsilon=1e-6):
    num_heads, num_kv_heads = heads
    qkv, query, key = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    value_before = qkv[:, query.size(1) + key.size(1):].clone()
    positions = make_positions(num_tokens)
    q_norm, k_norm = make_norms(head_dim, weight_dtype or dtype, sides)
    want_q, want_k = reference.rotary_embedding(positions, query, key, head_dim, cache, is_neox,
                                                q_norm, k_norm, epsilon)
    ops.rotary_embedding(positions, query, key, head_dim, cache, is_neox, q_norm, k_norm, epsilon)
    torch.testing.assert_close(query.double(), want_q, **TOLERANCES[dtype])
    torch.testing.assert_close(key.double(), want_k, **TOLERANCES[dtype])
    assert torch.equal(qkv[:, query.size(1) + key.size(1):], value_before), "v was modified"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("head_dim, rot_dim", [(24, 24), (80, 80), (128, 128), (256, 256),
                                               (80, 20), (128, 64)])
def test_head_norms_then_rotation(head_dim, rot_dim, is_neox, dtype, cos_sin_caches):
    check_normed_rotary(7, (4, 2), head_dim, rot_dim, is_neox, dtype, cos_sin_caches[rot_dim])


@pytest.mark.parametrize("weight_dtype", [None, torch.float32], ids=["model-dtype", "fp32"])
@pytest.mark.parametrize("sides", ["qk", "q", "k"])
@pytest.mark.parametrize("heads", [(16, 8), (40, 8), (2, 1)], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 33])
def test_head_norms_sides_weights_and_heads(num_tokens, heads, sides, weight_dtype,
                                            cos_sin_caches):
    """Either side alone (a layer reading another layer's KV has no key to normalize), fp32
    weights (Gemma 3's 1 + w), more heads than a block has warps."""
    check_normed_rotary(num_tokens, heads, 128, 128, True, torch.bfloat16, cos_sin_caches[128],
                        weight_dtype, sides)


@pytest.mark.parametrize("epsilon", [1e-6, 0.5])
def test_head_norms_of_zero_and_tiny_heads(epsilon, cos_sin_caches):
    """A head of zeros stays zeros (epsilon keeps the scale finite); tiny heads are scaled up."""
    cache = cos_sin_caches[64]
    _, query, key = make_qkv(3, 2, 1, 64, torch.float32)
    query[0].zero_()
    key[1].mul_(1e-4)
    q_norm, k_norm = make_norms(64, torch.float32, "qk")
    want_q, want_k = reference.rotary_embedding(torch.tensor([0, 5, 9]), query, key, 64, cache,
                                                True, q_norm, k_norm, epsilon)
    ops.rotary_embedding(torch.tensor([0, 5, 9]), query, key, 64, cache, True, q_norm, k_norm,
                         epsilon)
    assert torch.equal(query[0], torch.zeros_like(query[0]))
    torch.testing.assert_close(query.double(), want_q, **TOLERANCES[torch.float32])
    torch.testing.assert_close(key.double(), want_k, **TOLERANCES[torch.float32])


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32], ids=["model-dtype", "fp32"])
def test_fused_head_norms_equal_rms_norm_then_rotation(dtype, weight_dtype, cos_sin_caches):
    """On the CPU the fused pass gives the bits of rms_norm over the heads, then the rotation:
    the same row code and roundings (what the model did before the fusion)."""
    cache = cos_sin_caches[128]
    _, query, key = make_qkv(9, 4, 2, 128, dtype)
    positions = make_positions(9)
    q_norm, k_norm = make_norms(128, weight_dtype or dtype, "qk")
    want_q, want_k = torch.empty_like(query), torch.empty_like(key)
    ops.rms_norm(want_q.view(-1, 128), query.reshape(-1, 128), q_norm, 1e-6)
    ops.rms_norm(want_k.view(-1, 128), key.reshape(-1, 128), k_norm, 1e-6)
    ops.rotary_embedding(positions, want_q, want_k, 128, cache, True)
    ops.rotary_embedding(positions, query, key, 128, cache, True, q_norm, k_norm, 1e-6)
    assert torch.equal(query, want_q) and torch.equal(key, want_k)


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


@pytest.mark.parametrize(
    "norms, match",
    [
        (dict(query_norm=torch.ones(15)), "query_norm must be contiguous \\[16\\]"),
        (dict(key_norm=torch.ones(16, 2)), "key_norm must be contiguous \\[16\\]"),
        (dict(query_norm=torch.ones(32)[::2]), "query_norm must be contiguous"),
        (dict(query_norm=torch.ones(16, dtype=torch.float64)), "query_norm must have"),
        (dict(key_norm=torch.ones(16, dtype=torch.bfloat16)), "key_norm must have"),
        (dict(query_norm=torch.ones(16), key_norm=torch.ones(16, dtype=torch.bfloat16)),
         "key_norm must have"),
        (dict(query_norm=torch.ones(16), norm_epsilon=-1.0), "norm_epsilon must be >= 0"),
    ],
    ids=["query-size", "key-dims", "strided", "fp64", "key-dtype", "mixed", "epsilon"],
)
def test_head_norms_reject_bad_arguments(norms, match):
    with pytest.raises(RuntimeError, match=match):
        ops.rotary_embedding(*bad(), True, **norms)


def test_head_norms_of_one_dtype():
    """A bf16 query takes bf16 or fp32 weights, but both norms of one dtype."""
    args = bad(dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="query_norm and key_norm must have one dtype"):
        ops.rotary_embedding(*args, True, query_norm=torch.ones(16),
                             key_norm=torch.ones(16, dtype=torch.bfloat16))


# ------------------------------------------------------------------ every CPU capability variant



def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    caches = {r: reference.rotary_cos_sin_cache(MAX_POSITION, r) for r in (40, 64, 128)}
    for dtype in DTYPES:
        for is_neox in (True, False):
            for head_dim, rot_dim in [(40, 40), (128, 128), (128, 64)]:
                check_rotary(5, (4, 2), head_dim, rot_dim, is_neox, dtype, caches[rot_dim])
                check_normed_rotary(5, (4, 2), head_dim, rot_dim, is_neox, dtype,
                                    caches[rot_dim])
    test_fused_head_norms_equal_rms_norm_then_rotation(torch.bfloat16, None, caches)




@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)
