"""silu_and_mul (the SwiGLU gate) against kvserve.testing.reference."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant

ops = torch.ops.kvserve

# One tolerance per dtype: fp32 math, then one rounding to the dtype.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
}
DTYPES = list(TOLERANCES)
SIZES = [1, 7, 16, 33, 4095]  # d: the output width; input is [T, 2d]
NUM_TOKENS = [1, 4, 37]


def make_input(num_tokens, d, dtype, pad=0, seed=0):
    """[num_tokens, 2d] = [gate | up], with row stride 2d + pad. Gates span saturated silu too."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(num_tokens, 2 * d + pad, generator=g).mul_(4)
    full[0, 0] = -90.0  # exp(-gate) overflows fp32; silu must still give -0, not nan
    return full.to(dtype)[:, :2 * d]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_silu_and_mul(num_tokens, d, dtype):
    x = make_input(num_tokens, d, dtype)
    out = torch.empty(num_tokens, d, dtype=dtype)
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out.double(), reference.silu_and_mul(x), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [7, 33, 64])
def test_silu_and_mul_strided_rows(d, dtype):
    x = make_input(9, d, dtype, pad=3)
    assert not x.is_contiguous()
    out_full = torch.full((9, d + 5), float("nan"), dtype=dtype)
    out = out_full[:, :d]
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out.double(), reference.silu_and_mul(x), **TOLERANCES[dtype])
    assert out_full[:, d:].isnan().all(), "silu_and_mul wrote outside the out view"


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_equals_per_row(dtype):
    x = make_input(11, 40, dtype)
    batched = torch.empty(11, 40, dtype=dtype)
    ops.silu_and_mul(batched, x)
    for t in range(x.size(0)):
        single = torch.empty(1, 40, dtype=dtype)
        ops.silu_and_mul(single, x[t:t + 1])
        assert torch.equal(single, batched[t:t + 1]), f"row {t} depends on the batch"


@pytest.mark.parametrize(
    "make_args, match",
    [
        (lambda: (torch.empty(3, 4), torch.randn(3, 7)), "2d"),                   # odd width
        (lambda: (torch.empty(3, 5), torch.randn(3, 8)), "2d"),                   # out width
        (lambda: (torch.empty(2, 4), torch.randn(3, 8)), "2d"),                   # out rows
        (lambda: (torch.empty(3, 4, dtype=torch.bfloat16), torch.randn(3, 8)), "dtype"),
        (lambda: (torch.empty(3, 4), torch.randn(3, 8, dtype=torch.float64)), "dtype"),
        (lambda: (torch.empty(3, 4), torch.randn(8)), "dimensions"),
        (lambda: (torch.empty(3, 4), torch.randn(8, 3).t()), "contiguous"),
    ],
)
def test_silu_and_mul_rejects_bad_arguments(make_args, match):
    out, x = make_args()
    with pytest.raises(RuntimeError, match=match):
        ops.silu_and_mul(out, x)


# ------------------------------------------------------------------ every CPU capability variant



def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for dtype in DTYPES:
        for d in (7, 33, 4095):
            test_silu_and_mul(4, d, dtype)
        test_silu_and_mul_strided_rows(33, dtype)




@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)
