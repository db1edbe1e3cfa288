"""silu_and_mul (the SwiGLU gate) against kvserve.testing.reference."""

import os
import subprocess
import sys

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference

ops = torch.ops.kvserve

# One tolerance per dtype: fp32 math, then one rounding to the dtype.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
}
DTYPES = list(TOLERANCES)
SIZES = [1, 7, 16, 33, 4095]  # d: the output width; input is [T, 2d]
NUM_TOKENS = [1, 4, 37]


def make_input(num_tokens, d, dtype, pad=0, seed=0):
    """[num_tokens, 2d] = [gate | up], with row stride 2d + pad. Gates span saturated silu too."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(num_tokens, 2 * d + pad, generator=g).mul_(4)
    full[0, 0] = -90.0  # exp(-gate) overflows fp32; silu must still give -0, not nan
    return full.to(dtype)[:, :2 * d]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_silu_and_mul(num_tokens, d, dtype):
    x = make_input(num_tokens, d, dtype)
    out = torch.empty(num_tokens, d, dtype=dtype)
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out.double(), reference.silu_and_mul(x), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [7, 33, 64])
def test_silu_and_mul_strided_rows(d, dtype):
    x = make_input(9, d, dtype, pad=3)
    assert not x.is_contiguous()
    out_full = torch.full((9, d + 5), float("nan"), dtype=dtype)
    out = out_full[:, :d]
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out.double(), reference.silu_and_mul(x), **TOLERANCES[dtype])
    assert out_full[:, d:].isnan().all(), "silu_and_mul wrote outside the out view"


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_equals_per_row(dtype):
    x = make_input(11, 40, dtype)
    batched = torch.empty(11, 40, dtype=dtype)
    ops.silu_and_mul(batched, x)
    for t in range(x.size(0)):
        single = torch.empty(1, 40, dtype=dtype)
        ops.silu_and_mul(single, x[t:t + 1])
        assert torch.equal(single, batched[t:t + 1]), f"row {t} depends on the batch"


@pytest.mark.parametrize(
    "make_args, match",
    [
        (lambda: (torch.empty(3, 4), torch.randn(3, 7)), "2d"),                   # odd width
        (lambda: (torch.empty(3, 5), torch.randn(3, 8)), "2d"),                   # out width
        (lambda: (torch.empty(2, 4), torch.randn(3, 8)), "2d"),                   # out rows
        (lambda: (torch.empty(3, 4, dtype=torch.bfloat16), torch.randn(3, 8)), "dtype"),
        (lambda: (torch.empty(3, 4), torch.randn(3, 8, dtype=torch.float64)), "dtype"),
        (lambda: (torch.empty(3, 4), torch.randn(8)), "dimensions"),
        (lambda: (torch.empty(3, 4), torch.randn(8, 3).t()), "contiguous"),
    ],
)
def test_silu_and_mul_rejects_bad_arguments(make_args, match):
    out, x = make_args()
    with pytest.raises(RuntimeError, match=match):
        ops.silu_and_mul(out, x)


# ------------------------------------------------------------------ every CPU capability variant

CAPABILITIES = ["default", "avx2", "avx512"]


def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for dtype in DTYPES:
        for d in (7, 33, 4095):
            test_silu_and_mul(4, d, dtype)
        test_silu_and_mul_strided_rows(33, dtype)


@pytest.fixture(scope="module", autouse=True)
def capability_processes(request):
    """{capability: process running capability_checks()}, one fresh process per capability below
    this one (the variable only lowers it at process start). They start with the module, so they
    run beside its other tests, and only when test_cpu_capability_variants is selected."""
    selected = any(item.module is request.module
                   and item.originalname == "test_cpu_capability_variants"
                   for item in request.session.items)
    lower = CAPABILITIES[:CAPABILITIES.index(kvserve._C.cpu_capability())] if selected else []
    script = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import kvserve; "
              f"print('capability=' + kvserve._C.cpu_capability()); "
              f"import {__name__.rpartition('.')[2]} as m; m.capability_checks()")
    # One thread each: they share the cores with this process (the vector code is what differs).
    procs = {name: subprocess.Popen([sys.executable, "-c", script], text=True,
                                    env={**os.environ, "KVSERVE_CPU_CAPABILITY": name,
                                         "OMP_NUM_THREADS": "1"},
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for name in lower}
    yield procs
    for proc in procs.values():  # left running when a test stopped the session early
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    if capability == kvserve._C.cpu_capability():
        capability_checks()  # this process already runs the variant
        return
    if capability not in capability_processes:
        pytest.skip(f"{capability} is above this process's {kvserve._C.cpu_capability()}")
    output, _ = capability_processes[capability].communicate(timeout=300)
    assert f"capability={capability}\n" in output, output
    assert capability_processes[capability].returncode == 0, output
