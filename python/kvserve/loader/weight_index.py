"""Which file holds which tensor: ``model.safetensors``, or the shards that
``model.safetensors.index.json`` lists, with every header read and checked up front."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path, PurePosixPath

from kvserve.loader.safetensors_header import TensorInfo, read_safetensors_header

INDEX_NAME = "model.safetensors.index.json"


def kvserve_name(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint's tensor name as kvserve's: rewritten by the first (pattern, replacement)
    regular expression that matches it (Architecture.weight_names), else as it is."""
    for pattern, replacement in renames:
        new, count = re.subn(pattern, replacement, name)
        if count:
            return new
    return name


class WeightIndex:
    """The checked headers of a checkpoint's weight files, by tensor name.

    ``source`` names what lists the tensors (the index file, or the single weight file), for
    error messages about a tensor that is not there."""

    def __init__(self, tensors: dict[str, TensorInfo], files: list[Path], source: str):
        self.tensors, self.files, self.source = tensors, files, source

    @classmethod
    def from_dir(cls, model_dir: Path) -> WeightIndex:
        """Raises FileNotFoundError for a missing weight file, ValueError for a malformed one."""
        index = model_dir / INDEX_NAME
        if index.is_file():
            return cls._from_index(model_dir, index)
        single = model_dir / "model.safetensors"
        files = [single] if single.is_file() else sorted(
            f for f in model_dir.glob("*.safetensors") if f.is_file())
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_safetensors_header(f).items():
                if name in tensors:
                    raise ValueError(f"tensor '{name}' is in both {tensors[name].file} and {f}")
                tensors[name] = info
        source = str(files[0]) if len(files) == 1 else f"the *.safetensors files in {model_dir}"
        return cls(tensors, files, source)

    def renamed(self, renames: tuple[tuple[str, str], ...]) -> WeightIndex:
        """The same tensors under kvserve's names: each name rewritten by the first
        (pattern, replacement) regular expression that matches it (Architecture.weight_names);
        a tensor still reads by its stored name (TensorInfo.name). Raises ValueError when two
        tensors get one name."""
        if not renames:
            return self
        tensors: dict[str, TensorInfo] = {}
        for name, info in self.tensors.items():
            new = kvserve_name(name, renames)
            if new in tensors:
                raise ValueError(f"{self.source}: tensors '{tensors[new].name}' and '{name}' "
                                 f"are both kvserve's '{new}'")
            tensors[new] = info
        return WeightIndex(tensors, self.files, self.source)

    def split(self, splits: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]) -> WeightIndex:
        """The same tensors with each fused module that a split names read as its parts: a split
        is (the fused module's name suffix, ((a part's name suffix, its rows), ...)), the parts in
        row order (Architecture.split_weights: Phi-3's qkv_proj as q_proj, k_proj and v_proj).
        Every tensor of the module (its weight, and a quantized weight's per-row scales) is read
        as each part's rows of it (TensorInfo.rows); a scalar (a per-tensor scale, a format tag)
        as every part's. Raises ValueError when a tensor's first dimension is not the parts' sum
        of rows (int4 formats pack outputs in columns)."""
        if not splits:
            return self
        tensors: dict[str, TensorInfo] = {}
        for name, info in self.tensors.items():
            module, _, suffix = name.rpartition(".")
            split = next(((fused, parts) for fused, parts in splits
                          if module == fused or module.endswith("." + fused)), None)
            if split is None:
                tensors[name] = info
                continue
            fused, parts = split
            rows = sum(count for _, count in parts)
            prefix = module[:len(module) - len(fused)]
            if tuple(info.shape) in ((), (1,)):  # the whole tensor's (a per-tensor scale, a
                for part, _ in parts:             # format tag): every part's too
                    tensors[f"{prefix}{part}.{suffix}"] = info
                continue
            if info.shape[0] != rows:
                raise ValueError(f"{self.source}: tensor '{name}' has shape {list(info.shape)}; "
                                 f"the config's {' + '.join(p for p, _ in parts)} make {rows} "
                                 "rows (kvserve reads each part's rows of it)")
            start = 0
            for part, count in parts:
                tensors[f"{prefix}{part}.{suffix}"] = dataclasses.replace(
                    info, shape=(count, *info.shape[1:]), rows=(start, count))
                start += count
        return WeightIndex(tensors, self.files, self.source)

    @classmethod
    def _from_index(cls, model_dir: Path, index: Path) -> WeightIndex:
        weight_map = _read_weight_map(index)
        headers: dict[str, dict[str, TensorInfo]] = {}
        for shard in sorted(set(weight_map.values())):
            path = model_dir / shard
            if not path.is_file():
                tensor = next(n for n, s in weight_map.items() if s == shard)
                raise FileNotFoundError(f"{index} maps tensor '{tensor}' to shard {shard}, "
                                        f"but {path} does not exist")
            headers[shard] = read_safetensors_header(path)
        tensors = {}
        for name, shard in weight_map.items():
            if name not in headers[shard]:
                raise ValueError(f"{index} maps tensor '{name}' to {shard}, but "
                                 f"{model_dir / shard} has no such tensor")
            tensors[name] = headers[shard][name]
        return cls(tensors, [model_dir / s for s in headers], str(index))


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        value = json.loads(index.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSON or UTF-8 errors; RecursionError: deep nesting
        raise ValueError(f"{index} is not valid JSON: {e}") from e
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} must hold a JSON object with a non-empty 'weight_map' object "
                         "(tensor name -> shard file)")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _is_plain_file_name(shard):
            raise ValueError(f"{index}: 'weight_map' maps tensor '{name}' to {shard!r}; expected "
                             "the name of a .safetensors file beside the index")
    return weight_map


def _is_plain_file_name(name: str) -> bool:
    """A relative path that stays inside the model directory."""
    parts = PurePosixPath(name).parts
    return (bool(parts) and not PurePosixPath(name).is_absolute() and ".." not in parts
            and "\\" not in name and name.endswith(".safetensors"))
