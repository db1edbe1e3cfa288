"""layer_norm against kvserve.testing.reference and torch's own layer norm."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant
from tests.kernels.test_rms_norm import _ulp, make_rows, make_weight

ops = torch.ops.kvserve

# Output rounding of the dtype plus fp32 accumulation over the row (mean and variance).
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
    torch.float16: dict(atol=4e-3, rtol=2e-3),
}
DTYPES = list(TOLERANCES)
EPS = 1e-5


def make_bias(hidden, dtype, seed=4):
    g = torch.Generator().manual_seed(seed)
    return (0.3 * torch.randn(hidden, generator=g)).to(dtype)


def run(x, w, b, eps=EPS):
    out = torch.empty_like(x)
    ops.layer_norm(out, x, w, b, eps)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 7, 16, 33, 4095])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("with_bias", [False, True])
def test_layer_norm(num_tokens, hidden, dtype, with_bias):
    # Rows far from zero mean: a one-pass E[x^2] - mean^2 would lose the variance.
    x = (make_rows(num_tokens, hidden, dtype).float() + 40).to(dtype)
    w = make_weight(hidden, dtype)
    b = make_bias(hidden, dtype) if with_bias else None
    want = reference.layer_norm(x, w, b, EPS)
    torch.testing.assert_close(run(x, w, b).double(), want, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_layer_norm(dtype):
    """torch's F.layer_norm (in fp32, as transformers' Cohere LayerNorm computes) rounded once."""
    x, w, b = make_rows(11, 300, dtype), make_weight(300, dtype), make_bias(300, dtype)
    want = torch.nn.functional.layer_norm(x.float(), (300,), w.float(), b.float(), EPS)
    torch.testing.assert_close(run(x, w, b).float(), want.to(dtype).float(),
                               **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [7, 33, 256])
def test_strided_rows_and_in_place(hidden, dtype):
    x, w = make_rows(9, hidden, dtype, pad=5), make_weight(hidden, dtype)
    assert not x.is_contiguous()
    want = reference.layer_norm(x, w, None, EPS)
    out_full = torch.full((9, hidden + 3), float("nan"), dtype=dtype)
    out = out_full[:, :hidden]
    ops.layer_norm(out, x, w, None, EPS)
    torch.testing.assert_close(out.double(), want, **TOLERANCES[dtype])
    assert out_full[:, hidden:].isnan().all(), "layer_norm wrote outside the out view"
    y = x.clone()
    ops.layer_norm(y, y, w, None, EPS)
    assert torch.equal(y, out), "in place differs from out of place"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_weight_and_bias_round_once(dtype):
    """fp32 weight and bias apply before the one rounding: within half an ulp of fp64."""
    x = make_rows(5, 33, dtype)
    w, b = make_weight(33, torch.float32), make_bias(33, torch.float32)
    want = reference.layer_norm(x, w, b, EPS)
    assert (run(x, w, b).double() - want).abs().max() <= 0.51 * _ulp(want, dtype).max()


def test_batched_equals_per_row():
    x, w = make_rows(13, 65, torch.bfloat16), make_weight(65, torch.bfloat16)
    batched = run(x, w, None)
    for t in range(x.size(0)):
        assert torch.equal(run(x[t:t + 1], w, None), batched[t:t + 1]), f"row {t}"


def test_constant_row_and_epsilon():
    """A constant row has no variance: the output is the bias (epsilon keeps it finite)."""
    x = torch.full((2, 8), 3.0)
    x[1] = torch.arange(8.0) * 1e-3
    w, b = torch.ones(8), torch.arange(8.0)
    out = run(x, w, b, 1e-2)
    assert torch.equal(out[0], b)
    torch.testing.assert_close(out.double(), reference.layer_norm(x, w, b, 1e-2))


@pytest.mark.parametrize(
    "make_args, match",
    [
        (lambda: (torch.empty(4, 8), torch.randn(4, 8), torch.ones(8).bfloat16(), None), "dtype"),
        (lambda: (torch.empty(4, 8), torch.randn(4, 8), torch.ones(7), None), "weight"),
        (lambda: (torch.empty(4, 8), torch.randn(4, 8), torch.ones(8), torch.ones(7)), "bias"),
        (lambda: (torch.empty(4, 8).half(), torch.randn(4, 8).half(), torch.ones(8),
                  torch.ones(8).bfloat16()), "bias"),
        (lambda: (torch.empty(4, 7), torch.randn(4, 8), torch.ones(8), None), "shape"),
        (lambda: (torch.empty(4, 8).half(), torch.randn(4, 8), torch.ones(8), None), "dtype"),
        (lambda: (torch.empty(2, 4, 8), torch.randn(2, 4, 8), torch.ones(8), None), "dimensions"),
        (lambda: (torch.empty(8, 4).t(), torch.randn(8, 4).t(), torch.ones(8), None),
         "contiguous"),
        (lambda: (torch.empty(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32),
                  torch.ones(8, dtype=torch.int32), None), "dtype"),
    ],
)
def test_rejects_bad_arguments(make_args, match):
    out, x, w, b = make_args()
    with pytest.raises(RuntimeError, match=match):
        ops.layer_norm(out, x, w, b, EPS)


# ------------------------------------------------------------------ every CPU capability variant


def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for dtype in DTYPES:
        for hidden in (7, 33, 4095):
            test_layer_norm(5, hidden, dtype, True)
        test_strided_rows_and_in_place(33, dtype)
    test_fp32_weight_and_bias_round_once(torch.bfloat16)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)
