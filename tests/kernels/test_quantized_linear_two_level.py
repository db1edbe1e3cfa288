"""quantized_linear with two-level scales (GGUF's K-quants: int8 scales and minimums per group
under fp16 or fp32 factors per super-block), through the exact GEMV, the integer kernels
(quantize_input) and the dequantize-then-GEMM path, against the reference's fp64 reading of the
contract; groups whose scale is 0 and whose minimum is not included; QuantizedWeight.one_level
against the same numbers; every bad argument."""

import pytest
import torch

import kvserve  # registers torch.ops.kvserve
from kvserve.quantization import QuantizedWeight, pack_int4
from kvserve.testing import reference
from tests.kernels.capability import ALL_CAPABILITIES, check_variant

ops = torch.ops.kvserve

TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}
# The GEMV / integer kernels (blocks of up to 4 tokens) up to 8 / 32 tokens; 40 the GEMM.
TOKENS = [1, 3, 6, 9, 40]
# (format, n, k, group_size, groups a super-block, zeros): Q4_K's layout (int4, groups of 32,
# 8 a super-block, minimums), Q5_K's (int8 q in 0..31), Q6_K's (int8, groups of 16, 16 a
# super-block, no minimums), and awkward ones (super-blocks of one or two groups, groups of 48
# that end in a short block of 16, an odd number of groups of 16). The integer kernels widen
# the scales of int4 in groups of 32 and int8 in groups of 16 a step at a time where
# super-blocks are a power of two groups from 8 on (with minimums, without, 8 and 16 a
# super-block: the last three), the others' a row at a time first.
CASES = [
    ("int4", 1, 256, 32, 8, True), ("int4", 7, 512, 32, 8, True), ("int4", 33, 768, 32, 8, True),
    ("int8", 7, 256, 32, 8, True), ("int8", 130, 512, 16, 16, False), ("int8", 9, 48, 16, 3, False),
    ("int4", 5, 384, 64, 2, True), ("int4", 6, 128, 32, 1, False), ("int8", 11, 192, 48, 2, True),
    ("int8", 3, 80, 16, 5, True),
    ("int8", 5, 512, 16, 16, True), ("int4", 4, 1024, 32, 16, False), ("int8", 3, 256, 16, 8, True),
]


def two_level(fmt, n, k, group_size, per_super, zeros, seed=0, half=True):
    """A random two-level weight: K-quant-like integers, some groups with scale 0 (every input
    then the group's minimum)."""
    g = torch.Generator().manual_seed(seed)
    groups, supers = k // group_size, k // group_size // per_super
    if fmt == "int4":
        q = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    else:
        low, high = (0, 32) if zeros else (-32, 32)
        q = torch.randint(low, high, (n, k), generator=g).to(torch.int8)
    scale_range = (0, 64) if zeros else (-128, 128)
    scales = torch.randint(*scale_range, (n, groups), generator=g).to(torch.int8)
    scales.view(-1)[::7] = 0  # flat groups
    dtype = torch.float16 if half else torch.float32
    d = (torch.rand(n, supers, generator=g) * 2e-3 + 1e-4).to(dtype)
    if not zeros:
        return QuantizedWeight(q, scales, None, group_size, super_scales=d)
    mins = torch.randint(0, 64, (n, groups), generator=g).to(torch.int8)
    dmin = (torch.rand(n, supers, generator=g) * 2e-3).to(dtype)
    return QuantizedWeight(q, scales, mins, group_size, super_scales=d, super_mins=dmin)


def operands(m, k, n, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 4
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x.to(dtype), b


def check(q, x, b, dtype, quantize_input):
    out = ops.quantized_linear(x, q.qweight, q.scales, q.zeros, q.group_size, b, quantize_input,
                               q.super_scales, q.super_mins)
    assert out.dtype == dtype and out.shape == (x.shape[0], q.shape[0])
    expected = reference.quantized_linear(x, q.qweight, q.scales, q.zeros, q.group_size, b,
                                          quantize_input, q.super_scales, q.super_mins)
    # The outputs sum k products of ~1e-2 weights: scale the tolerance to the output's size.
    tol = dict(TOLERANCES[dtype])
    tol["atol"] *= max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(out.double(), expected, **tol)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("fmt, n, k, group_size, per_super, zeros", CASES)
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("quantize_input", [False, True])
def test_two_level_matches_reference(fmt, n, k, group_size, per_super, zeros, m, dtype,
                                     quantize_input):
    q = two_level(fmt, n, k, group_size, per_super, zeros, seed=m)
    x, b = operands(m, k, n, dtype, m % 2 == 1, seed=m)
    check(q, x, b, dtype, quantize_input)


@pytest.mark.parametrize("m", [1, 9])
def test_fp32_super_scales(m):
    for fmt, n, k, group_size, per_super, zeros in CASES[:5]:
        q = two_level(fmt, n, k, group_size, per_super, zeros, seed=m, half=False)
        x, b = operands(m, k, n, torch.float32, True, seed=m)
        check(q, x, b, torch.float32, False)
        check(q, x, b, torch.float32, True)


@pytest.mark.parametrize("fmt, n, k, group_size, per_super, zeros", CASES)
def test_one_level_means_the_same_numbers(fmt, n, k, group_size, per_super, zeros):
    q = two_level(fmt, n, k, group_size, per_super, zeros)
    want = reference.quantized_weight(q.qweight, q.scales, q.zeros, q.group_size,
                                      q.super_scales, q.super_mins)
    one = q.one_level()
    assert one.super_scales is None and one.scales.dtype == torch.float32
    torch.testing.assert_close(q.dequantize().double(), want, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(one.dequantize().double(), want, atol=1e-7, rtol=1e-6)
    got = reference.quantized_weight(one.qweight, one.scales, one.zeros, one.group_size)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)


def test_rows_columns_and_fusing_keep_the_super_blocks():
    q = two_level("int4", 10, 512, 32, 8, True)
    want = q.dequantize()
    torch.testing.assert_close(q.narrow(0, 3, 4).dequantize(), want[3:7])
    torch.testing.assert_close(q.narrow(1, 256, 256).dequantize(), want[:, 256:])
    with pytest.raises(ValueError, match="super-blocks of 256"):
        q.narrow(1, 0, 128, name="w")
    both = QuantizedWeight.concat([q, q.narrow(0, 0, 2)])
    torch.testing.assert_close(both.dequantize(), torch.cat([want, want[:2]]))
    padded = q.padded(3)
    assert padded.shape == (13, 512) and padded.dequantize()[10:].abs().max() == 0


def test_bad_arguments():
    q = two_level("int4", 8, 512, 32, 8, True)
    x = torch.randn(2, 512)

    def call(scales=q.scales, zeros=q.zeros, super_scales=q.super_scales,
             super_mins=q.super_mins, qweight=q.qweight):
        return ops.quantized_linear(x, qweight, scales, zeros, 32, None, False, super_scales,
                                    super_mins)
    call()  # the good one
    with pytest.raises(RuntimeError, match="scales must be Char"):
        call(scales=q.scales.float())
    with pytest.raises(RuntimeError, match=r"two-level scales must be int8 \[8, 16\]"):
        call(scales=q.scales[:, :8].contiguous())
    with pytest.raises(RuntimeError, match="super_scales must be fp32 or fp16"):
        call(super_scales=q.super_scales.bfloat16(), super_mins=q.super_mins.bfloat16())
    with pytest.raises(RuntimeError, match="supers dividing the 16 groups"):
        call(super_scales=torch.ones(8, 3, dtype=torch.half),
             super_mins=torch.ones(8, 3, dtype=torch.half))
    with pytest.raises(RuntimeError, match="zeros and super_mins come together"):
        call(super_mins=None)
    with pytest.raises(RuntimeError, match="zeros and super_mins come together"):
        call(zeros=None)
    with pytest.raises(RuntimeError, match="super_mins must be shaped as super_scales"):
        call(super_mins=q.super_mins[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="super_mins must be Half"):
        call(super_mins=q.super_mins.float())
    with pytest.raises(RuntimeError, match="two-level zeros must be int8"):
        call(zeros=torch.tensor([8], dtype=torch.int8))
    with pytest.raises(RuntimeError, match="super_mins needs super_scales"):
        ops.quantized_linear(x, q.qweight, q.scales.float(), None, 32, None, False, None,
                             q.super_mins)
    f = torch.randn(8, 512).to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="take int8 or int4 weights, not fp8"):
        call(qweight=f, zeros=None, super_mins=None)


def capability_checks():
    for dtype in TOLERANCES:
        for case in CASES:
            for m in (1, 2, 5, 9):
                q = two_level(*case, seed=m)
                x, b = operands(m, case[2], case[1], dtype, True, seed=m)
                check(q, x, b, dtype, False)
                check(q, x, b, dtype, True)


CPU_CAPABILITIES = ALL_CAPABILITIES


@pytest.mark.parametrize("capability", CPU_CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)


@pytest.mark.cuda
def test_cuda_refuses_two_level_scales():
    q = two_level("int4", 8, 256, 32, 8, True)
    on = [t.cuda() for t in (q.qweight, q.scales, q.zeros, q.super_scales, q.super_mins)]
    with pytest.raises(RuntimeError, match="two-level scales .* run on the CPU"):
        ops.quantized_linear(torch.randn(2, 256, device="cuda"), on[0], on[1], on[2], 32, None,
                             False, on[3], on[4])
