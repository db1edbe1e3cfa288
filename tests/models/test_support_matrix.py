"""The table of what each architecture supports (docs/models.md) holds: each of its cells, tried
again on the architecture's tiny checkpoint (kvserve.testing.support), gives what
docs/support_matrix.json records, and the table is what scripts/support_matrix.py writes from
that file. Tensor parallelism's cells start two single-threaded ranks of a tiny model each: in
this (parallel) lane, not the serial one of tests/distributed, as they need no core to
themselves."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvserve.testing.support import FEATURES, greedy, try_feature
from tests.conftest import ARCHITECTURES, REPO


def load_script():
    spec = importlib.util.spec_from_file_location("support_matrix",
                                                  REPO / "scripts" / "support_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


script = load_script()
RECORDED = json.loads(script.RESULTS.read_text())["cells"]


def test_the_table_is_what_the_script_writes_from_the_results():
    doc = script.DOC.read_text(encoding="utf-8")
    assert script.rewrite(doc, script.render({"cells": RECORDED})) == doc, \
        "docs/models.md is out of date: python scripts/support_matrix.py"


def test_every_architecture_has_a_row_with_every_feature():
    assert list(RECORDED) == ARCHITECTURES
    for architecture, cells in RECORDED.items():
        assert list(cells) == list(FEATURES), architecture


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_trying_each_feature_again_gives_the_recorded_cell(checkpoint_factory, tmp_path,
                                                            architecture):
    path = checkpoint_factory(architecture)
    plain = greedy(path)
    for feature in FEATURES:
        if feature == "tensor_parallel":
            continue
        got = try_feature(architecture, feature, path, tmp_path / feature, plain)
        assert got == RECORDED[architecture][feature], (
            f"{feature}: now {got}; rerun python scripts/support_matrix.py --arch {architecture}")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_two_ranks_give_the_recorded_cell(checkpoint_factory, tmp_path, architecture):
    got = try_feature(architecture, "tensor_parallel", checkpoint_factory(architecture),
                      tmp_path)
    assert got == RECORDED[architecture]["tensor_parallel"], (
        f"now {got}; rerun python scripts/support_matrix.py --arch {architecture}")
