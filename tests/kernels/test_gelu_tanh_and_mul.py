"""gelu_tanh_and_mul (the GeGLU gate of Gemma) against kvserve.testing.reference and against
torch's own gelu(approximate="tanh")."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant
from tests.kernels.test_silu_and_mul import DTYPES, NUM_TOKENS, SIZES, TOLERANCES, make_input

ops = torch.ops.kvserve


def run(x, out=None):
    out = torch.empty(x.size(0), x.size(1) // 2, dtype=x.dtype) if out is None else out
    ops.gelu_tanh_and_mul(out, x)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_gelu_tanh_and_mul(num_tokens, d, dtype):
    x = make_input(num_tokens, d, dtype)
    torch.testing.assert_close(run(x).double(), reference.gelu_tanh_and_mul(x),
                               **TOLERANCES[dtype])


def test_matches_torch_gelu():
    x = make_input(5, 300, torch.float32)
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(run(x), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(dtype):
    x = make_input(9, 33, dtype, pad=3)
    out_full = torch.full((9, 38), float("nan"), dtype=dtype)
    run(x, out_full[:, :33])
    torch.testing.assert_close(out_full[:, :33].double(), reference.gelu_tanh_and_mul(x),
                               **TOLERANCES[dtype])
    assert out_full[:, 33:].isnan().all(), "gelu_tanh_and_mul wrote outside the out view"


def test_batched_equals_per_row():
    x = make_input(11, 40, torch.bfloat16)
    batched = run(x)
    for t in range(x.size(0)):
        assert torch.equal(run(x[t:t + 1]), batched[t:t + 1]), f"row {t} depends on the batch"


@pytest.mark.parametrize("make_args, match", [
    (lambda: (torch.empty(3, 4), torch.randn(3, 7)), "2d"),
    (lambda: (torch.empty(2, 4), torch.randn(3, 8)), "2d"),
    (lambda: (torch.empty(3, 4, dtype=torch.bfloat16), torch.randn(3, 8)), "dtype"),
    (lambda: (torch.empty(3, 4), torch.randn(3, 8, dtype=torch.float64)), "dtype"),
    (lambda: (torch.empty(3, 4), torch.randn(8)), "dimensions"),
])
def test_rejects_bad_arguments(make_args, match):
    out, x = make_args()
    with pytest.raises(RuntimeError, match=match):
        ops.gelu_tanh_and_mul(out, x)


# ------------------------------------------------------------------ every CPU capability variant


def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for dtype in DTYPES:
        for d in (7, 33, 4095):
            test_gelu_tanh_and_mul(4, d, dtype)
        test_strided_rows(dtype)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)
