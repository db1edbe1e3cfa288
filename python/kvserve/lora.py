"""LoRA adapters in PEFT's format, merged into their base checkpoint.

An adapter directory holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules,
rank_pattern / alpha_pattern, fan_in_fan_out, modules_to_save, ...) and
`adapter_model.safetensors`, whose tensors are named `base_model.model.<module>.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r] (`lora_embedding_A` / `lora_embedding_B` for an
embedding), plus whole tensors that replace the base's (modules_to_save, trained biases).
Merging puts the replacements in place, then adds scaling * B @ A to each targeted weight,
scaling = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA), as peft's merge_and_unload does;
the result is an ordinary checkpoint of the base's architecture.

    kvserve.merge_lora("base", "adapter", "merged")
    python -m kvserve merge-lora --base base --adapter adapter --out merged
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvserve.loader.checkpoint_writer import write_checkpoint

PREFIX = "base_model.model."
LORA_PARTS = {"lora_A.weight": "A", "lora_B.weight": "B",
              "lora_embedding_A": "A_embedding", "lora_embedding_B": "B_embedding"}


def _pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern: the first key that matches the module's name or a
    dotted suffix of it (a regular expression), else the default."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", module):
            return value
    return default


def read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]],
                                               dict[str, torch.Tensor]]:
    """(config, {module: {"A"|"B"|...: tensor}}, {base tensor name: replacement})."""
    config_path = adapter_dir / "adapter_config.json"
    weights_path = adapter_dir / "adapter_model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{adapter_dir} is not a PEFT adapter: no {path.name}")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: a {config['peft_type']} adapter, not LoRA")
    if config.get("use_dora"):
        raise ValueError(f"{adapter_dir}: DoRA adapters (use_dora) cannot be merged by kvserve")
    if config.get("lora_bias"):
        raise ValueError(f"{adapter_dir}: adapters with a LoRA bias (lora_bias) are not supported")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    replacements: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(weights_path).items():
        if not name.startswith(PREFIX):
            raise ValueError(f"{adapter_dir}: unexpected tensor {name!r} (expected names under "
                             f"{PREFIX!r})")
        name = name[len(PREFIX):]
        for suffix, part in LORA_PARTS.items():
            if name.endswith("." + suffix):
                modules.setdefault(name[:-len(suffix) - 1], {})[part] = tensor
                break
        else:  # modules_to_save, trained biases, and the base weight of a targeted embedding
            # (peft saves it as <module>.base_layer.weight, in case its vocabulary was resized)
            replacements[name.replace(".base_layer.", ".")] = tensor
    for module, parts in modules.items():
        if set(parts) not in ({"A", "B"}, {"A_embedding", "B_embedding"}):
            raise ValueError(f"{adapter_dir}: {module} has {sorted(parts)}, not a LoRA pair")
    return config, modules, replacements


def lora_scaling(config: dict, module: str) -> float:
    """lora_alpha / r for `module` (lora_alpha / sqrt(r) with rsLoRA), after rank_pattern and
    alpha_pattern."""
    r = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def lora_delta(config: dict, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The update of `module`'s weight, in fp32 and the weight's layout."""
    scaling = lora_scaling(config, module)
    if "A" in parts:
        a, b = parts["A"].float(), parts["B"].float()  # [r, in], [out, r]
        delta = b @ a
        return delta.T * scaling if config.get("fan_in_fan_out") else delta * scaling
    a, b = parts["A_embedding"].float(), parts["B_embedding"].float()  # [r, vocab], [dim, r]
    return (b @ a).T * scaling


def merge_lora(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> dict:
    """Writes base + adapter to out_dir (one model.safetensors in the base's dtypes, the base's
    other files copied, a model card) and returns {"merged": modules, "replaced": tensors}.
    Raises FileNotFoundError for a missing file and ValueError for an adapter that does not fit
    the base (a module the base lacks, a shape that differs) or cannot be merged (DoRA)."""
    base_dir, adapter_dir, out_dir = Path(base_dir), Path(adapter_dir), Path(out_dir)
    if out_dir.resolve() in (base_dir.resolve(), adapter_dir.resolve()):
        raise ValueError("--out must be a new directory, not the base's or the adapter's")
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{base_dir} has no *.safetensors files")
    config, modules, replacements = read_adapter(adapter_dir)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    for name, tensor in replacements.items():
        if name not in tensors or tensors[name].shape != tensor.shape:
            raise ValueError(f"the adapter replaces {name}, which {base_dir} does not hold with "
                             f"shape {tuple(tensor.shape)}")
        tensors[name] = tensor.to(tensors[name].dtype)
    for module, parts in sorted(modules.items()):
        name = f"{module}.weight"
        if name not in tensors:
            raise ValueError(f"the adapter changes {module}, which {base_dir} does not hold "
                             f"(a tied weight, or another architecture)")
        weight = tensors[name]
        delta = lora_delta(config, module, parts)
        if delta.shape != weight.shape:
            raise ValueError(f"the adapter's update of {module} is {tuple(delta.shape)}, the "
                             f"base weight {tuple(weight.shape)}")
        tensors[name] = (weight.float() + delta).to(weight.dtype)
    write_checkpoint(base_dir, out_dir, tensors, skip=("README.md",))
    targets = sorted({m.rsplit(".", 1)[-1] for m in modules})
    (out_dir / "README.md").write_text(
        f"# {out_dir.name}\n\n{base_dir.name} with the LoRA adapter {adapter_dir.name} merged "
        f"by `kvserve.merge_lora`: r = {config['r']}, lora_alpha = {config['lora_alpha']}"
        f"{', rsLoRA' if config.get('use_rslora') else ''}, {len(modules)} weights updated "
        f"({', '.join(targets)}), {len(replacements)} replaced.\n")
    return {"merged": sorted(modules), "replaced": sorted(replacements)}
