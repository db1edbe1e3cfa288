"""Load Hugging Face Llama-family weights from (sharded) safetensors files.

Every header is read and checked first (``WeightIndex``), and every tensor the config implies is
checked against it (``check_weights``): names, dtypes, shapes, offsets and file sizes are all
known good before a byte of tensor data is read. The tensors are then memory-mapped by
``safetensors``, converted to the requested dtype and fused the way the C++ layers expect: q/k/v
into ``qkv_proj`` and gate/up into ``gate_up_proj``. The returned names drop the ``model.`` prefix.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from kvserve import _C
from kvserve.loader.weight_check import check_weights
from kvserve.loader.weight_index import WeightIndex


class _TensorReader:
    """Reads checked tensors, opening each file once."""

    def __init__(self, index: WeightIndex, dtype: torch.dtype):
        self.index, self.dtype, self.handles = index, dtype, {}

    def __call__(self, name: str) -> torch.Tensor:
        info = self.index.tensors[name]
        try:
            if info.file not in self.handles:
                self.handles[info.file] = safe_open(str(info.file), framework="pt")
            tensor = self.handles[info.file].get_tensor(name)
        except Exception as e:  # safetensors raises its own error types; its checks mirror ours
            raise ValueError(f"{info.file}: cannot read tensor '{name}': {e}") from e
        # A copy even in the same dtype: a tensor that views the memory map would keep the whole
        # file mapped (and its pages resident) for as long as the model lives.
        return tensor.to(self.dtype, copy=True)


def load_weights(model_dir: Path, config: _C.ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Reads, checks, converts and fuses every weight the model needs.

    Raises FileNotFoundError for a missing weight file and ValueError, naming the file and the
    tensor, for a malformed one or one that disagrees with the config."""
    model_dir = Path(model_dir)
    index = WeightIndex.from_dir(model_dir)
    check_weights(index, config, model_dir / "config.json")
    read = _TensorReader(index, dtype)
    w: dict[str, torch.Tensor] = {
        "embed_tokens.weight": read("model.embed_tokens.weight"),
        "norm.weight": read("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = read("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out = f"layers.{i}."
        attn = p + "self_attn."
        w[out + "input_layernorm.weight"] = read(p + "input_layernorm.weight")
        w[out + "post_attention_layernorm.weight"] = read(p + "post_attention_layernorm.weight")
        w[out + "self_attn.qkv_proj.weight"] = torch.cat(
            [read(attn + f"{x}_proj.weight") for x in "qkv"])
        if config.qkv_bias:
            w[out + "self_attn.qkv_proj.bias"] = torch.cat(
                [read(attn + f"{x}_proj.bias") for x in "qkv"])
        w[out + "self_attn.o_proj.weight"] = read(attn + "o_proj.weight")
        if config.o_proj_bias:
            w[out + "self_attn.o_proj.bias"] = read(attn + "o_proj.bias")
        if config.qk_norm:
            w[out + "self_attn.q_norm.weight"] = read(attn + "q_norm.weight")
            w[out + "self_attn.k_norm.weight"] = read(attn + "k_norm.weight")
        mlp = p + "mlp."
        w[out + "mlp.gate_up_proj.weight"] = torch.cat(
            [read(mlp + "gate_proj.weight"), read(mlp + "up_proj.weight")])
        w[out + "mlp.down_proj.weight"] = read(mlp + "down_proj.weight")
        if config.mlp_bias:
            w[out + "mlp.gate_up_proj.bias"] = torch.cat(
                [read(mlp + "gate_proj.bias"), read(mlp + "up_proj.bias")])
            w[out + "mlp.down_proj.bias"] = read(mlp + "down_proj.bias")
    return {name: t.to(device).contiguous() for name, t in w.items()}
