"""Parse a Hugging Face ``config.json`` into the C++ runtime's ``ModelConfig``.

Everything that can be wrong with a checkpoint directory's configuration is reported here, as a
``FileNotFoundError`` or ``ValueError`` that names the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve import _C

# Families that differ from plain Llama only in these ModelConfig flags.
_QKV_BIAS_ARCHITECTURES = {"Qwen2ForCausalLM"}
_QK_NORM_ARCHITECTURES = {"Qwen3ForCausalLM"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CheckpointInfo:
    """What kvserve reads from a checkpoint directory besides the weights."""

    model_dir: Path
    config: _C.ModelConfig
    hf_config: dict
    checkpoint_dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None


def read_json(path: Path) -> dict:
    """Loads a JSON object, with a clear error when the file is missing or malformed."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """Maps "auto" / "float32" / "bfloat16" / "float16" / a torch.dtype to a torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(_DTYPES)}")
        return dtype
    if dtype == "auto":
        return checkpoint_dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def load_checkpoint_info(model_dir: str | Path) -> CheckpointInfo:
    """Reads config.json (and generation_config.json if present) of a Hugging Face directory."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    hf = read_json(model_dir / "config.json")
    config = _model_config(hf, model_dir / "config.json")
    generation = model_dir / "generation_config.json"
    generation_config = read_json(generation) if generation.is_file() else {}
    eos = generation_config.get("eos_token_id", hf.get("eos_token_id"))
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    dtype_name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    checkpoint_dtype = _DTYPES.get(str(dtype_name).replace("torch.", ""), torch.float32)
    return CheckpointInfo(model_dir, config, hf, checkpoint_dtype, eos_ids, hf.get("bos_token_id"))


def _require(hf: dict, key: str, path: Path, kind=int):
    if key not in hf:
        raise ValueError(f"{path}: missing required field '{key}'")
    value = hf[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{path}: '{key}' must be a non-negative integer, got {value!r}")
    return value


def _model_config(hf: dict, path: Path) -> _C.ModelConfig:
    architectures = hf.get("architectures")
    supported = _C.supported_architectures()
    if not architectures or not isinstance(architectures, list):
        raise ValueError(f"{path}: missing 'architectures'; kvserve supports: {', '.join(supported)}")
    if architectures[0] not in supported:
        raise ValueError(
            f"{path}: unsupported architecture '{architectures[0]}'; "
            f"kvserve supports: {', '.join(supported)}"
        )
    c = _C.ModelConfig()
    c.architecture = architectures[0]
    c.vocab_size = _require(hf, "vocab_size", path)
    c.hidden_size = _require(hf, "hidden_size", path)
    c.intermediate_size = _require(hf, "intermediate_size", path)
    c.num_layers = _require(hf, "num_hidden_layers", path)
    c.num_heads = _require(hf, "num_attention_heads", path)
    c.num_kv_heads = hf.get("num_key_value_heads") or c.num_heads
    head_dim = hf.get("head_dim")
    c.head_dim = head_dim if head_dim else c.hidden_size // max(c.num_heads, 1)
    c.max_position_embeddings = _require(hf, "max_position_embeddings", path)
    c.rms_norm_eps = float(hf.get("rms_norm_eps", 1e-6))
    c.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
    attention_bias = bool(hf.get("attention_bias", False))
    c.qkv_bias = attention_bias or c.architecture in _QKV_BIAS_ARCHITECTURES
    c.o_proj_bias = attention_bias and c.architecture not in _QKV_BIAS_ARCHITECTURES
    c.mlp_bias = bool(hf.get("mlp_bias", False))
    c.qk_norm = c.architecture in _QK_NORM_ARCHITECTURES
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"{path}: hidden_act '{hf['hidden_act']}' is not supported (only silu)")
    _rope(c, hf, path)
    c.sliding_windows = _sliding_windows(hf, c.num_layers)
    try:
        c.validate()
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return c


def _rope(c: _C.ModelConfig, hf: dict, path: Path) -> None:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` and
    # `rope_scaling`.
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    c.rope_theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    s = _C.RopeScaling()
    s.rope_type = params.get("rope_type", params.get("type", "default"))
    if s.rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ValueError(
            f"{path}: rope type '{s.rope_type}' is not supported (default, linear, llama3, yarn)"
        )
    if s.rope_type != "default" and "factor" not in params:
        raise ValueError(f"{path}: rope scaling '{s.rope_type}' needs a 'factor'")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
        if params.get(key) is not None:
            setattr(s, key, float(params[key]))
    if params.get("attention_factor") is not None:
        s.attention_factor = float(params["attention_factor"])
    if params.get("original_max_position_embeddings") is not None:
        s.original_max_position_embeddings = int(params["original_max_position_embeddings"])
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor != 1 is not supported")
    c.rope_scaling = s


def _sliding_windows(hf: dict, num_layers: int) -> list[int]:
    window = hf.get("sliding_window")
    if not window:
        return [0] * num_layers
    layer_types = hf.get("layer_types")
    if layer_types is not None:  # Qwen2/3 and hybrid layouts say per layer
        return [int(window) if t == "sliding_attention" else 0 for t in layer_types]
    if "use_sliding_window" in hf and not hf["use_sliding_window"]:
        return [0] * num_layers
    return [int(window)] * num_layers
