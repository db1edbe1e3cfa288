"""Shared fixtures: tiny random checkpoints of each supported architecture, built once per run
with transformers (the reference implementation)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import kvserve.architectures

ARCHITECTURES = list(kvserve.architectures.ARCHITECTURES)  # every supported one
REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """The shared data folder (corpora, stories260K): $KVSERVE_SHARED_DATA when set, else
    ../shared/data beside the checkout. Tests that need a file from it skip when it is absent."""
    configured = os.environ.get("KVSERVE_SHARED_DATA")
    return Path(configured) if configured else REPO.parent / "shared" / "data"


SHARED_DATA = shared_data_dir()


def pytest_collection_modifyitems(config, items):
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
