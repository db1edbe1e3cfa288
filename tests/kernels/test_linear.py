"""linear (the GEMV paths for a few tokens on the plain and on the packed weight, oneDNN's GEMM on
the packed weight, the plain GEMM, and fp32 GEMMs on converted rows where the CPU has no bf16 /
fp16 GEMM) and linear_gather_rows against an fp64 matmul / indexing."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant

ops = torch.ops.kvserve

# fp32 accumulation over k terms; bf16/fp16 outputs are one rounding of the fp32 sum.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
SHAPES = [(1, 1), (7, 5), (33, 16), (64, 100), (130, 257), (96, 1024)]  # (n, k)
TOKENS = [1, 2, 3, 4, 5, 8, 9, 33]  # <= 8 (<= 32 bf16 / fp16 without a GEMM) GEMV
# Packed: the GEMV up to 16 tokens in fp32 on AVX-512, in register blocks of 1..8 tokens (one or
# more passes over each block of outputs), else up to 4 over 4 MiB; oneDNN beyond. bf16 up to 8
# (2 over 4 MiB).
PACKED_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 33, 300]
PACKABLE = [torch.float32, torch.bfloat16]  # oneDNN packs these on CPU


def operands(m, n, k, dtype, bias, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + pad, generator=g).to(dtype)[:, :k]
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(m, n, k, dtype, bias):
    x, w, b = operands(m, n, k, dtype, bias)
    out = ops.linear(x, w, b)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.double(), reference.linear(x, w, b), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", PACKABLE)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", PACKED_TOKENS)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weight_matches_reference(m, n, k, dtype, bias):
    x, w, b = operands(m, n, k, dtype, bias, pad=3)  # strided rows
    packed = ops.linear_prepack(w)
    if packed is None:  # oneDNN's layout here is not one the GEMV reads (n = 1: a plain row)
        packed = w
    else:
        assert packed.is_mkldnn and packed.shape == w.shape
    out = ops.linear(x, packed, b)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.double(), reference.linear(x, w, b), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", PACKABLE)
@pytest.mark.parametrize("m", [2, 3, 4, 5, 8, 9, 16, 17])
def test_packed_big_weight_on_both_sides_of_the_gemv_limit(m, dtype):
    """Packed fp32 weights go to oneDNN from 17 tokens on with AVX-512 (from 5 over 4 MiB
    without); bf16 ones over 4 MiB from 3 (smaller ones keep the GEMV up to 8)."""
    x, w, b = operands(m, 2304, 1024 if dtype == torch.float32 else 2048, dtype, True)
    assert w.nbytes > 4 << 20
    packed = ops.linear_prepack(w)  # None where the CPU has no packed layout for the dtype
    out = ops.linear(x, w if packed is None else packed, b)
    torch.testing.assert_close(out.double(), reference.linear(x, w, b), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", PACKABLE)
@pytest.mark.parametrize("n, k", SHAPES + [(64, 64), (200, 3), (1000, 333)])
def test_gather_rows_of_plain_and_packed_weights(n, k, dtype):
    """A tied embedding's lookup reads the LM head's packed weight: rows must be exact."""
    _, w, _ = operands(1, n, k, dtype, False)
    ids = torch.tensor([0, n - 1, n // 2, (7 * n) // 9, 0], dtype=torch.long)
    assert torch.equal(ops.linear_gather_rows(w, ids), w[ids])
    packed = ops.linear_prepack(w)
    if packed is not None:
        assert torch.equal(ops.linear_gather_rows(packed, ids), w[ids])
        with pytest.raises(RuntimeError, match="outside"):
            ops.linear_gather_rows(packed, torch.tensor([n]))


def test_prepack_without_a_packed_layout():
    assert ops.linear_prepack(torch.randn(8, 4).half()) is None  # fp16: the plain GEMM
    x, w, b = operands(5, 8, 4, torch.float16, True)
    torch.testing.assert_close(ops.linear(x, w, b).double(), reference.linear(x, w, b),
                               **TOLERANCES[torch.float16])


def test_packed_weight_must_match_the_input():
    x, w, _ = operands(4, 8, 16, torch.float32, False)
    with pytest.raises(RuntimeError, match="weight must be \\[out, 16\\]"):
        ops.linear(x, ops.linear_prepack(w[:, :8].contiguous()), None)
    packed_bf16 = ops.linear_prepack(w.bfloat16())  # None without a bf16 packed layout
    with pytest.raises(RuntimeError, match="dtype"):
        ops.linear(x, w.bfloat16() if packed_bf16 is None else packed_bf16, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_input_rows(dtype):
    x, w, b = operands(6, 70, 90, dtype, True, pad=11)
    assert not x.is_contiguous()
    torch.testing.assert_close(ops.linear(x, w, b).double(), reference.linear(x, w, b),
                               **TOLERANCES[dtype])


# cuBLAS picks its kernel (and so its summation order) by shape: on CUDA a row's bits may change
# with the batch, as in torch.
@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_independence(dtype):
    x, w, b = operands(6, 70, 90, dtype, True, pad=11)
    batched = ops.linear(x, w, b)
    for t in range(6):  # a row's result must not depend on the others in its token block
        torch.testing.assert_close(ops.linear(x[t:t + 1], w, b), batched[t:t + 1], rtol=0, atol=0)


def test_bad_arguments():
    x, w, _ = operands(2, 8, 16, torch.float32, False)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.linear(x, w[:, :15], None)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.linear(x, w.double(), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.linear(x, w, torch.zeros(7))


def capability_checks():
    for dtype in TOLERANCES:
        for m in (1, 3, 4, 6):
            x, w, b = operands(m, 37, 130, dtype, True, seed=m)
            torch.testing.assert_close(ops.linear(x, w, b).double(), reference.linear(x, w, b),
                                       **TOLERANCES[dtype])
    for dtype in PACKABLE:  # the packed GEMV is compiled per capability too
        for m in (1, 3, 4, 6, 7, 9, 16):
            for n, k in ((37, 131), (130, 64)):
                x, w, b = operands(m, n, k, dtype, True, seed=m)
                packed = ops.linear_prepack(w)
                torch.testing.assert_close(ops.linear(x, w if packed is None else packed, b).double(),
                                           reference.linear(x, w, b), **TOLERANCES[dtype])


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)
