"""The state-space ops (ssm_causal_conv1d, ssm_scan, rms_norm_gated) against
kvserve.testing.ssm_reference, whose functions are checked here against transformers' own
pure-torch Mamba2 paths (causal_conv1d_fn / _update, mamba2_chunk_scan with initial states,
mamba2_selective_state_update, MambaRMSNormGated, FalconH1RMSNormGated)."""

from __future__ import annotations

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import ssm_reference as ref
from tests.kernels.capability import CAPABILITIES, check_variant

ops = torch.ops.kvserve

TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}
DTYPES = list(TOLERANCES)
# Token counts per sequence: empty, a decode token, prefill chunks of awkward lengths; on CUDA
# a batch with prefill runs the chunked scan (32 tokens a chunk): exactly one chunk, and a
# partial third beside a decode token.
LENGTHS = [[1], [5, 0, 1, 13], [33, 2], [70, 1, 32]]


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def sequences(lengths, num_slots, seed=0):
    """cu_seqlens, distinct shuffled slots, alternating initial states."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    slots = torch.randperm(num_slots, generator=g)[:len(lengths)].to(torch.int32)
    initial = torch.tensor([i % 2 == 1 for i in range(len(lengths))])
    return cu, slots, initial


# --------------------------------------------------------------------------- causal_conv1d

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("dim, kernel", [(1, 2), (7, 4), (70, 3)])
@pytest.mark.parametrize("state_dtype", ["fp32", "same"])
def test_causal_conv1d(lengths, dim, kernel, dtype, state_dtype):
    tokens, num_slots = sum(lengths), len(lengths) + 2
    full = rand(tokens, dim + 3, dtype=dtype)
    x = full[:, 1:dim + 1]  # strided rows
    weight, bias = rand(dim, kernel, seed=1), rand(dim, seed=2)
    sdtype = torch.float32 if state_dtype == "fp32" else dtype
    state = rand(num_slots, dim, kernel - 1, dtype=sdtype, seed=3)
    cu, slots, initial = sequences(lengths, num_slots)
    want, want_state = ref.causal_conv1d(x, weight, bias, state, cu, slots, initial, True)
    out_full = torch.full((tokens, dim + 2), float("nan"), dtype=dtype)
    out = out_full[:, :dim]
    ops.ssm_causal_conv1d(out, x, weight, bias, state, cu, slots, initial, True)
    torch.testing.assert_close(out, want, **TOLERANCES[dtype])
    torch.testing.assert_close(state.float(), want_state.float(), **TOLERANCES[sdtype])
    assert out_full[:, dim:].isnan().all(), "ssm_causal_conv1d wrote outside the out view"


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d_chunks_equal_the_whole(dtype):
    """A prompt in chunks of 7, then 1-token decode steps, through the state slot, equals the
    whole sequence at once (the engine's chunked prefill)."""
    dim, kernel, n = 11, 4, 23
    x, weight = rand(n, dim, dtype=dtype), rand(dim, kernel, dtype=dtype, seed=1)
    whole = torch.empty_like(x)
    state = torch.zeros(2, dim, kernel - 1)
    one = torch.tensor([1], dtype=torch.int32)
    ops.ssm_causal_conv1d(whole, x, weight, None, state, torch.tensor([0, n], dtype=torch.int32),
                          one, torch.tensor([False]), False)
    pieces, state = torch.empty_like(x), torch.full((2, dim, kernel - 1), 5.0)
    start = 0
    for size in (7, 7, 1, 7, 1):
        chunk = slice(start, start + size)
        ops.ssm_causal_conv1d(pieces[chunk], x[chunk], weight, None, state,
                              torch.tensor([0, size], dtype=torch.int32), one,
                              torch.tensor([start > 0]), False)
        start += size
    torch.testing.assert_close(pieces, whole, atol=0, rtol=0)


# --------------------------------------------------------------------------------- ssm_scan

def scan_operands(lengths, heads, head_dim, groups, state_size, dtype, seed=0,
                  per_state=False):
    """x, dt, A, B, C, D, dt_bias; A [heads, state_size] with per_state (Mamba's)."""
    tokens = sum(lengths)
    # x, B and C as views of one projection output, as the model slices them.
    width = heads * head_dim + 2 * groups * state_size + 3
    proj = rand(tokens, width, dtype=dtype, seed=seed)
    x = proj[:, :heads * head_dim].view(tokens, heads, head_dim) if tokens else \
        torch.empty(0, heads, head_dim, dtype=dtype)
    b0 = heads * head_dim
    B = proj[:, b0:b0 + groups * state_size].unflatten(1, (groups, state_size))
    C = proj[:, b0 + groups * state_size:b0 + 2 * groups * state_size].unflatten(
        1, (groups, state_size))
    dt = rand(tokens, heads + 1, dtype=dtype, seed=seed + 1)[:, :heads]
    A = -torch.rand(heads, *([state_size] if per_state else []),
                    generator=torch.Generator().manual_seed(seed + 2)) - 0.1
    D, dt_bias = rand(heads, seed=seed + 3), rand(heads, seed=seed + 4, scale=0.5)
    return x, dt, A, B, C, D, dt_bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", LENGTHS)
# Mamba2's heads, and Mamba's channels (heads of one with a decay per state entry; head_dim 3
# is beyond Mamba, but the contract allows it).
@pytest.mark.parametrize("heads, head_dim, groups, state_size, per_state",
                         [(1, 1, 1, 1, False), (4, 3, 2, 5, False), (6, 16, 3, 33, False),
                          (37, 1, 1, 16, True), (5, 3, 1, 7, True)])
@pytest.mark.parametrize("state_dtype", ["fp32", "same"])
def test_ssm_scan(lengths, heads, head_dim, groups, state_size, per_state, dtype, state_dtype):
    x, dt, A, B, C, D, dt_bias = scan_operands(lengths, heads, head_dim, groups, state_size,
                                               dtype, per_state=per_state)
    num_slots = len(lengths) + 1
    sdtype = torch.float32 if state_dtype == "fp32" else dtype
    state = rand(num_slots, heads, head_dim, state_size, dtype=sdtype, seed=9, scale=0.5)
    cu, slots, initial = sequences(lengths, num_slots, seed=1)
    want, want_state = ref.ssm_scan(x, dt, A, B, C, D, dt_bias, state, cu, slots, initial,
                                    True, 0.0, float("inf"))
    out = torch.full((x.size(0), heads, head_dim), float("nan"), dtype=dtype)
    ops.ssm_scan(out, x, dt, A, B, C, D, dt_bias, state, cu, slots, initial, True, 0.0,
                 float("inf"))
    tol = TOLERANCES[dtype] if dtype == torch.float32 else \
        {k: 2 * v for k, v in TOLERANCES[dtype].items()}
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(state.float(), want_state.float(), **TOLERANCES[sdtype])


@pytest.mark.parametrize("dt_min, dt_max", [(0.0, float("inf")), (0.05, 0.3)])
def test_ssm_scan_dt_limits_and_no_softplus(dt_min, dt_max):
    x, dt, A, B, C, D, _ = scan_operands([9], 4, 3, 2, 5, torch.float32)
    state = torch.zeros(1, 4, 3, 5)
    cu, slots, initial = torch.tensor([0, 9], dtype=torch.int32), torch.tensor(
        [0], dtype=torch.int32), torch.tensor([False])
    dt = dt.abs()
    want, _ = ref.ssm_scan(x, dt, A, B, C, None, None, state, cu, slots, initial, False, dt_min,
                           dt_max)
    out = torch.empty(9, 4, 3)
    ops.ssm_scan(out, x, dt, A, B, C, None, None, state, cu, slots, initial, False, dt_min,
                 dt_max)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("per_state", [False, True])
def test_ssm_scan_chunks_equal_the_whole(per_state):
    """Chunks of 7 and 1-token steps through the state slot equal one pass (fp32)."""
    x, dt, A, B, C, D, dt_bias = scan_operands([20], 4, 8, 2, 16, torch.float32,
                                               per_state=per_state)
    one, cu = torch.tensor([2], dtype=torch.int32), torch.tensor([0, 20], dtype=torch.int32)
    state = torch.zeros(3, 4, 8, 16)
    whole = torch.empty(20, 4, 8)
    ops.ssm_scan(whole, x, dt, A, B, C, D, dt_bias, state, cu, one, torch.tensor([False]), True,
                 0.0, float("inf"))
    final = state[2].clone()
    state = torch.full((3, 4, 8, 16), 7.0)
    pieces, start = torch.empty(20, 4, 8), 0
    for size in (7, 1, 7, 5):
        s = slice(start, start + size)
        ops.ssm_scan(pieces[s], x[s], dt[s], A, B[s], C[s], D, dt_bias, state,
                     torch.tensor([0, size], dtype=torch.int32), one,
                     torch.tensor([start > 0]), True, 0.0, float("inf"))
        start += size
    torch.testing.assert_close(pieces, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state[2], final, atol=1e-6, rtol=1e-6)


def test_batched_sequences_equal_one_at_a_time():
    lengths = [5, 1, 9]
    x, dt, A, B, C, D, dt_bias = scan_operands(lengths, 4, 3, 2, 5, torch.float32)
    state = rand(4, 4, 3, 5, seed=3)
    cu, slots, initial = sequences(lengths, 4)
    alone_state = state.clone()
    batched = torch.empty(15, 4, 3)
    ops.ssm_scan(batched, x, dt, A, B, C, D, dt_bias, state, cu, slots, initial, True, 0.0,
                 float("inf"))
    for i in range(3):
        s = slice(int(cu[i]), int(cu[i + 1]))
        alone = torch.empty(len(range(*s.indices(15))), 4, 3)
        ops.ssm_scan(alone, x[s], dt[s], A, B[s], C[s], D, dt_bias, alone_state,
                     torch.tensor([0, alone.size(0)], dtype=torch.int32), slots[i:i + 1],
                     initial[i:i + 1], True, 0.0, float("inf"))
        assert torch.equal(alone, batched[s]), f"sequence {i} depends on the batch"
    assert torch.equal(alone_state, state)


# --------------------------------------------------------------------------- rms_norm_gated

# Mamba2's gate then norm, FalconH1's norm then gate, and the gate alone (no weight).
ORDERS = ["gate_then_norm", "norm_then_gate", "gate_only"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim, group_size", [(1, 1), (12, 4), (96, 96), (330, 33)])
@pytest.mark.parametrize("gated, order", [(gated, order) for order in ORDERS
                                           for gated in (True, False)
                                           if gated or order != "gate_only"])
def test_rms_norm_gated(dim, group_size, dtype, gated, order):
    x = rand(9, dim + 2, dtype=dtype, scale=3)[:, :dim]
    z = rand(9, dim, dtype=dtype, seed=1) if gated else None
    w = None if order == "gate_only" else (1 + rand(dim, seed=2, scale=0.3)).to(dtype)
    out = torch.empty(9, dim, dtype=dtype)
    before = order == "norm_then_gate"
    ops.rms_norm_gated(out, x, z, w, group_size, 1e-5, before)
    torch.testing.assert_close(out, ref.rms_norm_gated(x, z, w, group_size, 1e-5, before),
                               **TOLERANCES[dtype])


# -------------------------------------------------------------------------------- bad input

def conv_args(**change):
    args = dict(out=torch.empty(6, 8), input=torch.randn(6, 8), weight=torch.randn(8, 4),
                bias=None, conv_state=torch.zeros(3, 8, 3),
                cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32),
                slots=torch.tensor([0, 2], dtype=torch.int32),
                has_initial_state=torch.tensor([True, False]), silu=True)
    args.update(change)
    return args


@pytest.mark.parametrize("change, match", [
    (dict(weight=torch.randn(8, 17)), "kernel <= 16"),
    (dict(weight=torch.randn(8, 1)), "kernel"),
    (dict(conv_state=torch.zeros(3, 8, 2)), "conv_state must be contiguous"),
    (dict(out=torch.empty(6, 8).half()), "dtype"),
    (dict(slots=torch.tensor([0, 3], dtype=torch.int32)), "outside the pool"),
    (dict(slots=torch.tensor([1, 1], dtype=torch.int32)), "two sequences"),
    (dict(slots=torch.tensor([0, 1])), "Int"),
    (dict(cu_seqlens=torch.tensor([0, 4, 2], dtype=torch.int32)), "run from 0 to 6"),
    (dict(cu_seqlens=torch.tensor([0, 5, 4, 6], dtype=torch.int32),
          slots=torch.tensor([0, 1, 2], dtype=torch.int32),
          has_initial_state=torch.tensor([True, True, False])), "decreases"),
    (dict(has_initial_state=torch.tensor([1, 0])), "Bool"),
])
def test_causal_conv1d_rejects_bad_arguments(change, match):
    with pytest.raises(RuntimeError, match=match):
        ops.ssm_causal_conv1d(**conv_args(**change))


def scan_args(**change):
    x, dt, A, B, C, D, dt_bias = scan_operands([2, 4], 4, 3, 2, 5, torch.float32)
    args = dict(out=torch.empty(6, 4, 3), x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias,
                state=torch.zeros(3, 4, 3, 5), cu_seqlens=torch.tensor([0, 2, 6],
                                                                        dtype=torch.int32),
                slots=torch.tensor([0, 2], dtype=torch.int32),
                has_initial_state=torch.tensor([True, False]), dt_softplus=True, dt_min=0.0,
                dt_max=float("inf"))
    args.update(change)
    return args


@pytest.mark.parametrize("change, match", [
    (dict(B=torch.randn(6, 3, 5)), "groups dividing"),
    (dict(A=torch.randn(4).double()), "A must be Float"),
    (dict(A=torch.randn(4, 6)), r"A must be \[4\] or \[4, 5\]"),
    (dict(A=torch.randn(5)), r"A must be \[4\] or"),
    (dict(state=torch.zeros(3, 4, 3, 6)), "state must be contiguous"),
    (dict(dt=torch.randn(6, 5)), "dt must be"),
    (dict(dt_min=1.0, dt_max=0.5), "at most dt_max"),
    (dict(dt_min=float("nan")), "at most dt_max"),
    (dict(slots=torch.tensor([0, 5], dtype=torch.int32)), "outside the pool"),
    (dict(x=torch.randn(6, 3, 4).transpose(1, 2)), "contiguous but for its token stride"),
])
def test_ssm_scan_rejects_bad_arguments(change, match):
    with pytest.raises(RuntimeError, match=match):
        ops.ssm_scan(**scan_args(**change))


@pytest.mark.parametrize("gate, weight, group_size, match", [
    (None, torch.ones(8), 3, "divide"),
    (None, None, 8, "the gate is required"),
    (torch.randn(2, 8), torch.ones(7), 8, "weight must be contiguous"),
    (torch.randn(2, 7), torch.ones(8), 8, "gate must have the shape"),
])
def test_rms_norm_gated_rejects_bad_arguments(gate, weight, group_size, match):
    with pytest.raises(RuntimeError, match=match):
        ops.rms_norm_gated(torch.empty(2, 8), torch.randn(2, 8), gate, weight, group_size, 1e-5)


# ----------------------------------------------------- the references against transformers

def test_references_equal_transformers_mamba2_paths():
    m = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    dim, kernel = 6, 4
    w, b, x = rand(dim, kernel), rand(dim, seed=1), rand(8, dim, seed=2)
    state = rand(3, dim, kernel - 1, seed=3)
    out, new = ref.causal_conv1d(x, w, b, state, torch.tensor([0, 5, 8]), torch.tensor([2, 0]),
                                 torch.tensor([False, True]), True)
    torch.testing.assert_close(out[:5].float(), m.causal_conv1d_fn(
        x[:5].T[None].clone(), w, b, "silu")[0].T)
    st = state[0:1].clone()
    torch.testing.assert_close(out[5:].float(), m.causal_conv1d_update(
        x[5:].T[None].clone(), st, w, b, "silu")[0].T)
    torch.testing.assert_close(new[0], st[0])
    T, H, P, G, N = 11, 4, 3, 2, 5
    xs, dt, A, B, C, D, dtb = scan_operands([T], H, P, G, N, torch.float32)
    h0 = rand(1, H, P, N, seed=7)
    y, final = m.mamba2_chunk_scan(xs[None], dt[None], A, B[None], C[None], chunk_size=4, D=D,
                                   dt_bias=dtb, initial_states=h0, dt_softplus=True,
                                   return_final_states=True)
    pool = torch.cat([torch.zeros(1, H, P, N), h0])
    yr, new_pool = ref.ssm_scan(xs, dt, A, B, C, D, dtb, pool, torch.tensor([0, T]),
                                torch.tensor([1]), torch.tensor([True]))
    torch.testing.assert_close(yr, y[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_pool[1], final[0], atol=1e-5, rtol=1e-5)
    st = h0.clone()
    yu = m.mamba2_selective_state_update(
        st, xs[None, 0], dt[None, 0][..., None].expand(1, H, P), A[:, None, None].expand(H, P, N),
        B[None, 0], C[None, 0], D=D[:, None].expand(H, P), dt_bias=dtb[:, None].expand(H, P),
        dt_softplus=True)
    torch.testing.assert_close(yr[0], yu[0], atol=1e-5, rtol=1e-5)
    norm = m.MambaRMSNormGated(8, group_size=4, eps=1e-5)
    norm.weight.data = rand(8, seed=5)
    xx, zz = rand(3, 8, seed=6), rand(3, 8, seed=8)
    torch.testing.assert_close(ref.rms_norm_gated(xx, zz, norm.weight.data, 4, 1e-5),
                               norm(xx, zz).detach())
    falcon = pytest.importorskip("transformers.models.falcon_h1.modeling_falcon_h1")
    for before in (True, False):
        norm = falcon.FalconH1RMSNormGated(8, eps=1e-5, n_groups=2, norm_before_gate=before)
        norm.weight.data = rand(8, seed=5)
        torch.testing.assert_close(ref.rms_norm_gated(xx, zz, norm.weight.data, 4, 1e-5, before),
                                   norm(xx, zz).detach())


def test_reference_equals_transformers_mamba_paths():
    """Mamba's scan (a decay per channel and state entry) against transformers' pure-torch
    selective scan and its one-token update (used when mamba_ssm is absent, as it is here)."""
    hub = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    T, channels, N = 9, 7, 5
    xs, dt, A, B, C, D, dtb = scan_operands([T], channels, 1, 1, N, torch.float32,
                                            per_state=True)
    z = rand(T, channels, seed=11)
    y, final = hub.mamba_selective_scan(
        xs[:, :, 0].T[None].contiguous(), dt.T[None].contiguous(), A, B[:, 0].T[None].contiguous(),
        C[:, 0].T[None].contiguous(), D=D, z=z.T[None].contiguous(), delta_bias=dtb,
        delta_softplus=True, return_last_state=True, use_mambapy=False,
        use_associative_scan=False)
    pool = torch.zeros(2, channels, 1, N)
    yr, new_pool = ref.ssm_scan(xs, dt, A, B, C, D, dtb, pool, torch.tensor([0, T]),
                                torch.tensor([1]), torch.tensor([False]))
    gated = yr[:, :, 0] * torch.nn.functional.silu(z)
    torch.testing.assert_close(gated, y[0].T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_pool[1, :, 0], final[0], atol=1e-5, rtol=1e-5)
    state = final.clone()
    x1, dt1, _, B1, C1, _, _ = scan_operands([1], channels, 1, 1, N, torch.float32, seed=20)
    z1 = rand(1, channels, seed=21)
    yu = hub.mamba_selective_state_update(state, x1[:, :, 0], dt1, A, B1[:, 0], C1[:, 0], D,
                                          z=z1, dt_bias=dtb, dt_softplus=True)
    y1, after = ref.ssm_scan(x1, dt1, A, B1, C1, D, dtb, new_pool, torch.tensor([0, 1]),
                             torch.tensor([1]), torch.tensor([True]))
    torch.testing.assert_close(y1[:, :, 0] * torch.nn.functional.silu(z1), yu, atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(after[1, :, 0], state[0], atol=1e-5, rtol=1e-5)


def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for dtype in DTYPES:
        test_causal_conv1d([5, 0, 1, 13], 70, 3, dtype, "fp32")
        test_ssm_scan([5, 0, 1, 13], 6, 16, 3, 33, False, dtype, "fp32")
        test_ssm_scan([5, 0, 1, 13], 37, 1, 1, 16, True, dtype, "fp32")
        for order in ORDERS:
            test_rms_norm_gated(330, 33, dtype, True, order)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)
