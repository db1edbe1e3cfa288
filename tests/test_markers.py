"""The markers tests/conftest.py sets name what exists: a file renamed away from
UNSANITIZED_FILES or SERIAL would move its tests to the other pass unnoticed."""

from __future__ import annotations

from tests.conftest import REPO, SERIAL, UNSANITIZED_FILES


def test_every_marked_path_exists():
    missing = [path for path in (*SERIAL, *UNSANITIZED_FILES) if not (REPO / path).exists()]
    assert not missing, f"tests/conftest.py names paths that do not exist: {missing}"
