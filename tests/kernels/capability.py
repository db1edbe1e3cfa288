"""Running a kernel test module's `capability_checks()` under every CPU capability variant.

KVSERVE_CPU_CAPABILITY only lowers the variant at process start, so each lower variant runs in a
fresh process. The processes start with the module (tests/kernels/conftest.py), so they run beside
its other tests; test_cpu_capability_variants then waits for them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kvserve

# Every variant, in kvserve::cpu::Capability's order; the VNNI and AMX extensions hold only the
# integer dot-product kernels (modules that test them set CPU_CAPABILITIES = ALL_CAPABILITIES).
ALL_CAPABILITIES = ["default", "avx2", "avx2_vnni", "avx512", "avx512_vnni", "avx512_amx"]
CAPABILITIES = ["default", "avx2", "avx512"]


def capabilities_of(module) -> list[str]:
    """The variants `module`'s kernels are built in."""
    return getattr(module, "CPU_CAPABILITIES", CAPABILITIES)


def running_here(capabilities: list[str]) -> str:
    """Which of `capabilities` this process's kernels run: the best one at or below ours."""
    ours = ALL_CAPABILITIES.index(kvserve._C.cpu_capability())
    supported = kvserve._C.supported_cpu_capabilities()
    return [cap for cap in capabilities
            if ALL_CAPABILITIES.index(cap) <= ours and cap in supported][-1]


def start_processes(module) -> dict[str, subprocess.Popen]:
    """{capability: process running module.capability_checks()} for each other variant of the
    module's that this CPU runs and this build holds."""
    capabilities = capabilities_of(module)
    here_cap = running_here(capabilities)
    ours = ALL_CAPABILITIES.index(kvserve._C.cpu_capability())
    name = module.__name__.rpartition(".")[2]
    here = os.path.dirname(os.path.abspath(module.__file__))
    root = os.path.dirname(os.path.dirname(here))  # the repository, for `tests.kernels...`
    script = (f"import sys; sys.path[:0] = [{here!r}, {root!r}]; "
              f"import kvserve; print('capability=' + kvserve._C.cpu_capability()); "
              f"import {name} as m; m.capability_checks()")
    # One thread each: they share the cores with this process (the vector code is what differs).
    return {cap: subprocess.Popen([sys.executable, "-c", script], text=True,
                                  env={**os.environ, "KVSERVE_CPU_CAPABILITY": cap,
                                       "OMP_NUM_THREADS": "1"},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for cap in capabilities
            if cap != here_cap and ALL_CAPABILITIES.index(cap) <= ours
            and cap in kvserve._C.supported_cpu_capabilities()
            and cap in kvserve._C.built_cpu_capabilities()}


def check_variant(capability: str, processes: dict[str, subprocess.Popen], checks) -> None:
    """Passes when `checks` pass under `capability` (here, or in its process)."""
    if capability == running_here(capabilities_of(sys.modules[checks.__module__])):
        checks()  # this process already runs the variant
        return
    if capability not in kvserve._C.built_cpu_capabilities():
        pytest.skip(f"this build lacks the {capability} variant (KVSERVE_CPU_CAPABILITIES)")
    if capability not in processes:
        pytest.skip(f"this CPU lacks {capability} (it runs {kvserve._C.cpu_capability()}; "
                    f"it has {', '.join(kvserve._C.supported_cpu_capabilities())})")
    output, _ = processes[capability].communicate(timeout=300)
    assert f"capability={capability}\n" in output, output
    assert processes[capability].returncode == 0, output
