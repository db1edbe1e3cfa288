"""A GGUF file's metadata counts checked against the file's size, before the gguf package reads it.

The gguf package (0.19) parses every metadata array element by element and does not stop at the
end of the file: an array of numbers whose count was corrupted to billions (one flipped bit in
a count's high bytes) keeps appending empty parts until memory runs out. This walk reads only
the section's lengths, counts and types (the layout of the GGUF specification, version 2 and
3: magic, version, tensor count, entry count, then each entry's key, type and value) and
refuses a count that the bytes left in the file cannot hold. Everything else about the file is
left to the gguf package.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

# Bytes of each scalar value type (GGUF value types 0-7, 10-12); 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DEPTH = 8  # arrays of arrays


def check_metadata_bounds(path: Path) -> None:
    """Raises ValueError when a string or array in the metadata declares more bytes than the
    file has left; returns quietly on anything it does not understand (the gguf package then
    reports it)."""
    with open(path, "rb") as f:
        if f.seek(0, 2) < 24:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF" or struct.unpack_from("<I", data, 4)[0] not in (2, 3):
                return
            try:
                _Walk(path, data).entries(struct.unpack_from("<Q", data, 16)[0])
            except _Unknown:
                return


class _Walk:
    def __init__(self, path: Path, data: mmap.mmap):
        self.path, self.data, self.offset = path, data, 24

    def fail(self, what: str, needed: int) -> None:
        left = len(self.data) - self.offset
        raise ValueError(f"{self.path}: metadata {what} declares {needed} bytes at byte "
                         f"{self.offset}, but the file has {left} bytes left; it is truncated "
                         "or corrupt")

    def take(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            self.fail(what, size)
        value = struct.unpack_from(fmt, self.data, self.offset)[0]
        self.offset += size
        return value

    def skip(self, size: int, what: str) -> None:
        if size > len(self.data) - self.offset:
            self.fail(what, size)
        self.offset += size

    def string(self, what: str) -> None:
        self.skip(self.take("<Q", what), what)

    def entries(self, count: int) -> None:
        for i in range(count):
            start = self.offset + 8
            self.string(f"key {i}")
            key = bytes(self.data[start:self.offset]).decode("utf-8", "replace")
            self.value(self.take("<I", f"{key!r}'s type"), repr(key), 0)

    def value(self, kind: int, what: str, depth: int) -> None:
        if kind in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[kind], what)
        elif kind == _STRING:
            self.string(what)
        elif kind == _ARRAY and depth < _MAX_DEPTH:
            item = self.take("<I", f"{what}'s item type")
            count = self.take("<Q", f"{what}'s length")
            if item in _SCALAR_BYTES:
                self.skip(count * _SCALAR_BYTES[item], f"{what} ({count} items)")
                return
            # Strings and arrays take at least 8 bytes an item: check that before walking them.
            if count * 8 > len(self.data) - self.offset:
                self.fail(f"{what} ({count} items)", count * 8)
            for _ in range(count):
                self.value(item, what, depth + 1)
        else:
            raise _Unknown  # a type the gguf package will name


class _Unknown(Exception):
    pass
