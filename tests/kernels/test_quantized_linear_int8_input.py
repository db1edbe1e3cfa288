"""quantized_linear with quantize_input (int8 and int4 weights, the input rounded to int8 blocks
of 32 and multiplied in integers on the CPU, llama.cpp's Q8_0 activations) against the
reference's block rounding written out and an fp64 product on the rounded input; the rounding
itself exactly, ties, empty and non-finite blocks included."""

import os
import subprocess
import sys
import tempfile

import pytest
import torch

import kvserve  # registers torch.ops.kvserve
from kvserve.quantization import quantize_int4, quantize_int8
from kvserve.testing import reference
from tests.kernels.capability import ALL_CAPABILITIES, check_variant

ops = torch.ops.kvserve

# The reference rounds the input exactly as the op does, so what is left is fp32 accumulation
# (and one rounding of the output to bf16 / fp16).
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}
# Up to 32 tokens run the vector integer kernels (blocks of up to 4 tokens: 6 is a block of 4 and
# one of 2); 40 rounds the input and takes the GEMM. With AMX, groups of whole blocks of 32 run
# in tiles at any count from 8 tokens (int8) or 16 (int4): 17 and 40 end in a part of a 16-token
# tile, 70 in a lone one after pairs.
TOKENS = [1, 3, 6, 17, 32, 40, 70]
# (format, n, k, group_size): per row and grouped; int8 groups that are not multiples of 32 end
# in a short block (groups of 16, GGUF's Q6_K, run four at a time on AVX-512, then two; an odd
# count ends in one).
CASES = [
    ("int8", 1, 1, 1), ("int8", 7, 45, 45), ("int8", 33, 96, 48), ("int8", 130, 100, 100),
    ("int8", 64, 256, 32), ("int8", 21, 192, 64), ("int8", 19, 2048, 2048), ("int8", 9, 48, 16),
    ("int8", 33, 256, 16), ("int8", 5, 112, 16), ("int8", 12, 352, 16),
    # AVX-512 takes int8 rows two blocks a load where they pair up within groups (or are groups
    # of their own); an odd count of one-block groups, or groups of an odd count, one at a time.
    ("int8", 10, 96, 32), ("int8", 11, 192, 96),
    ("int4", 1, 32, 32), ("int4", 7, 96, 32), ("int4", 33, 128, 64), ("int4", 130, 256, 128),
    ("int4", 17, 160, 160), ("int4", 9, 288, 96), ("int4", 5, 768, 384),
    # AVX-512 takes int4 rows four blocks at a time where k is a multiple of 128 (groups of 32
    # or of a multiple of 128), two rows at once from two tokens on (an odd count ends in one),
    # two accumulators in turn (an odd number of fours); other k a pair at a time as AVX2 does.
    ("int4", 11, 224, 32), ("int4", 6, 512, 32), ("int4", 13, 384, 32), ("int4", 7, 640, 128),
]


def quantized(fmt, n, k, group_size, seed=0, zeros=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    if fmt == "int8":
        return quantize_int8(w, group_size)
    q = quantize_int4(w, group_size)
    return q if zeros else type(q)(q.qweight, q.scales, None, group_size)


def half_params(q):
    """q with fp16 scales and zeros, as AWQ, GPTQ and GGUF files store them."""
    return type(q)(q.qweight, q.scales.half(), None if q.zeros is None else q.zeros.half(),
                   q.group_size)


def one_zero(q, value):
    """q with a single zero for every row and group, in its scales' dtype (llama.cpp's Q4_0)."""
    return type(q)(q.qweight, q.scales, torch.tensor([value], dtype=q.scales.dtype),
                   q.group_size)


def operands(m, k, n, dtype, bias, seed=0, pad=0):
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(m, k + pad, generator=g) * torch.rand(m, k + pad, generator=g) * 4)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x.to(dtype)[:, :k], b


def check(q, x, b, dtype):
    out = ops.quantized_linear(x, q.qweight, q.scales, q.zeros, q.group_size, b, True)
    assert out.dtype == dtype and out.shape == (x.shape[0], q.shape[0])
    expected = reference.quantized_linear(x, q.qweight, q.scales, q.zeros, q.group_size, b,
                                          quantize_input=True)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("fmt, n, k, group_size", CASES)
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_input_matches_reference(fmt, n, k, group_size, m, dtype, bias):
    x, b = operands(m, k, n, dtype, bias, pad=3)  # strided rows
    check(quantized(fmt, n, k, group_size), x, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt, n, k, group_size", CASES)
@pytest.mark.parametrize("m", [1, 5, 40])
def test_fp16_scales_and_zeros(fmt, n, k, group_size, m, dtype):
    """fp16 scales and zeros (GGUF's Q8_0 and Q4_0, AWQ's), widened a row at a time."""
    x, b = operands(m, k, n, dtype, True, pad=3)
    check(half_params(quantized(fmt, n, k, group_size)), x, b, dtype)


@pytest.mark.parametrize("m", [1, 6, 40])
def test_int4_without_zeros_and_with_fractional_zeros(m):
    """Symmetric int4 (GPTQ's sym), and zeros that are not integers (Q4_1-style minimums)."""
    q = quantized("int4", 40, 128, 32, zeros=False)
    x, b = operands(m, 128, 40, torch.float32, True)
    check(q, x, b, torch.float32)
    q = quantized("int4", 40, 128, 32)
    q.zeros = q.zeros + 0.375
    check(q, x, b, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt, n, k, group_size", CASES)
@pytest.mark.parametrize("m", TOKENS)
def test_one_zero_for_every_row_and_group(fmt, n, k, group_size, m, dtype):
    """zeros [1] (Q4_0's 8), fp32 and fp16, through every row kernel and token block."""
    x, b = operands(m, k, n, dtype, True, pad=3)
    q = quantized(fmt, n, k, group_size)
    check(one_zero(q, 8.0 if fmt == "int4" else -1.5), x, b, dtype)
    check(one_zero(half_params(q), 7.25), x, b, dtype)


@pytest.mark.parametrize("group_size", [64, 16])
def test_int8_extremes_do_not_saturate(group_size):
    """Weights of -128 and 127 against inputs of +-127 (the largest int16 pair sums of
    maddubs) give the exact integer products, per row and in groups of 16."""
    k = 192
    w = torch.full((4, k), 127, dtype=torch.int8)
    w[1] = -128
    w[2, ::2] = -128
    w[3, 1::2] = -128
    x = torch.full((2, k), 1.0)
    x[1, ::2] = -1.0
    scales = torch.ones(4, k // group_size)
    out = ops.quantized_linear(x, w, scales, None, group_size, None, True)
    exact = (x.double() @ w.double().T)  # x rounds to +-127 with d = 1 / 127
    torch.testing.assert_close(out.double(), exact, atol=1e-4, rtol=1e-6)


@pytest.mark.cpu_only
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("k, group_size", [(64, 32), (90, 45), (96, 96)])
def test_rounding_is_exactly_the_contracts(m, k, group_size):
    """An identity weight returns the rounded input itself: ties round half to even and an
    all-zero block stays zero; a block with a NaN or an infinity makes the token's outputs NaN
    (each reads every input, as in the exact product)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :8] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, 126.5])  # max 127: d = 1
    x[0, 8:group_size] = 0.25
    if m > 1:
        x[1, :group_size] = 0.0
        x[-1, group_size:] = torch.tensor([float("nan"), float("inf")]).repeat(k)[:k - group_size]
    eye = torch.eye(k, dtype=torch.int8)
    out = ops.quantized_linear(x, eye, torch.ones(k, k // group_size), None, group_size, None,
                               True)
    expected = reference.round_input_to_int8_blocks(x, group_size)
    finite = m - 1 if m > 1 and k > group_size else m
    assert torch.equal(out[:finite], expected[:finite])
    assert out[0, :8].tolist() == [127.0, 2.0, 4.0, -2.0, -0.0, 0.0, 2.0, 126.0]
    if m > 1:
        assert not out[1, :group_size].any()
    if finite < m:
        assert out[-1].isnan().all()
        assert expected[-1, group_size:min(k, group_size + 32)].isnan().all()
        assert not expected[-1, :group_size].isnan().any()


def test_error_against_the_exact_product_is_the_rounding():
    """The integer path differs from the exact one by about the input's rounding: well under
    1% of the output's scale for Gaussian inputs, and it is not the exact product."""
    q = quantized("int4", 256, 1024, 32)
    x, _ = operands(4, 1024, 256, torch.float32, False)
    exact = ops.quantized_linear(x, q.qweight, q.scales, q.zeros, 32, None)
    rounded = ops.quantized_linear(x, q.qweight, q.scales, q.zeros, 32, None, True)
    error = (rounded - exact).abs().max() / exact.abs().max()
    assert 0 < error < 1e-2


def test_bad_arguments():
    f = torch.randn(8, 64).to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="quantize_input takes int8 or int4"):
        ops.quantized_linear(torch.randn(2, 64), f, torch.ones(8, 1), None, 64, None, True)


def capability_checks():
    for dtype in TOLERANCES:
        for fmt, n, k, group_size in (("int8", 37, 100, 50), ("int8", 37, 128, 64),
                                      ("int8", 37, 256, 32), ("int8", 37, 96, 32),
                                      ("int8", 37, 192, 96), ("int8", 37, 2048, 2048),
                                      ("int8", 37, 80, 16), ("int8", 37, 224, 16),
                                      ("int4", 37, 128, 32), ("int4", 37, 256, 128),
                                      ("int4", 37, 224, 32)):
            for m in (1, 2, 3, 5, 9, 40):
                x, b = operands(m, k, n, dtype, True, seed=m)
                check(quantized(fmt, n, k, group_size, seed=m), x, b, dtype)
                check(half_params(quantized(fmt, n, k, group_size, seed=m)), x, b, dtype)
                check(one_zero(half_params(quantized(fmt, n, k, group_size, seed=m)), 8.0),
                      x, b, dtype)
    for group_size in (64, 16):
        test_int8_extremes_do_not_saturate(group_size)
    for m in (1, 5):
        test_rounding_is_exactly_the_contracts(m, 90, 45)


def test_prefetch_hint_changes_no_result():
    """KVSERVE_CPU_PREFETCH (how the kernels ask for weight lines ahead) changes no output bit:
    each hint in a process of its own, the vector rows (5 tokens) and, with AMX, the tiles (17);
    an unknown name keeps the CPU's default."""
    script = (
        "import sys, torch, kvserve\n"
        "from kvserve.quantization import quantize_int4, quantize_int8\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w = torch.randn(100, 256, generator=g)\n"
        "outs = []\n"
        "for m in (5, 17):\n"
        "    x = torch.randn(m, 256, generator=g).bfloat16()\n"
        "    outs += [torch.ops.kvserve.quantized_linear(x, q.qweight, q.scales, q.zeros,\n"
        "             q.group_size, None, True) for q in (quantize_int8(w), quantize_int4(w, 32))]\n"
        "    outs.append(torch.ops.kvserve.llm_int8_linear(x, quantize_int8(w).qweight,\n"
        "                quantize_int8(w).scales.view(-1), 0.0, None))\n"
        "torch.save(outs, sys.argv[1])\n"
        "print('prefetch=' + kvserve._C.cpu_prefetch())\n")
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for hint in ("nta", "t1", "bogus"):
            path = f"{tmp}/{hint}.pt"
            env = {**os.environ, "KVSERVE_CPU_PREFETCH": hint, "OMP_NUM_THREADS": "1"}
            run = subprocess.run([sys.executable, "-c", script, path], env=env, text=True,
                                 capture_output=True, timeout=300)
            assert run.returncode == 0, run.stderr
            shown = run.stdout.strip().rpartition("prefetch=")[2]
            assert shown == (kvserve._C.cpu_prefetch() if hint == "bogus" else hint)
            results[hint] = torch.load(path)
    for outs in results.values():
        for got, want in zip(outs, results["t1"]):
            assert torch.equal(got, want)


# The VNNI variants too (vpdpbusd / vpdpwssd): tests/kernels/capability.py.
CPU_CAPABILITIES = ALL_CAPABILITIES


@pytest.mark.parametrize("capability", CPU_CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)
