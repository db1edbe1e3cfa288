"""Kernel tests: the CPU-capability processes of modules that define capability_checks()."""

import pytest

from tests.kernels.capability import start_processes


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
