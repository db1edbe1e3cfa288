"""clamped_swiglu_and_mul (gpt-oss's gate) against kvserve.testing.reference and transformers'
own formula."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant
from tests.kernels.test_silu_and_mul import DTYPES, NUM_TOKENS, SIZES, TOLERANCES, make_input

ops = torch.ops.kvserve
ALPHA, LIMIT = 1.702, 7.0


def run(x, alpha=ALPHA, limit=LIMIT):
    out = torch.empty(x.size(0), x.size(1) // 2, dtype=x.dtype)
    ops.clamped_swiglu_and_mul(out, x, alpha, limit)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_clamped_swiglu_and_mul(num_tokens, d, dtype):
    # make_input's values reach |12| and -90: both clamps bite.
    x = make_input(num_tokens, d, dtype)
    torch.testing.assert_close(run(x).double(), reference.clamped_swiglu_and_mul(x, ALPHA, LIMIT),
                               **TOLERANCES[dtype])


def test_matches_transformers_gpt_oss_gate():
    """transformers' GptOssExperts._apply_gate reads gate and up interleaved; the op reads them
    as halves (kvserve de-interleaves gpt-oss's experts at load)."""
    x = make_input(5, 33, torch.float32)
    gate, up = x[:, :33], x[:, 33:]
    gate_c, up_c = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    want = (up_c + 1) * (gate_c * torch.sigmoid(gate_c * ALPHA))
    torch.testing.assert_close(run(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_other_parameters(dtype):
    x = make_input(9, 40, dtype, pad=3)
    assert not x.is_contiguous()
    out_full = torch.full((9, 45), float("nan"), dtype=dtype)
    ops.clamped_swiglu_and_mul(out_full[:, :40], x, 0.5, 1.5)
    torch.testing.assert_close(out_full[:, :40].double(),
                               reference.clamped_swiglu_and_mul(x, 0.5, 1.5), **TOLERANCES[dtype])
    assert out_full[:, 40:].isnan().all(), "wrote outside the out view"


@pytest.mark.parametrize("alpha, limit", [(0.0, 7.0), (1.7, 0.0), (1.7, -1.0)])
def test_rejects_bad_parameters(alpha, limit):
    with pytest.raises(RuntimeError, match="alpha and limit must be positive"):
        run(make_input(2, 8, torch.float32), alpha, limit)


def test_rejects_bad_shapes():
    with pytest.raises(RuntimeError):
        ops.clamped_swiglu_and_mul(torch.empty(2, 5), torch.randn(2, 8), ALPHA, LIMIT)


def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for dtype in DTYPES:
        for d in (7, 33, 4095):
            test_clamped_swiglu_and_mul(4, d, dtype)
        test_strided_rows_and_other_parameters(dtype)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)
