"""The tensors a config.json implies, and a check of a checkpoint's headers against them.

Runs on the headers alone, before any tensor data is read or memory allocated, so that a config
that disagrees with its weights (a wrong size, a missing layer, an absurd vocabulary) fails fast
with the file, the tensor and the config fields involved.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from kvserve import _C
from kvserve.loader.weight_index import WeightIndex

Dim = tuple[str, int]  # (what config.json calls the size, the size)
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_MAX_PROBLEMS_SHOWN = 8


def expected_shapes(c: _C.ModelConfig) -> dict[str, tuple[Dim, ...]]:
    """Every tensor the model reads, by its Hugging Face name, with its shape's config fields."""
    vocab, hidden = ("vocab_size", c.vocab_size), ("hidden_size", c.hidden_size)
    inter, head = ("intermediate_size", c.intermediate_size), ("head_dim", c.head_dim)
    q = ("num_attention_heads*head_dim", c.num_heads * c.head_dim)
    kv = ("num_key_value_heads*head_dim", c.num_kv_heads * c.head_dim)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}self_attn.{name}.weight"] = (out, hidden)
            if c.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q)
        if c.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (head,)
            shapes[p + "self_attn.k_norm.weight"] = (head,)
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):
            shapes[f"{p}mlp.{name}.weight"] = shape
            if c.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = shape[:1]
    return shapes


def check_weights(index: WeightIndex, c: _C.ModelConfig, config_path: Path) -> None:
    """Raises ValueError listing every tensor that is missing, unexpected, not a float or of
    another shape than config.json implies."""
    _check_num_layers(index, c, config_path)
    expected = expected_shapes(c)
    problems = []
    for name, dims in expected.items():
        info = index.tensors.get(name)
        if info is None:
            untied = name == "lm_head.weight"
            hint = " (config.json has tie_word_embeddings false)" if untied else ""
            problems.append(f"{index.source} has no tensor '{name}'{hint}")
        elif info.dtype not in FLOAT_DTYPES:
            problems.append(f"{info.file}: tensor '{name}' has dtype {info.dtype}; kvserve loads "
                            f"float weights ({', '.join(FLOAT_DTYPES)})")
        elif info.shape != tuple(size for _, size in dims):
            implied = ", ".join(f"{field}={size}" for field, size in dims)
            problems.append(f"{info.file}: tensor '{name}' has shape {list(info.shape)}, but "
                            f"{config_path.name} implies [{implied}]")
    for name, info in index.tensors.items():
        if name not in expected and not _ignored(name, c):
            problems.append(f"{info.file}: tensor '{name}' is not part of the model that "
                            f"{config_path.name} describes (check num_hidden_layers, "
                            "attention_bias, mlp_bias)")
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        shown = problems[:_MAX_PROBLEMS_SHOWN]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more")
        raise ValueError(f"the weights do not match {config_path} ({len(problems)} problems):\n  "
                         + "\n  ".join(shown))


def _check_num_layers(index: WeightIndex, c: _C.ModelConfig, config_path: Path) -> None:
    """When the weights hold whole layers 0..n-1, a different num_hidden_layers reads better as
    one line than as a list of every tensor of the missing or surplus layers."""
    per_layer = Counter(int(m.group(1)) for name in index.tensors
                        if (m := re.match(r"model\.layers\.(\d+)\.", name)))
    n = len(per_layer)
    whole = set(per_layer) == set(range(n)) and len(set(per_layer.values())) == 1
    if n and whole and n != c.num_layers:
        raise ValueError(f"{config_path}: num_hidden_layers is {c.num_layers}, but "
                         f"{index.source} holds {n} layers")


def _ignored(name: str, c: _C.ModelConfig) -> bool:
    """Tensors some checkpoints carry that the model does not need."""
    return name.endswith("rotary_emb.inv_freq") or (
        c.tie_word_embeddings and name == "lm_head.weight")
