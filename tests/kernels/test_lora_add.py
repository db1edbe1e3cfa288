"""lora_add (each token's LoRA update by its adapter slot) against kvserve.testing.reference."""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant
from tests.kernels.cuda_ops import host_check

ops = torch.ops.kvserve

# fp32 math, then one rounding of out + update to the dtype.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
DTYPES = list(TOLERANCES)


def operands(num_tokens, in_features, out_features, rank, num_slots, dtype, seed=0, pad=0):
    """x and out with padded rows (row strides in + pad, out + pad); every slot from -1 up."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features + pad, generator=g).to(dtype)[:, :in_features]
    out = torch.randn(num_tokens, out_features + pad, generator=g).to(dtype)[:, :out_features]
    lora_a = (torch.randn(num_slots, rank, in_features, generator=g) / in_features ** 0.5).to(dtype)
    lora_b = torch.randn(num_slots, rank, out_features, generator=g).to(dtype)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int32)
    scales = torch.rand(num_slots, generator=g) * 2
    return out, x, lora_a, lora_b, slots, scales


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, in_features, out_features, rank, num_slots", [
    (1, 16, 16, 1, 1), (7, 33, 65, 8, 3), (37, 96, 17, 16, 4), (5, 1000, 384, 64, 2),
])
def test_lora_add(num_tokens, in_features, out_features, rank, num_slots, dtype):
    out, *args = operands(num_tokens, in_features, out_features, rank, num_slots, dtype)
    want = reference.lora_add(out, *args)
    ops.lora_add(out, *args)
    torch.testing.assert_close(out.double(), want, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_untouched_tokens(dtype):
    out, x, a, b, slots, scales = operands(9, 40, 24, 4, 2, dtype, seed=1, pad=3)
    assert not x.is_contiguous() and not out.is_contiguous()
    slots[::3] = -1
    before = out._base.clone()
    want = reference.lora_add(out, x, a, b, slots, scales)
    ops.lora_add(out, x, a, b, slots, scales)
    torch.testing.assert_close(out.double(), want, **TOLERANCES[dtype])
    assert torch.equal(out[::3], before[::3, :24]), "a token without adapter changed"
    assert torch.equal(out._base[:, 24:], before[:, 24:]), "lora_add wrote outside out"


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_equals_per_token(dtype):
    out, x, a, b, slots, scales = operands(11, 48, 40, 8, 3, dtype, seed=2)
    batched = out.clone()
    ops.lora_add(batched, x, a, b, slots, scales)
    for t in range(11):
        single = out[t:t + 1].clone()
        ops.lora_add(single, x[t:t + 1], a, b, slots[t:t + 1], scales)
        assert torch.equal(single, batched[t:t + 1]), f"token {t} depends on the batch"


def test_equals_a_merged_weight():
    """One adapter on every token: the update is x (B A)^T scaled, what merging would add."""
    out, x, a, b, _, scales = operands(6, 32, 20, 4, 1, torch.float32)
    base = out.clone()
    ops.lora_add(out, x, a, b, torch.zeros(6, dtype=torch.int32), scales)
    merged = scales[0] * (b[0].t() @ a[0])  # [out, in]
    torch.testing.assert_close(out, base + x @ merged.t(), atol=1e-4, rtol=1e-5)


def test_empty_batch_and_rank_zero():
    out, x, a, b, slots, scales = operands(0, 8, 8, 2, 1, torch.float32)
    ops.lora_add(out, x, a, b, slots, scales)
    out, x, a, b, slots, scales = operands(3, 8, 8, 0, 1, torch.float32)
    before = out.clone()
    ops.lora_add(out, x, a, b, slots, scales)
    assert torch.equal(out, before)


def bad(**change):
    out, x, a, b, slots, scales = operands(4, 8, 6, 2, 2, torch.float32)
    args = dict(out=out, x=x, lora_a=a, lora_b=b, slots=slots, scales=scales)
    args.update({k: v(args) for k, v in change.items()})
    return tuple(args.values())


@pytest.mark.parametrize("args, match", [
    (bad(out=lambda a: a["out"].bfloat16()), "dtype"),
    (bad(lora_a=lambda a: a["lora_a"].half()), "dtype"),
    (bad(x=lambda a: a["x"][:3]), "one row per token"),
    (bad(lora_a=lambda a: a["lora_a"][:, :, :7].contiguous()), "lora_a must be"),
    (bad(lora_b=lambda a: a["lora_b"][:1].contiguous()), "lora_b must be"),
    (bad(lora_b=lambda a: a["lora_b"].transpose(1, 2).contiguous()), "lora_b must be"),
    (bad(slots=lambda a: a["slots"].long()), "slots must be Int"),
    (bad(slots=lambda a: a["slots"][:3]), "slots must be"),
    (bad(scales=lambda a: a["scales"][:1]), "scales must be"),
    (bad(scales=lambda a: a["scales"].double()), "scales must be Float"),
    (bad(x=lambda a: a["x"][0]), "dimensions"),
    host_check(bad(slots=lambda a: torch.tensor([0, 2, -1, 1], dtype=torch.int32)),
               "token 1 has slot 2, outside"),
    host_check(bad(slots=lambda a: torch.tensor([0, -2, -1, 1], dtype=torch.int32)),
               "token 1 has slot -2"),
])
def test_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        ops.lora_add(*args)


# ------------------------------------------------------------------ every CPU capability variant


def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for dtype in DTYPES:
        test_lora_add(7, 33, 65, 8, 3, dtype)
        test_strided_rows_and_untouched_tokens(dtype)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)
