"""fused_moe against kvserve.testing.reference: awkward sizes, every dtype, plain and packed
expert weights, experts with a few tokens (run side by side) and with many (one at a time), and
the errors bad arguments raise."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant

ops = torch.ops.kvserve

# fp32 GEMMs and accumulation; bf16/fp16 round the gate_up output and the activation once each.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}
DTYPES = list(TOLERANCES)
# relu2 squares the rounded up output: twice its relative rounding error.
SQUARED_TOLERANCES = {d: {key: 2 * v for key, v in t.items()} for d, t in TOLERANCES.items()}
# (hidden, inter, num_experts, k): sizes that are no multiple of a vector, one expert, top-1,
# and DeepSeek-like many small experts with top-6.
SHAPES = [(40, 24, 3, 2), (72, 56, 8, 2), (33, 17, 1, 1), (64, 20, 16, 6)]
TOKENS = [1, 3, 17, 50]  # decode (few tokens per expert) up to prefill (many per expert)


def make(tokens, hidden, inter, num_experts, k, dtype, packed=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = [(torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
           for _ in range(num_experts)]
    w2 = [(torch.randn(hidden, inter, generator=g) / inter ** 0.5).to(dtype)
          for _ in range(num_experts)]
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)]
                      ) if tokens else torch.zeros(0, k, dtype=torch.long)
    weights = torch.rand(tokens, k, generator=g)
    args = [x, w13, w2, weights, ids]
    if packed:
        args[1] = [ops.linear_prepack(w) if ops.linear_prepack(w) is not None else w for w in w13]
        args[2] = [ops.linear_prepack(w) if ops.linear_prepack(w) is not None else w for w in w2]
    return args, reference.fused_moe(x, w13, w2, weights, ids)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden, inter, num_experts, k", SHAPES)
def test_matches_reference(hidden, inter, num_experts, k, tokens, dtype):
    args, want = make(tokens, hidden, inter, num_experts, k, dtype)
    out = ops.fused_moe(*args)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    torch.testing.assert_close(out.double(), want, **TOLERANCES[dtype])


@pytest.mark.cpu_only  # linear_prepack's packed layouts are CPU (oneDNN) tensors
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 40])
def test_packed_weights(tokens, dtype):
    args, want = make(tokens, 72, 56, 8, 2, dtype, packed=True)
    torch.testing.assert_close(ops.fused_moe(*args).double(), want, **TOLERANCES[dtype])


def test_strided_hidden_rows():
    args, want = make(9, 40, 24, 3, 2, torch.float32)
    wide = torch.cat([args[0], torch.full((9, 5), float("nan"))], dim=1)
    args[0] = wide[:, :40]
    torch.testing.assert_close(ops.fused_moe(*args).double(), want, **TOLERANCES[torch.float32])


def test_tokens_are_independent_of_the_batch():
    """A token's output does not depend on the other tokens routed with it (up to the rounding of
    a GEMM over more rows where its experts see more tokens)."""
    args, _ = make(17, 72, 56, 8, 2, torch.float32)
    batched = ops.fused_moe(*args)
    x, w13, w2, weights, ids = args
    for t in (0, 5, 16):
        alone = ops.fused_moe(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1])
        torch.testing.assert_close(alone, batched[t:t + 1], atol=2e-6, rtol=2e-6)


def test_no_tokens():
    args, _ = make(0, 40, 24, 3, 2, torch.float32)
    assert ops.fused_moe(*args).shape == (0, 40)


def test_zero_weight_slots_contribute_nothing():
    args, _ = make(5, 40, 24, 3, 2, torch.float32)
    args[3][:, 1] = 0.0
    one_slot = [args[0], args[1], args[2], args[3][:, :1].contiguous(), args[4][:, :1].contiguous()]
    torch.testing.assert_close(ops.fused_moe(*args), ops.fused_moe(*one_slot))


def bad(**change):
    args, _ = make(4, 40, 24, 3, 2, torch.float32)
    x, w13, w2, weights, ids = args
    values = dict(hidden=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    values.update(change)
    return list(values.values())


@pytest.mark.cpu_only  # the ids' values are checked on the host; CUDA skips a bad one
@pytest.mark.parametrize("change, match", [
    (dict(topk_ids=torch.tensor([[0, 3]] * 4)), "expert id 3 is outside"),
    (dict(topk_ids=torch.tensor([[0, -1]] * 4)), "expert id -1 is outside"),
], ids=["id-too-large", "id-negative"])
def test_rejects_bad_expert_ids(change, match):
    with pytest.raises(RuntimeError, match=match):
        ops.fused_moe(*bad(**change))


@pytest.mark.parametrize("change, match", [
    (dict(topk_ids=torch.tensor([[0, 1]] * 4, dtype=torch.int32)), "Long"),
    (dict(topk_weights=torch.rand(4, 2).double()), "Float"),
    (dict(topk_weights=torch.rand(4, 3)), "must both be"),
    (dict(w2=[torch.randn(40, 24)] * 2), "one w13 and one w2 per expert"),
    (dict(w13=[torch.randn(48, 41)] * 3), "must be \\[48, 40\\]"),
    (dict(w2=[torch.randn(40, 23)] * 3), "must be \\[40, 24\\]"),
    (dict(w13=[torch.randn(48, 40).double()] * 3), "dtype"),
    (dict(hidden=torch.randn(4, 40, 1)), "hidden"),
], ids=["id-dtype", "weight-dtype", "weight-shape", "expert-count", "w13-shape", "w2-shape",
        "weight-dtype-mismatch", "hidden-rank"])
def test_rejects_bad_arguments(change, match):
    with pytest.raises(RuntimeError, match=match):
        ops.fused_moe(*bad(**change))


def make_biased(tokens, hidden, inter, num_experts, k, dtype, seed=4):
    """make()'s arguments plus biases per expert and gpt-oss's clamped gate (a limit of 1.5
    that the projections' outputs cross)."""
    args, _ = make(tokens, hidden, inter, num_experts, k, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    b13 = torch.randn(num_experts, 2 * inter, generator=g).to(dtype)
    b2 = torch.randn(num_experts, hidden, generator=g).to(dtype)
    extra = dict(w13_bias=b13, w2_bias=b2, activation="clamped_swiglu", alpha=1.702, limit=1.5)
    return args, extra, reference.fused_moe(*args, **extra)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 17])
@pytest.mark.parametrize("hidden, inter, num_experts, k", SHAPES[:3])
def test_biases_and_clamped_swiglu(hidden, inter, num_experts, k, tokens, dtype):
    args, extra, want = make_biased(tokens, hidden, inter, num_experts, k, dtype)
    out = ops.fused_moe(*args, **extra)
    torch.testing.assert_close(out.double(), want, **TOLERANCES[dtype])
    plain = reference.fused_moe(*args)
    assert (want - plain).abs().max() > 0.1, "the biases and the gate changed nothing"
    # Biases alone, with the SwiGLU gate.
    alone = dict(w13_bias=extra["w13_bias"], w2_bias=extra["w2_bias"])
    torch.testing.assert_close(ops.fused_moe(*args, **alone).double(),
                               reference.fused_moe(*args, **alone), **TOLERANCES[dtype])


@pytest.mark.parametrize("change, match", [
    (lambda e: dict(w13_bias=e["w13_bias"][:2]), "w13_bias must be contiguous .num_experts = 3"),
    (lambda e: dict(w2_bias=torch.zeros(3, 41)), "w2_bias must be contiguous"),
    (lambda e: dict(w2_bias=torch.zeros(41, 3).T), "w2_bias must be contiguous"),
    (lambda e: dict(w13_bias=e["w13_bias"].double()), "w13_bias must have"),
    (lambda e: dict(activation="gelu"), "activation must be silu, clamped_swiglu or relu2"),
    # relu2's w13 is the up rows alone: [24, 40] here, not [48, 40]
    (lambda e: dict(activation="relu2"), "every w2 must be .40, 48."),
    (lambda e: dict(limit=0.0), "positive alpha and limit"),
])
def test_rejects_bad_biases_and_activations(change, match):
    args, extra, _ = make_biased(3, 40, 24, 3, 2, torch.float32)
    with pytest.raises(RuntimeError, match=match):
        ops.fused_moe(*args, **{**extra, **change(extra)})


def make_ungated(tokens, hidden, inter, num_experts, k, dtype, bias, seed=6):
    """Experts without a gate (Nemotron-H's relu2): w13 the up rows alone [inter, hidden], with
    biases per expert or none."""
    args, _ = make(tokens, hidden, inter, num_experts, k, dtype, seed=seed)
    args[1] = [w[:inter].contiguous() for w in args[1]]
    g = torch.Generator().manual_seed(seed + 1)
    extra = dict(activation="relu2")
    if bias:
        extra.update(w13_bias=torch.randn(num_experts, inter, generator=g).to(dtype),
                     w2_bias=torch.randn(num_experts, hidden, generator=g).to(dtype))
    return args, extra, reference.fused_moe(*args, **extra)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 17, 50])
@pytest.mark.parametrize("hidden, inter, num_experts, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_relu2_experts_without_a_gate(hidden, inter, num_experts, k, tokens, dtype, bias):
    args, extra, want = make_ungated(tokens, hidden, inter, num_experts, k, dtype, bias)
    out = ops.fused_moe(*args, **extra)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    torch.testing.assert_close(out.double(), want, **SQUARED_TOLERANCES[dtype])


@pytest.mark.cpu_only  # linear_prepack's packed layouts are CPU (oneDNN) tensors
def test_relu2_packed_weights():
    args, extra, want = make_ungated(40, 72, 56, 8, 2, torch.float32, bias=False)
    args[1] = [ops.linear_prepack(w) if ops.linear_prepack(w) is not None else w for w in args[1]]
    args[2] = [ops.linear_prepack(w) if ops.linear_prepack(w) is not None else w for w in args[2]]
    torch.testing.assert_close(ops.fused_moe(*args, **extra).double(), want,
                               **TOLERANCES[torch.float32])


# ------------------------------------------------------------------ every CPU capability variant


def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for dtype in DTYPES:
        for tokens in (1, 17):
            args, want = make(tokens, 40, 24, 3, 2, dtype)
            torch.testing.assert_close(ops.fused_moe(*args).double(), want, **TOLERANCES[dtype])
        test_biases_and_clamped_swiglu(40, 24, 3, 2, 17, dtype)
        test_relu2_experts_without_a_gate(40, 24, 3, 2, 17, dtype, True)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)


# --------------------------------------------- CUDA: against the reference and the CPU op


def on_cuda(args):
    """make()'s arguments on the GPU (the weight lists tensor by tensor)."""
    return [[w.cuda() for w in a] if isinstance(a, list) else a.cuda() for a in args]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden, inter, num_experts, k", SHAPES)
def test_cuda_matches_reference_and_cpu(hidden, inter, num_experts, k, tokens, dtype):
    args, want = make(tokens, hidden, inter, num_experts, k, dtype)
    out = ops.fused_moe(*on_cuda(args))
    assert out.is_cuda and out.dtype == dtype and out.shape == (tokens, hidden)
    torch.testing.assert_close(out.cpu().double(), want, **TOLERANCES[dtype])
    torch.testing.assert_close(out.cpu(), ops.fused_moe(*args), **TOLERANCES[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_relu2_experts_without_a_gate(tokens, dtype, bias):
    args, extra, want = make_ungated(tokens, 72, 56, 8, 2, dtype, bias)
    extra = {key: v.cuda() if torch.is_tensor(v) else v for key, v in extra.items()}
    out = ops.fused_moe(*on_cuda(args), **extra)
    torch.testing.assert_close(out.cpu().double(), want, **SQUARED_TOLERANCES[dtype])


@pytest.mark.cuda
def test_cuda_strided_hidden_rows():
    args, want = make(9, 40, 24, 3, 2, torch.float32)
    args = on_cuda(args)
    args[0] = torch.cat([args[0], torch.full((9, 5), float("nan"), device="cuda")], dim=1)[:, :40]
    torch.testing.assert_close(ops.fused_moe(*args).cpu().double(), want,
                               **TOLERANCES[torch.float32])


@pytest.mark.cuda
def test_cuda_ids_out_of_range_add_nothing():
    """The GPU cannot check ids without synchronising: a bad one is skipped, never read."""
    args, _ = make(5, 40, 24, 3, 2, torch.float32)
    bad_ids = args[4].clone()
    bad_ids[:, 1] = torch.tensor([3, -1, 1 << 40, -(1 << 40), 7])
    zero_slot = args[3].clone()
    zero_slot[:, 1] = 0.0
    x, w13, w2, _, _ = on_cuda(args)
    out = ops.fused_moe(x, w13, w2, args[3].cuda(), bad_ids.cuda())
    torch.cuda.synchronize()
    want = ops.fused_moe(x, w13, w2, zero_slot.cuda(), args[4].cuda())
    torch.testing.assert_close(out, want)


@pytest.mark.cuda
def test_cuda_bad_arguments():
    args = on_cuda(bad())
    args[3] = args[3].double()
    with pytest.raises(RuntimeError, match="Float"):
        ops.fused_moe(*args)
