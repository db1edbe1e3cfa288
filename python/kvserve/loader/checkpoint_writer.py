"""Writing a transformed checkpoint: its tensors as one safetensors file beside the source's
other files (config, tokenizer, generation config, model card)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_checkpoint(source_dir: Path, out_dir: Path, tensors: dict[str, torch.Tensor],
                     skip: tuple[str, ...] = ()) -> None:
    """Writes `tensors` to out_dir/model.safetensors and copies every other file of source_dir
    except its safetensors shards, their index and the names in `skip` (which the caller writes
    itself)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in source_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "model.safetensors.index.json", *skip):
            shutil.copy2(path, out_dir / path.name)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
