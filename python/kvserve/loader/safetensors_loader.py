"""Load Hugging Face Llama-family weights from (sharded) safetensors files.

The tensors are memory-mapped by ``safetensors``, checked against the config's shapes, converted
to the requested dtype and fused the way the C++ layers expect: q/k/v into ``qkv_proj`` and
gate/up into ``gate_up_proj``. The returned names drop the ``model.`` prefix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve import _C


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a directory: model.safetensors, or the shards its index lists."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is malformed: {e}") from e
        files = sorted({model_dir / name for name in weight_map.values()})
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"weight shard {f} listed in the index does not exist")
    return files


class _TensorSource:
    """Looks tensors up by name across shards."""

    def __init__(self, files: list[Path]):
        self.handles = {}
        self.where: dict[str, object] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
                names = list(handle.keys())
            except Exception as e:  # safetensors raises its own error types for bad files
                raise ValueError(f"{f} is not a valid safetensors file: {e}") from e
            for name in names:
                self.where[name] = (handle, f)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name not in self.where:
            raise ValueError(f"the checkpoint has no tensor '{name}'")
        handle, f = self.where[name]
        try:
            tensor = handle.get_tensor(name)
        except Exception as e:
            raise ValueError(f"{f}: cannot read tensor '{name}': {e}") from e
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{f}: tensor '{name}' has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.to(dtype)

    def has(self, name: str) -> bool:
        return name in self.where


def load_weights(model_dir: Path, config: _C.ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Reads, checks, converts and fuses every weight the model needs."""
    src = _TensorSource(safetensors_files(Path(model_dir)))
    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
    w: dict[str, torch.Tensor] = {
        "embed_tokens.weight": src.get("model.embed_tokens.weight", (config.vocab_size, h), dtype),
        "norm.weight": src.get("model.norm.weight", (h,), dtype),
    }
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = src.get("lm_head.weight", (config.vocab_size, h), dtype)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out = f"layers.{i}."
        attn = p + "self_attn."
        w[out + "input_layernorm.weight"] = src.get(p + "input_layernorm.weight", (h,), dtype)
        w[out + "post_attention_layernorm.weight"] = src.get(
            p + "post_attention_layernorm.weight", (h,), dtype)
        w[out + "self_attn.qkv_proj.weight"] = torch.cat([
            src.get(attn + "q_proj.weight", (q_out, h), dtype),
            src.get(attn + "k_proj.weight", (kv_out, h), dtype),
            src.get(attn + "v_proj.weight", (kv_out, h), dtype),
        ])
        if config.qkv_bias:
            w[out + "self_attn.qkv_proj.bias"] = torch.cat([
                src.get(attn + "q_proj.bias", (q_out,), dtype),
                src.get(attn + "k_proj.bias", (kv_out,), dtype),
                src.get(attn + "v_proj.bias", (kv_out,), dtype),
            ])
        w[out + "self_attn.o_proj.weight"] = src.get(attn + "o_proj.weight", (h, q_out), dtype)
        if config.o_proj_bias:
            w[out + "self_attn.o_proj.bias"] = src.get(attn + "o_proj.bias", (h,), dtype)
        if config.qk_norm:
            w[out + "self_attn.q_norm.weight"] = src.get(attn + "q_norm.weight", (d,), dtype)
            w[out + "self_attn.k_norm.weight"] = src.get(attn + "k_norm.weight", (d,), dtype)
        mlp = p + "mlp."
        w[out + "mlp.gate_up_proj.weight"] = torch.cat([
            src.get(mlp + "gate_proj.weight", (inter, h), dtype),
            src.get(mlp + "up_proj.weight", (inter, h), dtype),
        ])
        w[out + "mlp.down_proj.weight"] = src.get(mlp + "down_proj.weight", (h, inter), dtype)
        if config.mlp_bias:
            w[out + "mlp.gate_up_proj.bias"] = torch.cat([
                src.get(mlp + "gate_proj.bias", (inter,), dtype),
                src.get(mlp + "up_proj.bias", (inter,), dtype),
            ])
            w[out + "mlp.down_proj.bias"] = src.get(mlp + "down_proj.bias", (h,), dtype)
    return {name: t.to(device).contiguous() for name, t in w.items()}
