"""rms_norm and fused_add_rms_norm against kvserve.testing.reference."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant

ops = torch.ops.kvserve

# One tolerance per dtype: output rounding of the dtype plus fp32 accumulation over the row.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
DTYPES = list(TOLERANCES)
HIDDEN_SIZES = [1, 7, 16, 33, 4095]
NUM_TOKENS = [1, 5, 37]
EPS = 1e-6


def make_rows(num_tokens, hidden, dtype, pad=0, seed=0):
    """A [num_tokens, hidden] view with row stride hidden + pad (pad > 0: strided rows)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(num_tokens, hidden + pad, generator=g).mul_(3).to(dtype)
    return full[:, :hidden]


def make_weight(hidden, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rms_norm(num_tokens, hidden, dtype):
    x, w = make_rows(num_tokens, hidden, dtype), make_weight(hidden, dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, EPS)
    torch.testing.assert_close(out.double(), reference.rms_norm(x, w, EPS), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [7, 33, 256])
def test_rms_norm_strided_rows(hidden, dtype):
    x, w = make_rows(9, hidden, dtype, pad=5), make_weight(hidden, dtype)
    assert not x.is_contiguous()
    out_full = torch.full((9, hidden + 3), float("nan"), dtype=dtype)
    out = out_full[:, :hidden]
    ops.rms_norm(out, x, w, EPS)
    torch.testing.assert_close(out.double(), reference.rms_norm(x, w, EPS), **TOLERANCES[dtype])
    assert out_full[:, hidden:].isnan().all(), "rms_norm wrote outside the out view"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_fused_add_rms_norm(num_tokens, hidden, dtype):
    x = make_rows(num_tokens, hidden, dtype, seed=2).clone()
    residual = make_rows(num_tokens, hidden, dtype, seed=3).clone()
    w = make_weight(hidden, dtype)
    want_out, want_residual = reference.fused_add_rms_norm(x, residual, w, EPS)
    ops.fused_add_rms_norm(x, residual, w, EPS)
    # The residual is one rounding of an exact sum: it must match the rounded reference exactly.
    torch.testing.assert_close(residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(x.double(), want_out, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_strided_rows(dtype):
    x, residual = make_rows(6, 33, dtype, pad=4, seed=2), make_rows(6, 33, dtype, pad=2, seed=3)
    w = make_weight(33, dtype)
    want_out, want_residual = reference.fused_add_rms_norm(x, residual, w, EPS)
    ops.fused_add_rms_norm(x, residual, w, EPS)
    torch.testing.assert_close(residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(x.double(), want_out, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_equals_per_row(dtype):
    x, w = make_rows(13, 65, dtype), make_weight(65, dtype)
    batched = torch.empty_like(x)
    ops.rms_norm(batched, x, w, EPS)
    for t in range(x.size(0)):
        single = torch.empty_like(x[t:t + 1])
        ops.rms_norm(single, x[t:t + 1], w, EPS)
        assert torch.equal(single, batched[t:t + 1]), f"row {t} depends on the batch"


def test_epsilon_is_used():
    x = torch.zeros(2, 8)
    x[1] = 1e-3
    out = torch.empty_like(x)
    ops.rms_norm(out, x, torch.ones(8), 1e-2)
    torch.testing.assert_close(out.double(), reference.rms_norm(x, torch.ones(8), 1e-2))
    assert out[0].eq(0).all() and out[1].lt(0.02).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [7, 33, 300])
def test_fp32_weight(hidden, dtype):
    """An fp32 weight (Gemma's 1 + w) scales in fp32, before the one rounding to the dtype: it
    matches the reference closer than the weight rounded to the dtype would."""
    x = make_rows(5, hidden, dtype)
    weight = 1 + 0.5 * torch.randn(hidden, generator=torch.Generator().manual_seed(3))
    want = reference.rms_norm(x, weight, EPS)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, EPS)
    assert (out.double() - want).abs().max() <= 0.51 * _ulp(want, dtype).max()
    residual, y = make_rows(5, hidden, dtype, seed=4), x.clone()
    want_y, want_residual = reference.fused_add_rms_norm(x, residual, weight, EPS)
    ops.fused_add_rms_norm(y, residual, weight, EPS)
    assert torch.equal(residual, want_residual)
    assert (y.double() - want_y).abs().max() <= 0.51 * _ulp(want_y, dtype).max()


def _ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each value (a rounding error is at most half of it)."""
    bits = {torch.bfloat16: 7, torch.float16: 10}[dtype]  # explicit mantissa bits
    return torch.pow(2.0, torch.floor(torch.log2(values.abs().clamp_min(1e-30))) - bits)


@pytest.mark.parametrize(
    "make_args, match",
    [
        (lambda: (torch.empty(4, 8), torch.randn(4, 8), torch.ones(8).bfloat16()), "dtype"),
        (lambda: (torch.empty(4, 8).half(), torch.randn(4, 8).half(), torch.ones(8).bfloat16()),
         "or be float32"),
        (lambda: (torch.empty(4, 8), torch.randn(4, 8), torch.ones(7)), "weight"),
        (lambda: (torch.empty(4, 7), torch.randn(4, 8), torch.ones(8)), "shape"),
        (lambda: (torch.empty(4, 8).half(), torch.randn(4, 8), torch.ones(8)), "dtype"),
        (lambda: (torch.empty(2, 4, 8), torch.randn(2, 4, 8), torch.ones(8)), "dimensions"),
        (lambda: (torch.empty(8, 4).t(), torch.randn(8, 4).t(), torch.ones(8)), "contiguous"),
        (lambda: (torch.empty(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32),
                  torch.ones(8, dtype=torch.int32)), "dtype"),
    ],
)
def test_rms_norm_rejects_bad_arguments(make_args, match):
    out, x, w = make_args()
    with pytest.raises(RuntimeError, match=match):
        ops.rms_norm(out, x, w, EPS)


@pytest.mark.parametrize(
    "make_args, match",
    [
        (lambda: (torch.randn(4, 8), torch.randn(4, 8).bfloat16(), torch.ones(8)), "dtype"),
        (lambda: (torch.randn(4, 8), torch.randn(3, 8), torch.ones(8)), "shape"),
        (lambda: (torch.randn(4, 8), torch.randn(4, 8), torch.ones(9)), "weight"),
    ],
)
def test_fused_add_rms_norm_rejects_bad_arguments(make_args, match):
    x, residual, w = make_args()
    with pytest.raises(RuntimeError, match=match):
        ops.fused_add_rms_norm(x, residual, w, EPS)


# ------------------------------------------------------------------ every CPU capability variant



def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for dtype in DTYPES:
        for hidden in (7, 33, 4095):
            test_rms_norm(5, hidden, dtype)
            test_fused_add_rms_norm(5, hidden, dtype)
        test_rms_norm_strided_rows(33, dtype)
    test_fp32_weight(33, torch.bfloat16)




@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)
