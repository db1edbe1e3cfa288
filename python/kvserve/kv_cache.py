"""The contiguous KVCache of the source notes (the class itself is C++)."""

from __future__ import annotations

from collections.abc import Iterable

from kvserve import _C

KVCache = _C.KVCache


def reset_all_caches(caches: Iterable[KVCache]) -> None:
    """Empties every cache of a model (one per layer) for a new sequence."""
    for cache in caches:
        cache.reset()
