"""Runs pytest against the sanitizer build (`make test-asan`): the kvserve package from this
checkout with the AddressSanitizer + UndefinedBehaviorSanitizer build of its extension, instead of
the installed one. Python itself is not instrumented, so the sanitizer runtimes must be preloaded
(LD_PRELOAD, as the Makefile does). pytest-xdist's workers make the same swap
(tests/conftest.py, from KVSERVE_ASAN_SITE, which this sets); other subprocesses that the tests
start (the per-CPU-capability kernel checks) import the installed build.

    python scripts/asan_pytest.py BUILD_DIR [pytest arguments]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SITE_VARIABLE = "KVSERVE_ASAN_SITE"


def package_dir(build: Path) -> Path:
    """BUILD_DIR/site/kvserve: links to the Python sources and the sanitizer build's libraries."""
    repo = Path(__file__).resolve().parents[1]
    site = build / "site"
    package = site / "kvserve"
    package.mkdir(parents=True, exist_ok=True)
    libraries = [*build.glob("csrc/_C*.so"), *build.glob("csrc/libkvserve_runtime.so")]
    if len(libraries) != 2:
        sys.exit(f"{build}: no sanitizer build of _C and libkvserve_runtime (run make test-asan)")
    for source in [*(repo / "python" / "kvserve").iterdir(), *libraries]:
        link = package / source.name
        if source.name != "__pycache__" and not link.exists():
            link.symlink_to(source.resolve())
    return site


def use_site(site: str) -> None:
    """Imports kvserve from `site` (package_dir's) instead of the installed package."""
    # The editable install's import hook would load the installed extension; drop it.
    sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
    if sys.path[:1] != [site]:
        sys.path.insert(0, site)


def main() -> None:
    build = Path(sys.argv[1]).resolve()
    site = str(package_dir(build))
    os.environ[SITE_VARIABLE] = site  # for pytest-xdist's workers (tests/conftest.py)
    use_site(site)
    import kvserve

    assert Path(kvserve._C.__file__).resolve().parent == build / "csrc", kvserve._C.__file__
    print(f"kvserve from {kvserve.__file__}, extension {os.path.realpath(kvserve._C.__file__)}")
    import pytest

    sys.exit(pytest.main(sys.argv[2:]))


if __name__ == "__main__":
    main()
