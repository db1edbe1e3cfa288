"""Read and check the header of a ``.safetensors`` file before anything is memory-mapped.

Layout: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that follows), and the
data. Every check the ``safetensors`` library makes is repeated here in Python, so that a damaged
file is reported with its path and the tensor at fault instead of surfacing later as a crash or
an opaque error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# Bits per element of every dtype the format defines.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: where a tensor's bytes are, and what they hold."""

    name: str
    file: Path
    dtype: str                # safetensors name: "F32", "BF16", ...
    shape: tuple[int, ...]
    begin: int                # byte offsets into the data section
    end: int
    # Rows (start, count) of the stored tensor that this entry is (a fused tensor split by
    # WeightIndex.split); shape is then theirs. None: the whole tensor.
    rows: tuple[int, int] | None = None


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one file, by name. Raises ValueError naming the file (and the tensor) when
    the file is truncated, its header is not valid JSON or an entry is inconsistent."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _invalid(path, f"it has {size} bytes, fewer than the 8-byte header length")
        header_bytes = int.from_bytes(prefix, "little")
        if header_bytes > size - 8:
            raise _invalid(path, f"its header length ({header_bytes} bytes) runs past the end of "
                                 f"the file ({size} bytes); it is truncated or not safetensors")
        if header_bytes > _MAX_HEADER_BYTES:
            raise _invalid(path, f"its header length ({header_bytes} bytes) exceeds "
                                 f"{_MAX_HEADER_BYTES} bytes")
        raw = f.read(header_bytes)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: deep nesting
        raise _invalid(path, f"its header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise _invalid(path, f"its header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(v, str) for v in metadata.values())):
        raise _invalid(path, "its '__metadata__' must map strings to strings")
    tensors = {name: _entry(path, name, entry) for name, entry in header.items()}
    _check_layout(path, tensors, size - 8 - header_bytes)
    return tensors


def _entry(path: Path, name: str, entry) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _invalid(path, f"header entry of tensor '{name}' is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise _invalid(path, f"tensor '{name}' has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _invalid(path, f"tensor '{name}' has shape {shape!r}; expected a list of "
                             "non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets))
            or offsets[0] > offsets[1]):
        raise _invalid(path, f"tensor '{name}' has data_offsets {offsets!r}; expected "
                             "[begin, end] with 0 <= begin <= end")
    nbits, nbytes = math.prod(shape) * DTYPE_BITS[dtype], offsets[1] - offsets[0]
    if nbits != nbytes * 8:
        raise _invalid(path, f"tensor '{name}' has data_offsets {offsets} ({nbytes} bytes), but "
                             f"shape {shape} of {dtype} needs {nbits / 8:g} bytes")
    return TensorInfo(name, path, dtype, tuple(shape), offsets[0], offsets[1])


def _check_layout(path: Path, tensors: dict[str, TensorInfo], data_bytes: int) -> None:
    """The tensors must tile the data section exactly: no overlap, no gap, nothing past the end
    (the rules safetensors itself enforces)."""
    covered = 0
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.end > data_bytes:
            raise _invalid(path, f"tensor '{t.name}' ends at byte {t.end} of the data, but the "
                                 f"file holds only {data_bytes} bytes of data; it is truncated")
        if t.begin < covered:
            raise _invalid(path, f"tensor '{t.name}' (bytes {t.begin}..{t.end}) overlaps the "
                                 "tensor before it")
        if t.begin > covered:
            raise _invalid(path, f"no tensor covers bytes {covered}..{t.begin} of the data, "
                                 f"before tensor '{t.name}'")
        covered = t.end
    if covered != data_bytes:
        raise _invalid(path, f"its tensors end at byte {covered} of the data, but the file holds "
                             f"{data_bytes} bytes of data")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicate = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"key '{duplicate}' appears twice")
    return dict(pairs)


def _invalid(path: Path, reason: str) -> ValueError:
    return ValueError(f"{path} is not a valid safetensors file: {reason}")
