"""Shared fixtures: tiny random checkpoints of each supported architecture, built once per run
with transformers (the reference implementation)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("KVSERVE_ASAN_SITE"):  # a pytest-xdist worker of make test-asan
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from asan_pytest import use_site

    use_site(os.environ["KVSERVE_ASAN_SITE"])

import kvserve.architectures  # noqa: E402

if os.environ.get("KVSERVE_ASAN_SITE"):  # the sanitized build, not the installed one
    _build = Path(os.environ["KVSERVE_ASAN_SITE"]).parent
    assert Path(os.path.realpath(kvserve._C.__file__)).parent == _build / "csrc", kvserve._C.__file__

ARCHITECTURES = list(kvserve.architectures.ARCHITECTURES)  # every supported one
REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """The shared data folder (corpora, stories260K): $KVSERVE_SHARED_DATA when set, else
    ../shared/data beside the checkout. Tests that need a file from it skip when it is absent."""
    configured = os.environ.get("KVSERVE_SHARED_DATA")
    return Path(configured) if configured else REPO.parent / "shared" / "data"


SHARED_DATA = shared_data_dir()

# Under pytest-xdist (make test runs the suite on every core), a worker's kernels use one thread:
# the workers share the cores, and oversubscribed thread pools would spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Tests that need the machine to themselves (make test runs them after the others, one at a
# time): servers and clients racing over real time, notebooks that time what they show, torchrun
# launches and servers over ranks, and a watchdog that times the engine's steps. The other tests
# of tests/distributed (two single-threaded ranks of a tiny model, bounded in time) share the
# cores like the rest.
SERIAL = ("tests/e2e/", "tests/distributed/test_tensor_parallel_launch.py",
          "tests/engine/test_async_backpressure.py")


# Tests the sanitized pass (make test-asan) leaves out, marked `unsanitized`: those whose work
# happens in subprocesses, which import the installed, uninstrumented build anyway (the command
# line and `serve`, the notebooks, the per-CPU-capability variants, the ranks of
# tests/distributed); the quantized checkpoints end to end (their ops' kernel tests run
# sanitized); the support table's trials (every feature's own tests run sanitized); and tests
# whose time goes to Python or transformers, which the sanitizer does not see: llama2.c
# conversion, GGUF files (read and converted to kvserve's layouts in Python; the corrupt ones
# also load in processes with limited address space, which ASan's shadow memory cannot take),
# perplexity against transformers, resident memory, detokenization, chat templates and bad
# words against transformers (the sampler's bad-word mask runs sanitized in test_sampler.py),
# distillation,
# scripts/train_tiny.py and `kvserve train-eagle` (PyTorch training around forwards the other
# tests cover), the
# speculative sampler's statistical tests (the same C++ as its exact ones), the config variants
# of the parity tests (each architecture's own parity test runs sanitized), speculative greedy
# equality in its single-request and target-as-its-own-draft forms (the mixed-arrivals form
# runs the same C++ paths sanitized), and the server's suites (answers, bad input, chaos, the
# router's workers in subprocesses), whose work is HTTP and Python (the C++ paths they reach run
# sanitized in tests/engine and ctest). CI runs each test once: these in make test, the others
# sanitized (.ci/run).
UNSANITIZED_FILES = (
    "tests/e2e/test_cli.py", "tests/e2e/test_notebooks.py", "tests/e2e/test_server.py",
    "tests/e2e/test_server_chaos.py", "tests/e2e/test_server_errors.py",
    "tests/e2e/test_router.py", "tests/distributed/", "tests/convert/",
    "tests/models/test_quantized_models.py", "tests/models/test_awq.py",
    "tests/models/test_llm_int8.py", "tests/models/test_quantized_moe.py",
    "tests/models/test_w8a8.py", "tests/models/test_support_matrix.py",
    "tests/models/test_perplexity.py", "tests/models/test_weight_memory.py",
    "tests/models/test_gguf.py", "tests/models/test_gguf_corrupt.py",
    "tests/models/test_distill.py",
    "tests/models/test_train_tiny.py", "tests/models/test_train_eagle.py",
    "tests/engine/test_detokenizer.py", "tests/engine/test_chat_template.py",
    "tests/engine/test_bad_words.py")
UNSANITIZED_NAMES = (
    "test_cpu_capability_variants", "test_train_tiny", "ten_thousand_tokens",
    "test_bf16_logits_within_tolerance", "follow_the_target_distribution",
    "test_greedy_single_requests_equal_plain_decoding", "self-draft", "test_the_serve_command",
    "test_config_variants_match_transformers")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)
        if item.nodeid.startswith(UNSANITIZED_FILES) or any(
                name in item.nodeid for name in UNSANITIZED_NAMES):
            item.add_marker(pytest.mark.unsanitized)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """make(architecture, dtype=torch.float32, **overrides) -> directory, cached per arguments."""
    from kvserve.testing.checkpoints import make_checkpoint

    cache: dict[str, Path] = {}

    def make(architecture: str = "LlamaForCausalLM", dtype: torch.dtype = torch.float32,
             **overrides) -> Path:
        key = repr((architecture, dtype, sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(architecture.replace("ForCausalLM", "").lower())
            cache[key] = make_checkpoint(out, architecture, dtype=dtype, **overrides)
        return cache[key]

    return make
