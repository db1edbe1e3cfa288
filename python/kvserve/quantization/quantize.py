"""`python -m kvserve quantize`: a plain Hugging Face checkpoint -> a quantized one that kvserve
(and the format's other readers) load.

Methods (round to nearest; the weights alone, no calibration data):
- int8: symmetric int8 per output channel, written as compressed-tensors int-quantized;
- w8a8: the same weights, with dynamic per-token int8 activations in the config: kvserve runs
  them int8 x int8 (llm_int8_linear with no outliers);
- fp8: float8_e4m3fn per output channel, written as compressed-tensors float-quantized;
- llm.int8: int8 per output channel run as LLM.int8() (activation columns with an |x| >= 6.0 in
  floating point, the rest int8 x int8), written as bitsandbytes 8-bit (`weight` + `SCB`);
- int4: asymmetric int4 with zero points per group of --group-size inputs (128 by default; 64, 32),
  written in AWQ's gemm layout;
- awq: int4 as above after AWQ's activation-aware scales and clipping, calibrated on the text of
  --calibration (`kvserve.quantization.awq`).
Attention and MLP projections are quantized; embeddings, norms, the LM head and MoE routers are
copied as they are, and so is a projection whose shape the int4 layout cannot hold (in_features
not a multiple of the group size, out_features not of 8): it is listed in the config's
`modules_to_not_convert`, as AutoAWQ does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvserve.quantization.formats import (
    CheckpointQuantization,
    awq_config,
    awq_tensors,
    bitsandbytes_config,
    bitsandbytes_tensors,
    compressed_tensors_config,
    compressed_tensors_tensors,
)
from kvserve.quantization.weights import quantize_fp8, quantize_int4, quantize_int8

METHODS = ("int8", "w8a8", "llm.int8", "fp8", "int4", "awq")
LLM_INT8_THRESHOLD = 6.0  # bitsandbytes' default: the paper's outlier magnitude


def quantize_checkpoint(model_dir: Path, out_dir: Path, method: str, group_size: int = 128,
                        calibration: Path | None = None) -> dict:
    """Writes the quantized checkpoint to out_dir (config.json with its quantization_config, one
    model.safetensors, the other files copied) and returns its quantization_config. Raises
    ValueError for an unknown method, an already quantized checkpoint or a layer whose shape the
    format cannot hold."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    config = json.loads((model_dir / "config.json").read_text())
    if "quantization_config" in config:
        method_there = config["quantization_config"].get("quant_method")
        raise ValueError(f"{model_dir} is already quantized ({method_there})")
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError("--out must be another directory than --model")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
    int4 = method in ("int4", "awq")
    if int4 and (group_size <= 0 or group_size % 32):
        raise ValueError(f"--group-size must be a positive multiple of 32, got {group_size}")
    if (method == "awq") != (calibration is not None):
        raise ValueError("--calibration FILE (text) is what --method awq calibrates on, and "
                         "only it")
    source: dict[str, torch.Tensor] = {}
    for file in files:
        source.update(load_file(file))
    if method == "awq":
        from kvserve.quantization.awq import awq_transform

        awq_transform(model_dir, source, Path(calibration), group_size)
    covers = CheckpointQuantization(method, 8, -1).covers
    tensors: dict[str, torch.Tensor] = {}
    plain: list[str] = []
    for name, t in source.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and t.dim() == 2 and covers(module)):
            tensors[name] = t
        elif int4 and (t.shape[1] % group_size or t.shape[0] % 8):
            tensors[name] = t
            plain.append(module)
        else:
            tensors.update(_quantized(module, t, method, group_size))
    if int4:
        qc = awq_config(group_size, plain)
    elif method == "llm.int8":
        qc = bitsandbytes_config(LLM_INT8_THRESHOLD)
    else:
        qc = compressed_tensors_config("float" if method == "fp8" else "int", method == "w8a8")
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(path, out_dir / path.name)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = qc
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return qc


def _quantized(module: str, w: torch.Tensor, method: str,
               group_size: int) -> dict[str, torch.Tensor]:
    if method in ("int8", "w8a8"):
        return compressed_tensors_tensors(module, quantize_int8(w))
    if method == "llm.int8":
        return bitsandbytes_tensors(module, quantize_int8(w))
    if method == "fp8":
        return compressed_tensors_tensors(module, quantize_fp8(w))
    return awq_tensors(module, quantize_int4(w, group_size))
