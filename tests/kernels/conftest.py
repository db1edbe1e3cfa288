"""Kernel tests: the CPU-capability processes of modules that define capability_checks(), and,
where torch sees a GPU and kvserve was built with CUDA, every kernel test once more on CUDA."""

import pytest
import torch

import kvserve
from tests.kernels.capability import start_processes
from tests.kernels.cuda_ops import CudaOps


def kernel_devices() -> list[str]:
    cuda = torch.cuda.is_available() and kvserve._C.built_with_cuda()
    return ["cpu", "cuda"] if cuda else ["cpu"]


def pytest_generate_tests(metafunc):
    """On a GPU machine, every test of a kernel module runs with `ops` on the CPU and on CUDA
    (tests/kernels/cuda_ops.py), except the CPU-capability variants, tests already written for
    CUDA (marked cuda). Elsewhere nothing is parametrized, so test ids are the CPU ones."""
    devices = kernel_devices()
    definition = metafunc.definition
    if (len(devices) == 1 or not hasattr(metafunc.module, "ops")
            or definition.originalname == "test_cpu_capability_variants"
            or definition.get_closest_marker("cuda")):
        return
    metafunc.fixturenames.append("kernel_device")
    metafunc.parametrize("kernel_device", [
        pytest.param(d, marks=[pytest.mark.cuda] if d == "cuda" else []) for d in devices])


def pytest_collection_modifyitems(config, items):
    """Cases of CPU-only behaviour (marked cpu_only, on the test or one parameter set) skip on
    CUDA."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if (callspec is not None and callspec.params.get("kernel_device") == "cuda"
                and item.get_closest_marker("cpu_only")):
            item.add_marker(pytest.mark.skip(reason="a property of the CPU op"))


@pytest.fixture(autouse=True)
def _ops_on_kernel_device(request, monkeypatch):
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("kernel_device") == "cuda":
        monkeypatch.setattr(request.module, "ops", CudaOps())


@pytest.fixture(scope="module", autouse=True)
def capability_processes(request):
    """Started with the module when it has capability_checks() and its
    test_cpu_capability_variants is selected; {} otherwise."""
    module = request.module
    selected = hasattr(module, "capability_checks") and any(
        item.module is module and item.originalname == "test_cpu_capability_variants"
        for item in request.session.items)
    processes = start_processes(module) if selected else {}
    yield processes
    for proc in processes.values():  # left running when a test stopped the session early
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
