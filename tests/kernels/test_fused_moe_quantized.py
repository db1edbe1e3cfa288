"""fused_moe_quantized (int8, int4 and fp8 E4M3 experts) against kvserve.testing.reference:
awkward sizes, every group size and dtype, experts with a few tokens (side by side, the GEMV)
and with many (one at a time, dequantized blocks and a GEMM), with and without zero points, and
the errors bad arguments raise before any expert runs."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.quantization import quantize_fp8, quantize_int4, quantize_int8
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant

ops = torch.ops.kvserve

# fp32 accumulation; bf16/fp16 round the gate_up output and the activation once each (and, past
# the GEMV, the dequantized weight for the GEMM).
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}
DTYPES = list(TOLERANCES)
# relu2 squares the rounded up output: twice its relative rounding error.
SQUARED_TOLERANCES = {d: {key: 2 * v for key, v in t.items()} for d, t in TOLERANCES.items()}
# (format, hidden, inter, num_experts, k, w13 group, w2 group): per-row and grouped scales, one
# expert, top-1, and DeepSeek-like many small experts with top-6; int4 needs multiples of 32.
CASES = [
    ("int8", 40, 24, 3, 2, 40, 24), ("int8", 72, 56, 8, 2, 36, 28), ("int8", 33, 17, 1, 1, 33, 17),
    ("int4", 64, 32, 3, 2, 32, 32), ("int4", 128, 96, 8, 2, 64, 32),
    ("int4", 96, 64, 16, 6, 96, 64),
    ("fp8", 40, 24, 3, 2, 40, 24), ("fp8", 65, 20, 16, 6, 65, 20),
]
TOKENS = [1, 3, 17]  # decode (a few tokens per expert, side by side) up to many per expert


def quantize(fmt, w, group_size, zeros):
    if fmt == "int8":
        return quantize_int8(w, group_size)
    if fmt == "int4":
        q = quantize_int4(w, group_size)
        return q if zeros else type(q)(q.qweight, q.scales, None, group_size)
    return quantize_fp8(w)


def make(fmt, hidden, inter, num_experts, k, g13, g2, tokens, dtype, zeros=True, seed=0,
         half13=False, half2=False, activation="silu"):
    """The op's arguments and the reference's output; half13 / half2: that projection's scales
    and zeros in fp16; activation relu2: experts without a gate (w13 the up rows alone), the
    last argument."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    rows = inter if activation == "relu2" else 2 * inter
    w13 = [quantize(fmt, torch.randn(rows, hidden, generator=g) / hidden ** 0.5, g13, zeros)
           for _ in range(num_experts)]
    w2 = [quantize(fmt, torch.randn(hidden, inter, generator=g) / inter ** 0.5, g2, zeros)
          for _ in range(num_experts)]
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)]
                      ) if tokens else torch.zeros(0, k, dtype=torch.long)
    weights = torch.rand(tokens, k, generator=g)

    def lists(qs, half):
        cast = (lambda t: t.half()) if half else (lambda t: t)
        return ([q.qweight for q in qs], [cast(q.scales) for q in qs],
                [cast(q.zeros) for q in qs if q.zeros is not None], qs[0].group_size)
    args = [x, *lists(w13, half13), *lists(w2, half2), weights, ids]
    if activation != "silu":
        args.append(activation)
    return args, reference.fused_moe_quantized(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_reference(case, tokens, dtype):
    args, want = make(*case, tokens, dtype)
    out = ops.fused_moe_quantized(*args)
    assert out.dtype == dtype and out.shape == (tokens, case[1])
    torch.testing.assert_close(out.double(), want, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 17])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_fp16_scales_and_zeros(case, tokens, dtype):
    """fp16 scales and zeros in w13, in w2, in both."""
    for half13, half2 in ((True, False), (False, True), (True, True)):
        args, want = make(*case, tokens, dtype, half13=half13, half2=half2)
        torch.testing.assert_close(ops.fused_moe_quantized(*args).double(), want,
                                   **TOLERANCES[dtype])


@pytest.mark.parametrize("tokens", [1, 17])
def test_int4_without_zero_points(tokens):
    args, want = make("int4", 64, 32, 3, 2, 32, 32, tokens, torch.float32, zeros=False)
    assert args[3] == [] and args[7] == []
    torch.testing.assert_close(ops.fused_moe_quantized(*args).double(), want,
                               **TOLERANCES[torch.float32])


def test_equals_fused_moe_on_the_dequantized_weights():
    """The same experts dequantized to fp32 and run by fused_moe: one computation."""
    args, _ = make("int8", 72, 56, 8, 2, 36, 28, 5, torch.float32)
    x, q13, s13, z13, g13, q2, s2, z2, g2, weights, ids = args
    assert z13 == [] and z2 == []  # int8: symmetric
    w13 = [reference.quantized_weight(q, s, None, g13).float() for q, s in zip(q13, s13)]
    w2 = [reference.quantized_weight(q, s, None, g2).float() for q, s in zip(q2, s2)]
    torch.testing.assert_close(ops.fused_moe_quantized(*args),
                               ops.fused_moe(x, w13, w2, weights, ids), atol=2e-5, rtol=2e-5)


def test_strided_hidden_rows_and_no_tokens():
    args, want = make("int4", 64, 32, 3, 2, 32, 32, 9, torch.float32)
    args[0] = torch.cat([args[0], torch.full((9, 5), float("nan"))], dim=1)[:, :64]
    torch.testing.assert_close(ops.fused_moe_quantized(*args).double(), want,
                               **TOLERANCES[torch.float32])
    empty, _ = make("int4", 64, 32, 3, 2, 32, 32, 0, torch.float32)
    assert ops.fused_moe_quantized(*empty).shape == (0, 64)


def test_tokens_are_independent_of_the_batch():
    """A token's output does not depend on the other tokens routed with it (up to the rounding of
    a GEMM over more rows where its experts see more tokens)."""
    args, _ = make("int8", 72, 56, 8, 2, 36, 28, 17, torch.float32)
    batched = ops.fused_moe_quantized(*args)
    for t in (0, 5, 16):
        alone = list(args)
        alone[0], alone[9], alone[10] = args[0][t:t + 1], args[9][t:t + 1], args[10][t:t + 1]
        torch.testing.assert_close(ops.fused_moe_quantized(*alone), batched[t:t + 1],
                                   atol=2e-6, rtol=2e-6)


def bad(change):
    """make()'s int4 arguments with one changed; change(args) edits the list in place."""
    args, _ = make("int4", 64, 32, 3, 2, 32, 32, 4, torch.float32)
    change(args)
    return args


def _set(i, value):
    return lambda a: a.__setitem__(i, value)


@pytest.mark.cpu_only  # the ids' values are checked on the host; CUDA skips a bad one
def test_rejects_bad_expert_ids():
    with pytest.raises(RuntimeError, match="expert id 3 is outside"):
        ops.fused_moe_quantized(*bad(_set(10, torch.tensor([[0, 3]] * 4))))


@pytest.mark.parametrize("change, match", [
    (_set(10, torch.tensor([[0, 1]] * 4, dtype=torch.int32)), "Long"),
    (_set(9, torch.rand(4, 3)), "must both be"),
    (lambda a: a[2].pop(), "w13_scales needs one tensor per expert"),
    (lambda a: a[7].pop(), "w2_zeros needs one tensor per expert"),
    (lambda a: a[1].__setitem__(2, a[1][2].view(torch.int8)), "every w13 must be contiguous"),
    (lambda a: a[6].__setitem__(1, a[6][1][:, :0]), "every w2_scales must be"),
    (_set(4, 48), "w13: quantized_linear: group_size must divide"),
    (_set(8, 64), "w2: quantized_linear: group_size must divide"),
    (_set(0, torch.randn(4, 32)), "w13: quantized_linear: qweight must be contiguous"),
    (_set(5, [torch.zeros(40, 16, dtype=torch.uint8)] * 3), "w2 must have 64 rows"),
    (_set(0, torch.randn(4, 64).double()), "input must be fp32, bf16 or fp16"),
    (lambda a: [a[1].clear(), a[5].clear()], "at least one expert"),
    (lambda a: a[7].__setitem__(slice(None), [torch.full((1,), 8.0, dtype=a[6][0].dtype)] * 3),
     r"w2_zeros must be \[n, groups\] for each expert"),
], ids=["id-dtype", "weights-shape", "scales-count", "zeros-count",
        "mixed-format", "scales-shape", "w13-group", "w2-group", "hidden-width", "w2-rows",
        "hidden-dtype", "no-experts", "one-zero"])
def test_rejects_bad_arguments(change, match):
    with pytest.raises(RuntimeError, match=match):
        ops.fused_moe_quantized(*bad(change))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_relu2_experts_without_a_gate(case, tokens, dtype):
    """Nemotron-H's experts: relu(up)^2, no gate rows (fused_moe's relu2)."""
    args, want = make(*case, tokens, dtype, activation="relu2")
    out = ops.fused_moe_quantized(*args)
    torch.testing.assert_close(out.double(), want, **SQUARED_TOLERANCES[dtype])


def test_relu2_rejects_gated_shapes_and_other_activations():
    args, _ = make(*CASES[0], 3, torch.float32)  # w13 [48, 40]: gate and up rows
    with pytest.raises(RuntimeError, match="w2: .*48"):
        ops.fused_moe_quantized(*args, "relu2")
    with pytest.raises(RuntimeError, match="activation must be silu or relu2, got gelu"):
        ops.fused_moe_quantized(*args, "gelu")


# ------------------------------------------------------------------ every CPU capability variant


def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for case in (CASES[1], CASES[4], CASES[6]):
        for dtype in DTYPES:
            for tokens in (1, 17):
                for half in (False, True):
                    args, want = make(*case, tokens, dtype, half13=half, half2=half)
                    torch.testing.assert_close(ops.fused_moe_quantized(*args).double(), want,
                                               **TOLERANCES[dtype])
                test_relu2_experts_without_a_gate(case, tokens, dtype)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)


# --------------------------------------------- CUDA: against the reference and the CPU op


def on_cuda(args):
    """make()'s arguments on the GPU (lists tensor by tensor; group sizes stay ints)."""
    def move(a):
        if isinstance(a, list):
            return [t.cuda() for t in a]
        return a.cuda() if isinstance(a, torch.Tensor) else a
    return [move(a) for a in args]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_matches_reference_and_cpu(case, tokens, dtype):
    args, want = make(*case, tokens, dtype)
    out = ops.fused_moe_quantized(*on_cuda(args))
    assert out.is_cuda and out.dtype == dtype and out.shape == (tokens, case[1])
    torch.testing.assert_close(out.cpu().double(), want, **TOLERANCES[dtype])
    torch.testing.assert_close(out.cpu(), ops.fused_moe_quantized(*args), **TOLERANCES[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 17])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_relu2_experts_without_a_gate(case, tokens, dtype):
    args, want = make(*case, tokens, dtype, activation="relu2")
    out = ops.fused_moe_quantized(*on_cuda(args))
    torch.testing.assert_close(out.cpu().double(), want, **SQUARED_TOLERANCES[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 17])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_fp16_scales_and_zeros(case, tokens, dtype):
    for half13, half2 in ((True, False), (False, True), (True, True)):
        args, want = make(*case, tokens, dtype, half13=half13, half2=half2)
        out = ops.fused_moe_quantized(*on_cuda(args)).cpu()
        torch.testing.assert_close(out.double(), want, **TOLERANCES[dtype])
        torch.testing.assert_close(out, ops.fused_moe_quantized(*args), **TOLERANCES[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 17])
def test_cuda_int4_without_zero_points_and_strided_rows(tokens):
    args, want = make("int4", 64, 32, 3, 2, 32, 32, tokens, torch.float32, zeros=False)
    args = on_cuda(args)
    args[0] = torch.cat([args[0], torch.full((tokens, 5), float("nan"), device="cuda")],
                        dim=1)[:, :64]
    torch.testing.assert_close(ops.fused_moe_quantized(*args).cpu().double(), want,
                               **TOLERANCES[torch.float32])


@pytest.mark.cuda
def test_cuda_ids_out_of_range_add_nothing():
    """The GPU cannot check ids without synchronising: a bad one is skipped, never read."""
    args, _ = make("int4", 64, 32, 3, 2, 32, 32, 5, torch.float32)
    args = on_cuda(args)
    good_ids, weights = args[10], args[9]
    bad_ids = good_ids.clone()
    bad_ids[:, 1] = torch.tensor([3, -1, 1 << 40, -(1 << 40), 7], device="cuda")
    zero_slot = weights.clone()
    zero_slot[:, 1] = 0.0
    out = ops.fused_moe_quantized(*args[:10], bad_ids)
    torch.cuda.synchronize()
    want = ops.fused_moe_quantized(*args[:9], zero_slot, good_ids)
    torch.testing.assert_close(out, want)


@pytest.mark.cuda
def test_cuda_bad_arguments():
    args = on_cuda(bad(_set(0, torch.randn(4, 64).double())))
    with pytest.raises(RuntimeError, match="input must be fp32, bf16 or fp16"):
        ops.fused_moe_quantized(*args)
