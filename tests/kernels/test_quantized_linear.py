"""quantized_linear (int8, int4 and fp8 E4M3 weights; the GEMV for a few tokens, on CUDA tensor
cores on the packed weight for bf16 / fp16 inputs, and the dequantize-then-GEMM path for more)
against an fp64 matmul on the weight the contract defines, read by the reference's own
unpacking; the packers against hand-made bytes."""

import pytest
import torch

import kvserve  # registers torch.ops.kvserve
from kvserve.quantization import pack_int4, quantize_fp8, quantize_int4, quantize_int8, unpack_int4
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant

ops = torch.ops.kvserve

# fp32 accumulation over k terms; bf16/fp16 outputs are one rounding of the fp32 sum (and, past
# the GEMV, of the weight rounded to the input dtype for the GEMM).
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}
# The GEMV (blocks of up to 4 tokens) takes <= 8 tokens, and <= 32 of bf16 / fp16 on a CPU
# without a GEMM for them; more dequantize for a GEMM (in fp32 on such a CPU).
TOKENS = [1, 3, 9, 40]
# (format, n, k, group_size): per-row and grouped, groups that are and are not multiples of 32
CASES = [
    ("int8", 1, 1, 1), ("int8", 7, 45, 45), ("int8", 33, 96, 48), ("int8", 130, 100, 100),
    ("int8", 64, 256, 32),
    ("int4", 1, 32, 32), ("int4", 7, 96, 32), ("int4", 33, 128, 64), ("int4", 130, 256, 128),
    ("int4", 17, 160, 160),
    ("fp8", 1, 3, 3), ("fp8", 7, 45, 45), ("fp8", 33, 96, 96), ("fp8", 130, 257, 257),
]


def quantized(fmt, n, k, group_size, seed=0, zeros=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    if fmt == "int8":
        return quantize_int8(w, group_size)
    if fmt == "int4":
        q = quantize_int4(w, group_size)
        return q if zeros else type(q)(q.qweight, q.scales, None, group_size)
    return quantize_fp8(w)


def half_params(q):
    """q with fp16 scales and zeros, as AWQ, GPTQ and GGUF files store them."""
    return type(q)(q.qweight, q.scales.half(), None if q.zeros is None else q.zeros.half(),
                   q.group_size)


def one_zero(q, value):
    """q with a single zero for every row and group, in its scales' dtype (llama.cpp's Q4_0 and
    GPTQ's sym=True store 8 for int4)."""
    return type(q)(q.qweight, q.scales, torch.tensor([value], dtype=q.scales.dtype),
                   q.group_size)


def operands(m, k, n, dtype, bias, seed=0, pad=0):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k + pad, generator=g).to(dtype)[:, :k]
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, b


def check(q, x, b, dtype):
    out = ops.quantized_linear(x, q.qweight, q.scales, q.zeros, q.group_size, b)
    assert out.dtype == dtype and out.shape == (x.shape[0], q.shape[0])
    expected = reference.quantized_linear(x, q.qweight, q.scales, q.zeros, q.group_size, b)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("fmt, n, k, group_size", CASES)
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_matches_reference(fmt, n, k, group_size, m, dtype, bias):
    x, b = operands(m, k, n, dtype, bias, pad=3)  # strided rows
    check(quantized(fmt, n, k, group_size), x, b, dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("fmt, n, k, group_size", CASES)
@pytest.mark.parametrize("m", [1, 9, 40])
def test_fp16_scales_and_zeros(fmt, n, k, group_size, m, dtype):
    """fp16 scales and zeros, read as they are (GEMV) and widened per row (dequantize)."""
    x, b = operands(m, k, n, dtype, True, pad=3)
    check(half_params(quantized(fmt, n, k, group_size)), x, b, dtype)


@pytest.mark.parametrize("m", [1, 2, 9])
def test_int4_without_zeros_and_with_fractional_zeros(m):
    """Symmetric int4 (GPTQ's sym: no zeros) and zeros that are not integers."""
    q = quantized("int4", 40, 128, 32, zeros=False)
    x, b = operands(m, 128, 40, torch.float32, True)
    check(q, x, b, torch.float32)
    q = quantized("int4", 40, 128, 32)
    q.zeros = q.zeros + 0.375
    check(q, x, b, torch.float32)
    check(half_params(q), x, b, torch.float32)
    check(half_params(quantized("int4", 40, 128, 32, zeros=False)), x, b, torch.float32)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("fmt, n, k, group_size", [c for c in CASES if c[0] != "fp8"])
@pytest.mark.parametrize("m", TOKENS)
def test_one_zero_for_every_row_and_group(fmt, n, k, group_size, m, dtype):
    """zeros [1]: the same zero for every row and group, fp32 and fp16 (GEMV and dequantize)."""
    x, b = operands(m, k, n, dtype, True, pad=3)
    q = quantized(fmt, n, k, group_size)
    check(one_zero(q, 8.0 if fmt == "int4" else -1.5), x, b, dtype)
    check(one_zero(half_params(q), 7.25), x, b, dtype)


@pytest.mark.parametrize("m", [1, 9])
def test_every_fp8_value_decodes_exactly(m):
    """Row r of the weight holds fp8 byte r (NaNs excluded) 32 times; a one-hot input reads it."""
    values = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    q = values.view(torch.float8_e4m3fn)[:, None].expand(-1, 32).contiguous()
    scales = torch.ones(len(values), 1)
    x = torch.zeros(m, 32)
    x[:, 5] = 1.0
    out = ops.quantized_linear(x, q, scales, None, 32, None)
    assert torch.equal(out[0], q[:, 0].float())  # subnormals and the largest, both signs


def test_int4_packing_against_hand_made_bytes():
    """Byte j of a 32-input chunk holds input j (low nibble) and input j + 16 (high nibble)."""
    q = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)
    q[0, 16:32] = 15 - q[0, 16:32]
    packed = pack_int4(q)
    assert packed.shape == (1, 32)
    assert packed[0, 0].item() == 0x00 | (15 << 4)  # inputs 0 and 16
    assert packed[0, 3].item() == 0x03 | (12 << 4)  # inputs 3 and 19
    assert packed[0, 16].item() == 0x00 | (0 << 4)  # inputs 32 and 48
    assert torch.equal(unpack_int4(packed), q)
    ones = torch.ones(1, 1)
    assert torch.equal(reference.quantized_weight(packed, ones, None, 64), q.double())


@pytest.mark.parametrize("fmt, group_size", [("int8", 64), ("int8", 256), ("int4", 32),
                                             ("int4", 128), ("fp8", 256)])
def test_quantizers_round_to_nearest(fmt, group_size):
    """The dequantized weight is within half a step of the original, and the extremes are exact
    (int8, fp8: max |w|; int4: the group's min and max up to the zero's rounding)."""
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(3))
    quantizers = {"int8": lambda: quantize_int8(w, group_size),
                  "int4": lambda: quantize_int4(w, group_size), "fp8": lambda: quantize_fp8(w)}
    q = quantizers[fmt]()
    back = q.dequantize()
    groups = 256 // q.group_size
    step = q.scales.repeat_interleave(q.group_size, dim=1)
    if fmt == "fp8":  # 3 mantissa bits: within 1/16 of the value (or the subnormal step)
        assert ((back - w).abs() <= (w.abs() / 16).clamp(min=step * 2 ** -9) + 1e-7).all()
    else:
        assert ((back - w).abs() <= step * (0.5 if fmt == "int8" else 1.0) + 1e-6).all()
    assert groups == q.scales.shape[1]
    torch.testing.assert_close(back, reference.quantized_weight(
        q.qweight, q.scales, q.zeros, q.group_size).float())


def test_bad_arguments():
    q = quantized("int4", 8, 64, 32)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.quantized_linear(x, q.qweight, q.scales, q.zeros, 16, None)
    with pytest.raises(RuntimeError, match="group_size must divide"):
        ops.quantized_linear(x, q.qweight, q.scales, q.zeros, 48, None)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.quantized_linear(x, q.qweight, q.scales[:, :1].contiguous(), q.zeros, 32, None)
    with pytest.raises(RuntimeError, match="qweight must be contiguous"):
        ops.quantized_linear(torch.randn(2, 96), q.qweight, q.scales, q.zeros, 32, None)
    with pytest.raises(RuntimeError, match="qweight must be int8"):
        ops.quantized_linear(x, q.qweight.short(), q.scales, q.zeros, 32, None)
    with pytest.raises(RuntimeError, match="scales must be fp32 or fp16"):
        ops.quantized_linear(x, q.qweight, q.scales.bfloat16(), q.zeros.bfloat16(), 32, None)
    with pytest.raises(RuntimeError, match="zeros must be Half"):  # the scales' dtype
        ops.quantized_linear(x, q.qweight, q.scales.half(), q.zeros, 32, None)
    for zeros in (torch.full((2,), 8.0), torch.full((1, 1), 8.0), q.zeros[:1].contiguous()):
        with pytest.raises(RuntimeError, match=r"zeros must be \[8, 2\].* or \[1\]"):
            ops.quantized_linear(x, q.qweight, q.scales, zeros, 32, None)
    f = quantized("fp8", 8, 64, 64)
    with pytest.raises(RuntimeError, match="take no zeros"):
        ops.quantized_linear(x, f.qweight, f.scales, torch.zeros(8, 1), 64, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.quantized_linear(x, f.qweight, f.scales, None, 64, torch.zeros(7))
    with pytest.raises(RuntimeError, match="input must be fp32"):
        ops.quantized_linear(x.double(), f.qweight, f.scales, None, 64, None)


def capability_checks():
    for dtype in TOLERANCES:
        for fmt, n, k, group_size in (("int8", 37, 100, 50), ("int4", 37, 128, 32),
                                      ("fp8", 37, 131, 131)):
            for m in (1, 2, 3, 5, 9):
                x, b = operands(m, k, n, dtype, True, seed=m)
                check(quantized(fmt, n, k, group_size, seed=m), x, b, dtype)
                check(half_params(quantized(fmt, n, k, group_size, seed=m)), x, b, dtype)
                if fmt != "fp8":
                    check(one_zero(half_params(quantized(fmt, n, k, group_size, seed=m)), 8.0),
                          x, b, dtype)
    test_every_fp8_value_decodes_exactly(1)
    test_every_fp8_value_decodes_exactly(9)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)


# --------------------------------------------- CUDA: against the reference and the CPU op


def on_cuda(t):
    """t on the GPU with its strides kept (a row-strided view stays row-strided); None stays."""
    if t is None:
        return None
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda").copy_(t)


def check_cuda(q, x, b, dtype):
    """The op on the GPU against the reference and against the CPU op on the same inputs."""
    out = ops.quantized_linear(on_cuda(x), on_cuda(q.qweight), on_cuda(q.scales),
                               on_cuda(q.zeros), q.group_size, on_cuda(b))
    assert out.is_cuda and out.dtype == dtype and out.shape == (x.shape[0], q.shape[0])
    out = out.cpu()
    expected = reference.quantized_linear(x, q.qweight, q.scales, q.zeros, q.group_size, b)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
    cpu = ops.quantized_linear(x, q.qweight, q.scales, q.zeros, q.group_size, b)
    torch.testing.assert_close(out, cpu, **TOLERANCES[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("fmt, n, k, group_size", CASES)
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_matches_reference_and_cpu(fmt, n, k, group_size, m, dtype, bias):
    x, b = operands(m, k, n, dtype, bias, pad=3)  # strided rows
    check_cuda(quantized(fmt, n, k, group_size), x, b, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("fmt, n, k, group_size", CASES)
@pytest.mark.parametrize("m", [1, 9, 40])
def test_cuda_fp16_scales_and_zeros(fmt, n, k, group_size, m, dtype):
    x, b = operands(m, k, n, dtype, True, pad=3)
    check_cuda(half_params(quantized(fmt, n, k, group_size)), x, b, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt, n, k, group_size", [c for c in CASES if c[0] != "fp8"])
@pytest.mark.parametrize("m", [1, 9, 40])
def test_cuda_one_zero_for_every_row_and_group(fmt, n, k, group_size, m):
    x, b = operands(m, k, n, torch.bfloat16, True, pad=3)
    q = quantized(fmt, n, k, group_size)
    check_cuda(one_zero(q, 8.0), x, b, torch.bfloat16)
    check_cuda(one_zero(half_params(q), 7.25), x, b, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 9])
def test_cuda_int4_without_zeros(m):
    x, b = operands(m, 128, 40, torch.float32, True)
    check_cuda(quantized("int4", 40, 128, 32, zeros=False), x, b, torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_weight_dequantized_in_several_blocks(dtype):
    """More output rows than one dequantized block holds (32 MiB of the input dtype)."""
    n, k = 4200, 4096
    x, b = operands(40, k, n, dtype, True)
    check_cuda(quantized("int8", n, k, k), x, b, dtype)


@pytest.fixture
def quantized_linear_kernel():
    """Sets the CUDA body for the test; auto again after it."""
    yield kvserve._C.set_cuda_quantized_linear_kernel
    kvserve._C.set_cuda_quantized_linear_kernel("auto")


def test_quantized_linear_kernel_choice_is_checked(quantized_linear_kernel):
    quantized_linear_kernel("mma")
    assert kvserve._C.cuda_quantized_linear_kernel() == "mma"
    with pytest.raises(ValueError, match="auto, mma, gemv, dequantize or wide"):
        quantized_linear_kernel("marlin")
    assert kvserve._C.cuda_quantized_linear_kernel() == "mma"


# Aligned for the 16-byte vectors (k and the groups whole vectors) that the tensor-core and
# vector bodies need: rows that fill no 16-row block, inputs that end inside a warp's 4 vectors,
# inputs that wrap the tensor-core pipeline (k 2560 / 5120: 40 blocks of 4 vectors over 8
# warps), groups smaller and larger than a warp's block of inputs.
ALIGNED_CASES = [
    ("int8", 33, 96, 48), ("int8", 130, 2560, 2560), ("int8", 64, 256, 32),
    ("int4", 7, 96, 32), ("int4", 33, 128, 64), ("int4", 130, 5120, 128), ("int4", 17, 160, 160),
    ("int4", 64, 768, 256), ("int4", 150, 384, 384),
    ("fp8", 33, 96, 96), ("fp8", 40, 2064, 2064),
]


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["auto", "mma", "wide", "gemv", "dequantize"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt, n, k, group_size", ALIGNED_CASES)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 17, 33, 64, 65, 130, 300])
@pytest.mark.parametrize("params", ["fp32", "fp16"])
def test_cuda_every_kernel_on_aligned_inputs(kernel, fmt, n, k, group_size, m, dtype, params,
                                             quantized_linear_kernel):
    """Rows 16 bytes apart (strided): every body applies, each against the reference, with
    fp32 and with fp16 scales and zeros."""
    quantized_linear_kernel(kernel)
    x, b = operands(m, k, n, dtype, True, pad=8)
    # Past the GEMV the weight is rounded to the input dtype: each output moves by up to
    # ~sqrt(k) such roundings, so the bound is norm-wise for long rows.
    q = quantized(fmt, n, k, group_size)
    q = half_params(q) if params == "fp16" else q
    out = ops.quantized_linear(on_cuda(x), on_cuda(q.qweight), on_cuda(q.scales),
                               on_cuda(q.zeros), q.group_size, on_cuda(b)).cpu().double()
    expected = reference.quantized_linear(x, q.qweight, q.scales, q.zeros, q.group_size, b)
    bound = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert (out - expected).norm() <= bound * expected.norm()
    torch.testing.assert_close(out, expected, atol=bound * expected.abs().max().item(), rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["mma", "wide", "gemv"])
@pytest.mark.parametrize("group_size", [32, 128])
def test_cuda_int4_symmetric_and_fractional_zeros_on_tensor_cores(kernel, group_size,
                                                                  quantized_linear_kernel):
    quantized_linear_kernel(kernel)
    x, b = operands(24, 512, 40, torch.bfloat16, True)
    check_cuda(quantized("int4", 40, 512, group_size, zeros=False), x, b, torch.bfloat16)
    q = quantized("int4", 40, 512, group_size)
    q.zeros = q.zeros + 0.375
    check_cuda(q, x, b, torch.bfloat16)
    check_cuda(half_params(q), x, b, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("m", [16, 64, 100])
def test_cuda_wide_kernel_adds_split_inputs_in_one_order(fmt, m, quantized_linear_kernel):
    """Few rows and long ones: the wide body splits the inputs among blocks, and the last block
    of a tile to finish adds the splits in split order, so every call gives the same bits."""
    quantized_linear_kernel("wide")
    x, b = operands(m, 8192, 200, torch.bfloat16, True)
    q = quantized(fmt, 200, 8192, 128)
    args = (on_cuda(x), on_cuda(q.qweight), on_cuda(q.scales), on_cuda(q.zeros), q.group_size,
            on_cuda(b))
    first = ops.quantized_linear(*args)
    for _ in range(4):
        assert torch.equal(ops.quantized_linear(*args), first)
    expected = reference.quantized_linear(x, q.qweight, q.scales, q.zeros, q.group_size, b)
    assert (first.cpu().double() - expected).norm() <= 1e-2 * expected.norm()


@pytest.mark.cuda
def test_cuda_bad_arguments():
    q = quantized("int8", 8, 64, 64)
    x = torch.randn(2, 64, device="cuda")
    with pytest.raises(RuntimeError, match="bias has dtype"):
        ops.quantized_linear(x, q.qweight.cuda(), q.scales.cuda(), None, 64,
                             torch.zeros(8, dtype=torch.bfloat16, device="cuda"))
