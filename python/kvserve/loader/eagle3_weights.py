"""EAGLE-3 heads (speculative_method="eagle3") in the layout the published heads use: a
config.json whose architectures name ``LlamaForCausalLMEagle3`` (or ``Eagle3LlamaForCausalLM``),
the Llama fields of its one decoder layer, ``vocab_size`` (the target's) and ``draft_vocab_size``,
and optionally ``eagle_config.eagle_aux_hidden_state_layer_ids``; weights ``fc.weight``, the
layer as ``midlayer.*`` (or ``layers.0.*``: q/k/v projections over 2 * hidden inputs,
``hidden_norm`` beside ``input_layernorm``), ``norm.weight``, ``lm_head.weight`` over the draft
vocabulary, ``d2t`` (draft id -> target id - draft id), optionally ``embed_tokens.weight``
(``t2d`` is not needed).

The head reads three of the target's residual streams, each the stream entering a layer (as vLLM
counts them): ``eagle_aux_hidden_state_layer_ids``, else layers 2, N / 2 and N - 3 of an N-layer
target (vLLM's default for Llama targets)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve import _C
from kvserve.config import _model_config, read_json
from kvserve.loader.safetensors_loader import _TensorReader
from kvserve.loader.weight_index import WeightIndex

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass
class Eagle3Weights:
    config: _C.ModelConfig        # the head's decoder layer as a one-layer Llama
    aux_layers: list[int]         # the target's streams it reads: those entering these layers
    weights: dict[str, torch.Tensor]  # Eagle3Head's names
    norm_before_residual: bool


def eagle3_config(head_dir: str | Path, target: _C.ModelConfig
                  ) -> tuple[_C.ModelConfig, list[int], dict]:
    """(the head's layer config, the target layers whose entering streams it reads, its
    config.json). Raises ValueError for a directory that is no EAGLE-3 head for `target`."""
    path = Path(head_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"EAGLE-3 head {head_dir}: no config.json")
    hf = read_json(path)
    architectures = hf.get("architectures") or []
    if not any(a in EAGLE3_ARCHITECTURES for a in architectures):
        raise ValueError(f'speculative_method="eagle3" reads an EAGLE-3 head '
                         f"({' or '.join(EAGLE3_ARCHITECTURES)}); {path} names {architectures}")
    config = _model_config({**hf, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                            "tie_word_embeddings": False}, path)
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"{path}: vocab_size is {config.vocab_size}, the target's "
                         f"{target.vocab_size}: an EAGLE-3 head drafts for one target")
    n = target.num_layers
    aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        aux = [2, n // 2, n - 3]
        where = f"the default layers 2, N / 2, N - 3 of the target's {n}"
    else:
        where = "eagle_config.eagle_aux_hidden_state_layer_ids"
    if (not isinstance(aux, list) or not aux
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= n
                       for i in aux)):
        raise ValueError(f"{path}: {where} ({aux}) must be layers in [0, {n}] of the target")
    return config, list(aux), hf


def load_eagle3_weights(head_dir: str | Path, target: _C.ModelConfig, dtype: torch.dtype,
                        device: torch.device | str = "cpu") -> Eagle3Weights:
    """Reads and checks an EAGLE-3 head for `target`. Raises ValueError naming a missing,
    unexpected or misshapen tensor, FileNotFoundError for missing files."""
    head_dir = Path(head_dir)
    config, aux, hf = eagle3_config(head_dir, target)
    index = WeightIndex.from_dir(head_dir)
    names = set(index.tensors)
    layer = next((p for p in ("midlayer.", "layers.0.", "model.layers.0.")
                  if any(n.startswith(p) for n in names)), "midlayer.")
    read = _TensorReader(index, dtype, None)
    used = set()

    def get(name: str, shape: tuple[int, ...], as_dtype: torch.dtype | None = dtype,
            optional: bool = False) -> torch.Tensor | None:
        if name not in names:
            if optional:
                return None
            raise ValueError(f"{index.source} has no tensor '{name}' (an EAGLE-3 head's)")
        used.add(name)
        tensor = read(name, as_dtype)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{index.source}: tensor '{name}' has shape {list(tensor.shape)}, "
                             f"but {head_dir / 'config.json'} implies {list(shape)}")
        return tensor

    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    draft_vocab = hf.get("draft_vocab_size") or config.vocab_size
    p = layer
    w = {
        "fc.weight": get("fc.weight", (hidden, len(aux) * target.hidden_size)),
        "layers.0.self_attn.qkv_proj.weight": torch.cat([
            get(p + "self_attn.q_proj.weight", (q, 2 * hidden)),
            get(p + "self_attn.k_proj.weight", (kv, 2 * hidden)),
            get(p + "self_attn.v_proj.weight", (kv, 2 * hidden))]),
        "layers.0.self_attn.o_proj.weight": get(p + "self_attn.o_proj.weight", (hidden, q)),
        "layers.0.mlp.gate_up_proj.weight": torch.cat([
            get(p + "mlp.gate_proj.weight", (inter, hidden)),
            get(p + "mlp.up_proj.weight", (inter, hidden))]),
        "layers.0.mlp.down_proj.weight": get(p + "mlp.down_proj.weight", (hidden, inter)),
        "norm.weight": get("norm.weight", (hidden,)),
        "lm_head.weight": get("lm_head.weight", (draft_vocab, hidden)),
    }
    d2t = get("d2t", (draft_vocab,), as_dtype=torch.int64, optional=draft_vocab == config.vocab_size)
    w["d2t"] = d2t if d2t is not None else torch.zeros(draft_vocab, dtype=torch.int64)
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"layers.0.{norm}.weight"] = get(f"{p}{norm}.weight", (hidden,))
    embed = get("embed_tokens.weight", (config.vocab_size, hidden), optional=True)
    if embed is not None:
        w["embed_tokens.weight"] = embed
    unknown = sorted(names - used - {"t2d"})
    if unknown:
        raise ValueError(f"{index.source}: tensor '{unknown[0]}' is not part of an EAGLE-3 head"
                         + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    return Eagle3Weights(config, aux, {n: t.to(device).contiguous() for n, t in w.items()},
                         bool(hf.get("norm_before_residual", False)))


def eagle3_head(weights: Eagle3Weights, target_model: _C.CausalLM,
                max_positions: int) -> _C.Eagle3Head:
    """The head drafting for `target_model`, which from now on keeps the streams it reads."""
    target_model.capture_hidden_states(weights.aux_layers)
    return _C.Eagle3Head(weights.config, target_model, weights.weights, max_positions,
                         weights.norm_before_residual)
