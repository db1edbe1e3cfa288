"""Parse a Hugging Face ``config.json`` into the C++ runtime's ``ModelConfig``.

Every field kvserve reads is checked here for type and range, before anything is sized from it,
and reported as a ``FileNotFoundError`` or ``ValueError`` that names the file and the field.
Whether the config agrees with the weights is checked by the loader (``kvserve.loader``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve import _C
from kvserve.architectures import ARCHITECTURES, Architecture
from kvserve.config_families import read_kv_sharing
from kvserve.quantization import mxfp4
from kvserve.quantization.formats import parse_quantization_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")

# Upper bounds far beyond any released model (vocabularies reach ~262k, hidden sizes ~25k,
# depths ~130 layers, contexts 10M tokens). A value above them is a corrupt or mistyped file;
# rejecting it here keeps every size computed from the config (KV bytes per token, the RoPE
# table of max_position_embeddings rows) small enough to never overflow or exhaust memory.
_LIMITS = {
    "vocab_size": 1 << 24, "hidden_size": 1 << 20, "intermediate_size": 1 << 22,
    "num_hidden_layers": 1 << 12, "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 12, "max_position_embeddings": 1 << 24, "sliding_window": 1 << 24,
    "original_max_position_embeddings": 1 << 24, "q_lora_rank": 1 << 16, "kv_lora_rank": 1 << 16,
    "qk_nope_head_dim": 1 << 12, "qk_rope_head_dim": 1 << 12, "v_head_dim": 1 << 12,
    "n_routed_experts": 1 << 12, "num_local_experts": 1 << 12, "num_experts": 1 << 12,
    "num_experts_per_tok": 1 << 12, "moe_intermediate_size": 1 << 22, "n_shared_experts": 1 << 8,
    "n_group": 1 << 12, "topk_group": 1 << 12, "first_k_dense_replace": 1 << 12,
    "moe_layer_freq": 1 << 12, "decoder_sparse_step": 1 << 12,
    "num_heads": 1 << 12, "state_size": 1 << 12, "n_groups": 1 << 12,
    "mamba_n_heads": 1 << 12, "mamba_d_head": 1 << 12, "mamba_d_state": 1 << 12,
    "mamba_n_groups": 1 << 12, "shared_intermediate_size": 1 << 22, "mamba_d_ssm": 1 << 20,
    "time_step_rank": 1 << 16, "mamba_dt_rank": 1 << 16, "mamba_d_conv": 1 << 8,
}
_REQUIRED = object()


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
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not path.is_file():
        raise ValueError(f"{path} is not a regular file")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSON or UTF-8 errors; RecursionError: deep nesting
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """Maps "auto" / "float32" / "bfloat16" / "float16" / a torch.dtype to a torch.dtype (the
    names are DTYPE_NAMES, which EngineArgs checks)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(_DTYPES)}")
        return dtype
    return checkpoint_dtype if dtype == "auto" else _DTYPES[dtype]  # a name EngineArgs checked


# The names `dtype` and `kv_cache_dtype` take besides "auto" (EngineArgs' choices).
DTYPE_NAMES = ("auto", *_DTYPES)
_KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn,
                    "fp8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn}


KV_CACHE_DTYPE_NAMES = ("auto", *_KV_CACHE_DTYPES)


def resolve_kv_cache_dtype(kv_cache_dtype: str | torch.dtype,
                           model_dtype: torch.dtype) -> torch.dtype:
    """Maps "auto" (the model's dtype) / "int8" / "fp8" (E4M3) / a torch.dtype to the KV pool's
    entry dtype: the model's own or a quantized one (one fp32 scale per token and KV head)."""
    if isinstance(kv_cache_dtype, torch.dtype):
        if kv_cache_dtype != model_dtype and kv_cache_dtype not in _KV_CACHE_DTYPES.values():
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype} is not supported; use the model's "
                             f"dtype ({model_dtype}), torch.int8 or torch.float8_e4m3fn")
        return kv_cache_dtype
    return model_dtype if kv_cache_dtype == "auto" else _KV_CACHE_DTYPES[kv_cache_dtype]


QUANTIZED_ACTIVATIONS = ("auto", "int8", "exact")


def set_quantized_activation(config: _C.ModelConfig, choice: str,
                             device: str | torch.device) -> None:
    """Sets how config's int8 / int4 projections take their input (EngineArgs'
    quantized_activation): "int8" rounds it to int8 blocks of 32 and multiplies in integers
    (quantized_linear's quantize_input, llama.cpp's Q8_0 activations); "exact" multiplies the
    dequantized weight in floating point; "auto" is int8 on a CPU, exact on a GPU (which has no
    integer kernel yet). The perplexity cost of int8 is measured in docs/quantization.md."""
    if choice not in QUANTIZED_ACTIVATIONS:
        raise ValueError(f"quantized_activation must be one of {', '.join(QUANTIZED_ACTIVATIONS)}, "
                         f"got {_show(choice)}")
    q = config.quantization
    if choice == "auto":
        choice = "int8" if torch.device(device).type == "cpu" else "exact"
    q.activation = choice if q.scheme in ("int8", "int4", "mixed") else "exact"
    config.quantization = q


def load_checkpoint_info(model_dir: str | Path) -> CheckpointInfo:
    """Reads config.json (and generation_config.json if present) of a Hugging Face directory."""
    model_dir = Path(model_dir)
    if model_dir.suffix == ".gguf" and model_dir.is_file():
        return _gguf_checkpoint_info(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    path = model_dir / "config.json"
    hf = read_json(path)
    config = _model_config(hf, path)
    fields = _Fields(hf, path)
    bos = _token_ids(fields, "bos_token_id", config.vocab_size)
    eos = _token_ids(fields, "eos_token_id", config.vocab_size)
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        generation_fields = _Fields(read_json(generation), generation)
        if generation_fields.values.get("eos_token_id") is not None:
            eos = _token_ids(generation_fields, "eos_token_id", config.vocab_size)
    return CheckpointInfo(model_dir, config, hf, _checkpoint_dtype(hf, path), eos,
                          bos[0] if bos else None)


def _gguf_checkpoint_info(path: Path) -> CheckpointInfo:
    """A GGUF file's config (kvserve.loader.gguf_checkpoint): its metadata as config.json
    fields; quantized projections in the "mixed" scheme (each by its block type's layout)."""
    from kvserve.loader.gguf_checkpoint import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(path)
    hf = checkpoint.hf_config
    config = _model_config(hf, path)
    if checkpoint.quantized:
        q = config.quantization
        q.scheme = "mixed"
        config.quantization = q
    fields = _Fields(hf, path)
    bos = _token_ids(fields, "bos_token_id", config.vocab_size)
    eos = _token_ids(fields, "eos_token_id", config.vocab_size)
    return CheckpointInfo(path, config, hf, torch.float32, eos, bos[0] if bos else None)


class _Fields:
    """Typed, range-checked reads of one JSON object; every error names the file and the key."""

    def __init__(self, values: dict, path: Path, prefix: str = ""):
        self.values, self.path, self.prefix = values, path, prefix

    def error(self, key: str, message: str) -> ValueError:
        return ValueError(f"{self.path}: '{self.prefix}{key}' {message}")

    def _get(self, key: str, default) -> tuple[object, bool]:
        """(value, present); an absent or null optional field is (default, False)."""
        value = self.values.get(key)
        if value is None and default is not _REQUIRED:
            return default, False
        if key not in self.values:
            raise ValueError(f"{self.path}: missing required field '{self.prefix}{key}'")
        return value, True

    def integer(self, key: str, default=_REQUIRED, minimum: int = 1) -> int:
        value, present = self._get(key, default)
        if not present:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 64.0 is an integer; 64.5, NaN and inf are not
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise self.error(key, f"must be {wanted}, got {_show(value)}")
        limit = _LIMITS.get(key)
        if limit is not None and value > limit:
            raise self.error(key, f"is {_show(value)}, more than kvserve accepts ({limit}); "
                                  "the file is probably corrupt")
        return value

    def number(self, key: str, default=_REQUIRED, above: float = 0.0) -> float:
        value, present = self._get(key, default)
        if not present:
            return value
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value) or value <= above):
            raise self.error(key, f"must be a finite number > {above:g}, got {_show(value)}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value, _ = self._get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {_show(value)}")
        return value

    def mapping(self, key: str) -> dict:
        value, _ = self._get(key, {})
        if not isinstance(value, dict):
            raise self.error(key, f"must be a JSON object or null, got {_show(value)}")
        return value


def _show(value) -> str:
    """A value for an error message: strings quoted, the rest as JSON writes it, cut short."""
    text = repr(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _model_config(hf: dict, path: Path) -> _C.ModelConfig:
    f = written = _Fields(hf, path)
    c = _C.ModelConfig()
    arch = _architecture(hf, path)
    c.architecture, c.family = arch.name, arch.family
    if arch.prepare is not None:
        hf = arch.prepare(hf)
        f = _Fields(hf, path)
    c.vocab_size = f.integer("vocab_size")
    c.hidden_size = f.integer("hidden_size")
    c.intermediate_size = f.integer("intermediate_size")
    c.num_layers = f.integer("num_hidden_layers")
    c.num_heads = f.integer("num_attention_heads")
    c.num_kv_heads = f.integer("num_key_value_heads", default=c.num_heads)  # absent: no GQA
    if c.num_heads % c.num_kv_heads:
        raise f.error("num_key_value_heads", f"({c.num_kv_heads}) must divide "
                                             f"num_attention_heads ({c.num_heads})")
    if arch.read_family is not None:
        hf = arch.read_family(c, f, hf)  # the file with the family's defaults filled in
        f = _Fields(hf, path)
    else:
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{path}: hidden_act {_show(act)} is not supported (only silu)")
    c.head_dim = _head_dim(f, c)
    c.max_position_embeddings = f.integer("max_position_embeddings")
    c.rms_norm_eps = f.number("rms_norm_eps", 1e-6)
    c.tie_word_embeddings = f.flag("tie_word_embeddings", False)
    attention_bias = f.flag("attention_bias", False)
    c.qkv_bias = attention_bias or arch.qkv_bias
    c.o_proj_bias = attention_bias and not arch.qkv_bias and arch.o_proj_bias
    c.mlp_bias = f.flag("mlp_bias", False)
    c.qk_norm = arch.qk_norm or c.qk_norm  # or as the family's reader found it (GLM-4.5)
    _rope(c, hf, path, arch)
    c.sliding_windows = _sliding_windows(f, c, arch)
    if arch.read_attention is not None:
        arch.read_attention(c, f)
    if arch.read_moe is not None:
        arch.read_moe(c, f)
    if arch.read_ssm is not None:
        arch.read_ssm(c, written)
    read_kv_sharing(c, f)
    if mxfp4.is_mxfp4(hf) and arch.stacked_experts != "columns":
        raise ValueError(f"{path}: quantization_config: kvserve reads MXFP4 weights as gpt-oss's "
                         f"experts only, not {arch.name}'s")
    quant = parse_quantization_config(hf)  # ValueError for a method kvserve does not load
    if quant is not None:
        q = _C.QuantizationConfig()
        q.scheme, q.outlier_threshold = quant.scheme, quant.linear_outlier_threshold
        c.quantization = q
    try:
        c.validate()  # the C++ side's own checks, a backstop behind the ones above
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return c


def _architecture(hf: dict, path: Path) -> Architecture:
    architectures = hf.get("architectures")
    supported = ", ".join(ARCHITECTURES)
    if architectures is None:
        raise ValueError(f"{path}: missing 'architectures'; kvserve supports: {supported}")
    if not architectures or not isinstance(architectures, list):
        raise ValueError(f"{path}: 'architectures' must be a non-empty list of names, got "
                         f"{_show(architectures)}; kvserve supports: {supported}")
    name = architectures[0]
    if not isinstance(name, str) or name not in ARCHITECTURES:
        raise ValueError(f"{path}: unsupported architecture {_show(name)} in "
                         f"'architectures'; kvserve supports: {supported}")
    return ARCHITECTURES[name]


def _head_dim(f: _Fields, c: _C.ModelConfig) -> int:
    """head_dim, or hidden_size / num_attention_heads when absent; even, for RoPE."""
    if f.values.get("head_dim") is not None:
        head_dim, source = f.integer("head_dim"), "head_dim"
    elif c.hidden_size % c.num_heads:
        raise f.error("hidden_size", f"({c.hidden_size}) must be a multiple of num_attention_heads "
                                     f"({c.num_heads}) when head_dim is not given")
    else:
        head_dim = c.hidden_size // c.num_heads
        source = "head_dim (hidden_size / num_attention_heads)"
    if head_dim % 2:
        raise ValueError(f"{f.path}: {source} is {head_dim}, but rotary embeddings need an even "
                         "head_dim")
    return head_dim


def _rope(c: _C.ModelConfig, hf: dict, path: Path, arch: Architecture) -> None:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` and
    # `rope_scaling`.
    top = _Fields(hf, path)
    scaling, parameters = top.mapping("rope_scaling"), top.mapping("rope_parameters")
    name = "rope_parameters" if parameters else "rope_scaling"
    f = _Fields({**scaling, **parameters}, path, prefix=name + ".")
    theta = f if "rope_theta" in f.values else top
    c.rope_theta = theta.number("rope_theta", 10000.0, above=1.0)
    s = _C.RopeScaling()
    rope_type = f.values.get("rope_type", f.values.get("type")) or "default"
    if rope_type == "su":  # Phi-3's first name for LongRoPE (transformers reads it so too)
        rope_type = "longrope"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"{path}: '{name}': rope type {_show(rope_type)}"
                         f" is not supported ({', '.join(_ROPE_TYPES)})")
    s.rope_type = rope_type
    if rope_type == "longrope":
        _longrope(c, s, f, top)
    elif rope_type != "default":
        if "factor" not in f.values:
            raise ValueError(f"{path}: rope scaling '{rope_type}' needs a '{name}.factor'")
        s.factor = f.number("factor")
        if s.factor < 1.0:
            raise f.error("factor", f"must be >= 1 for rope scaling, got {_show(s.factor)}")
    if rope_type == "llama3":
        s.low_freq_factor = f.number("low_freq_factor", 1.0)
        s.high_freq_factor = f.number("high_freq_factor", 4.0)
        if s.high_freq_factor <= s.low_freq_factor:
            raise f.error("high_freq_factor", f"({s.high_freq_factor:g}) must be greater than "
                                              f"low_freq_factor ({s.low_freq_factor:g})")
    if rope_type == "yarn":
        s.beta_fast = f.number("beta_fast", 32.0)
        s.beta_slow = f.number("beta_slow", 1.0)
        s.attention_factor = f.number("attention_factor", 0.0)  # 0: derived from factor
        s.mscale = f.number("mscale", 0.0, above=-1.0)  # DeepSeek; 0: unset
        s.mscale_all_dim = f.number("mscale_all_dim", 0.0, above=-1.0)
        s.truncate = f.flag("truncate", True)
    if rope_type in ("llama3", "yarn"):
        s.original_max_position_embeddings = f.integer("original_max_position_embeddings", 0)
    c.rope_scaling = s
    # Partial rotary (Bamba): the first int(head_dim * factor) dims of each head are rotated, the
    # rest pass through. transformers 5 keeps the factor in rope_parameters, older files at the
    # top level; architectures whose attention rotates whole heads refuse any other factor than 1.
    where = f if "partial_rotary_factor" in f.values else top
    partial = where.values.get("partial_rotary_factor")
    if partial is not None:
        partial = where.number("partial_rotary_factor", above=0.0)
        if not arch.partial_rotary and partial != 1:
            raise where.error("partial_rotary_factor", f"is {partial:g}; {arch.name} rotates "
                                                       "whole heads (only 1 is supported)")
        rotary_dim = int(c.head_dim * partial)
        if partial > 1 or rotary_dim <= 0 or rotary_dim % 2:
            raise where.error("partial_rotary_factor",
                              f"is {partial:g}: head_dim ({c.head_dim}) times it must be a "
                              f"positive even number of dims, at most head_dim")
        c.rotary_dim = 0 if rotary_dim == c.head_dim else rotary_dim
    if rope_type == "longrope":
        half = (c.rotary_dim or c.head_dim) // 2
        for key in ("short_factor", "long_factor"):
            if len(getattr(s, key)) != half:
                raise f.error(key, f"lists {len(getattr(s, key))} factors; the {2 * half} "
                                   f"rotated dims of a head need {half}")


def _longrope(c: _C.ModelConfig, s: _C.RopeScaling, f: _Fields, top: _Fields) -> None:
    """LongRoPE (Phi-3): a factor per rotated frequency, short and long sets; the original
    context (in the RoPE fields or at the top level, as older Phi-3 files keep it) and the factor
    (max_position_embeddings over it when absent) set the attention factor."""
    for key in ("short_factor", "long_factor"):
        values = f.values.get(key)
        if (not isinstance(values, list) or not values
                or any(isinstance(v, bool) or not isinstance(v, (int, float))
                       or not math.isfinite(v) or v <= 0 for v in values)):
            raise f.error(key, f"must list positive numbers, got {_show(values)}")
        setattr(s, key, [float(v) for v in values])
    where = f if f.values.get("original_max_position_embeddings") is not None else top
    s.original_max_position_embeddings = where.integer("original_max_position_embeddings")
    max_positions = top.integer("max_position_embeddings")
    s.factor = f.number("factor", max_positions / s.original_max_position_embeddings)
    s.attention_factor = f.number("attention_factor", 0.0)  # 0: derived from factor


def _sliding_windows(f: _Fields, c: _C.ModelConfig, arch: Architecture) -> list[int]:
    num_layers = c.num_layers
    window = f.integer("sliding_window", 0, minimum=0)
    if not f.flag("use_sliding_window", True):  # Qwen: no window at all, whatever layer_types say
        return [0] * num_layers
    layer_types = f.values.get("layer_types")
    if layer_types is not None:  # Qwen2/3 and hybrid layouts say per layer
        kinds = ("full_attention", "sliding_attention")
        if (not isinstance(layer_types, list) or len(layer_types) != num_layers
                or any(t not in kinds for t in layer_types)):
            raise f.error("layer_types", f"must list one of {kinds} per layer "
                                         f"({num_layers} layers), got {_show(layer_types)}")
        if window == 0 and "sliding_attention" in layer_types:
            raise f.error("layer_types", "has sliding_attention layers but no sliding_window")
        return [window if t == "sliding_attention" else 0 for t in layer_types]
    if window == 0:
        return [0] * num_layers
    # Without layer_types these window only the layers from max_window_layers on (transformers'
    # code; its docstring says the opposite).
    if arch.max_window_layers:
        first = f.integer("max_window_layers", 28, minimum=0)
        return [window if i >= first else 0 for i in range(num_layers)]
    return [window] * num_layers


def _token_ids(f: _Fields, key: str, vocab_size: int) -> list[int]:
    """bos_token_id / eos_token_id: absent, one id, or a list of ids, each in the vocabulary."""
    value = f.values.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size:
            raise f.error(key, f"must be a token id in [0, vocab_size={vocab_size}) or a list of "
                               f"them, got {_show(value)}")
    return ids


def _checkpoint_dtype(hf: dict, path: Path) -> torch.dtype:
    key = "dtype" if hf.get("dtype") is not None else "torch_dtype"
    name = hf.get(key) or "float32"
    if isinstance(name, str):
        name = name.removeprefix("torch.")
        if name == "float64":  # no float64 kernels: run such weights in the widest dtype there is
            return torch.float32
        if name in _DTYPES:
            return _DTYPES[name]
    raise ValueError(f"{path}: '{key}' is {_show(name)}; expected one of {sorted(_DTYPES)}")
