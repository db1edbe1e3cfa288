"""llm_int8_linear (LLM.int8(): outlier activations in floating point, the rest int8 x int8) against
the reference decomposition in kvserve.testing.reference, in every dtype and CPU capability, with
sizes around the kernel's blocks (32 / 64 inputs per vector, 4 tokens x 2 rows; on AMX, tiles of
16 rows x 16 tokens x 64 inputs); and the point of
the method: with outliers in the activations it stays close to the float product where plain
per-token int8 (threshold 0) does not."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.quantization import quantize_int8
from kvserve.testing import reference
from tests.kernels.capability import ALL_CAPABILITIES, check_variant

ops = torch.ops.kvserve

# The integer part is exact on both sides; the rest is fp32 scaling (and the outliers'
# fp32 product) against fp64, then one rounding to the dtype.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}
TOKENS = [1, 3, 4, 5, 9, 16, 37]
# (n, k): a single row and input, tails past whole vectors and blocks of rows, and (k a multiple
# of 64) whole tiles with rows past them
SHAPES = [(1, 1), (2, 16), (3, 45), (5, 64), (7, 100), (6, 130), (33, 257), (64, 512), (9, 1000),
          (16, 64), (53, 192)]


def operands(m, n, k, dtype, outlier_columns=(), bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = quantize_int8(torch.randn(n, k, generator=g) / k ** 0.5)
    x = torch.randn(m, k + 3, generator=g)[:, :k]  # strided rows
    for j in outlier_columns:
        if j < k:
            x[:, j] *= 12.0
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x.to(dtype), w.qweight, w.scales.view(-1).contiguous(), b


def check(x, weight, scales, threshold, b):
    out = ops.llm_int8_linear(x, weight, scales, threshold, b)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], weight.shape[0])
    want = reference.llm_int8_linear(x, weight, scales, threshold, b)
    torch.testing.assert_close(out.double(), want, **TOLERANCES[x.dtype])
    return out


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", TOKENS)
def test_matches_reference(m, n, k, dtype):
    x, w, s, b = operands(m, n, k, dtype, outlier_columns=(0, 7, 40), bias=True)
    for threshold in (6.0, 0.0):
        check(x, w, s, threshold, b)


def test_outlier_columns_keep_the_product_close():
    """With a few activation columns ~20x larger (as in large language models), LLM.int8() stays
    near the float product, and per-token int8 of every column does not."""
    x, w, s, _ = operands(8, 64, 512, torch.float32, outlier_columns=(3, 100, 300))
    exact = x.double() @ (w.double() * s.double()[:, None]).T
    error = {t: (check(x, w, s, t, None).double() - exact).abs().max().item() for t in (6.0, 0.0)}
    assert error[6.0] < 0.04 and error[0.0] > 3 * error[6.0], error


@pytest.mark.parametrize("m, n, k", [(6, 33, 257), (40, 53, 192)])
def test_a_token_does_not_depend_on_its_batch(m, n, k):
    """Outliers are chosen per token: each row equals the same token run alone, bit for bit (k =
    192: AMX tiles for the first 48 rows where the CPU has them, the vector rows for the rest)."""
    x, w, s, b = operands(m, n, k, torch.float32, outlier_columns=(0, 40), bias=True)
    x = x.clone()
    x[2, 100] = 9.0  # an outlier in one token only
    batched = ops.llm_int8_linear(x, w, s, 6.0, b)
    for t in range(m):
        assert torch.equal(ops.llm_int8_linear(x[t:t + 1], w, s, 6.0, b)[0], batched[t])


def test_threshold_edges():
    x = torch.tensor([[6.0, 1.0, -2.0, 0.5], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    w = torch.tensor([[1, -2, 3, 127], [-127, 5, 0, 1]], dtype=torch.int8)
    s = torch.tensor([0.5, 0.25])
    check(x, w, s, 6.0, None)  # column 0 reaches the threshold: it is an outlier (>=)
    check(x, w, s, float("inf"), None)  # no outliers
    check(x, w, s, 0.9, None)  # row 2 keeps no inlier: scale 0
    out = ops.llm_int8_linear(x, w, s, 6.0, None)
    assert torch.equal(out[1], torch.zeros(2))


@pytest.mark.parametrize("m, n, k", [(4, 5, 1000), (20, 37, 1024)])
def test_extreme_products_stay_exact(m, n, k):
    """Weights of -128 (|w| = 128 as the unsigned operand) and 127 against inputs that round to
    +-127: the largest products and pair sums the integer dot products take, exact in int32."""
    g = torch.Generator().manual_seed(3)
    w = torch.where(torch.rand(n, k, generator=g) < 0.5, -128, 127).to(torch.int8)
    x = torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
    s = torch.full((n,), 1e-3)
    out = ops.llm_int8_linear(x, w, s, 0.0, None)
    integer = (x.round().long() * 127) @ w.long().T  # every input rounds to +-127
    want = integer.double() * (1.0 / 127.0) * 1e-3
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("m, n, k", [(3, 33, 257), (20, 40, 256)])
def test_a_non_finite_token_is_nan_and_leaves_the_others(m, n, k):
    x, w, s, _ = operands(m, n, k, torch.float32)
    for bad_value in (float("nan"), float("inf")):
        x_bad = x.clone()
        x_bad[1, 100] = bad_value
        out = ops.llm_int8_linear(x_bad, w, s, 0.0, None)
        assert out[1].isnan().all()
        others = [t for t in range(m) if t != 1]
        want = torch.stack([ops.llm_int8_linear(x[t:t + 1], w, s, 0.0, None)[0] for t in others])
        assert torch.equal(out[others], want)


def test_empty_batch():
    out = ops.llm_int8_linear(torch.empty(0, 8), torch.zeros(3, 8, dtype=torch.int8),
                              torch.ones(3), 6.0, None)
    assert out.shape == (0, 3)


def bad(x=None, w=None, s=None, b=None):
    x = torch.randn(2, 8) if x is None else x
    w = torch.zeros(3, 8, dtype=torch.int8) if w is None else w
    s = torch.ones(3) if s is None else s
    return x, w, s, 6.0, b


@pytest.mark.parametrize("args, match", [
    (bad(w=torch.zeros(3, 8)), "weight must be Char"),
    (bad(w=torch.zeros(3, 9, dtype=torch.int8)), "weight must be"),
    (bad(s=torch.ones(4)), "weight_scales must be"),
    (bad(s=torch.ones(3, dtype=torch.float16)), "weight_scales must be Float"),
    (bad(x=torch.randn(2, 8, dtype=torch.float64)), "fp32, bf16 or fp16"),
    (bad(b=torch.ones(3, dtype=torch.bfloat16)), "bias must be"),
], ids=["weight-dtype", "weight-shape", "scales-shape", "scales-dtype", "input-dtype", "bias"])
def test_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        ops.llm_int8_linear(*args)


# ------------------------------------------------------------------ every CPU capability variant


def capability_checks():
    for dtype in TOLERANCES:
        for m in (1, 5, 20):
            for n, k in [(3, 45), (6, 130), (33, 257), (53, 192)]:
                x, w, s, b = operands(m, n, k, dtype, outlier_columns=(0, 40), bias=True)
                check(x, w, s, 6.0, b)
                check(x, w, s, 0.0, b)
    for m, n, k in [(4, 5, 1000), (20, 37, 1024)]:
        test_extreme_products_stay_exact(m, n, k)
    for m, n, k in [(3, 33, 257), (20, 40, 256)]:
        test_a_non_finite_token_is_nan_and_leaves_the_others(m, n, k)


# The VNNI variants too (vpdpbusd): tests/kernels/capability.py.
CPU_CAPABILITIES = ALL_CAPABILITIES


@pytest.mark.parametrize("capability", CPU_CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)


# --------------------------------------------- CUDA: against the reference and the CPU op

# Past 16 tokens the integer product runs cuBLAS's int8 GEMM where k and n are multiples of 8.
CUDA_TOKENS = TOKENS + [40]


def on_cuda(t):
    """t on the GPU with its strides kept (a row-strided view stays row-strided); None stays."""
    if t is None:
        return None
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda").copy_(t)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", CUDA_TOKENS)
def test_cuda_matches_reference_and_cpu(m, n, k, dtype):
    x, w, s, b = operands(m, n, k, dtype, outlier_columns=(0, 7, 40), bias=True)
    for threshold in (6.0, 0.0):
        out = ops.llm_int8_linear(on_cuda(x), w.cuda(), s.cuda(), threshold, b.cuda())
        assert out.is_cuda and out.dtype == dtype and out.shape == (m, n)
        out = out.cpu()
        want = reference.llm_int8_linear(x, w, s, threshold, b)
        torch.testing.assert_close(out.double(), want, **TOLERANCES[dtype])
        cpu = ops.llm_int8_linear(x, w, s, threshold, b)
        torch.testing.assert_close(out, cpu, **TOLERANCES[dtype])


@pytest.mark.cuda
def test_cuda_a_token_does_not_depend_on_its_batch():
    """Bit for bit, whether the batch takes the GEMV (one token) or cuBLAS (40 tokens)."""
    x, w, s, b = operands(40, 64, 512, torch.float32, outlier_columns=(0, 40), bias=True)
    x, w, s, b = on_cuda(x.clone()), w.cuda(), s.cuda(), b.cuda()
    x[2, 100] = 9.0  # an outlier in one token only
    batched = ops.llm_int8_linear(x, w, s, 6.0, b)
    for t in (0, 2, 39):
        assert torch.equal(ops.llm_int8_linear(x[t:t + 1], w, s, 6.0, b)[0], batched[t])


@pytest.mark.cuda
def test_cuda_bad_arguments():
    x, w, s, _, b = bad()
    with pytest.raises(RuntimeError, match="weight must be Char"):
        ops.llm_int8_linear(x.cuda(), w.float().cuda(), s.cuda(), 6.0, b)
