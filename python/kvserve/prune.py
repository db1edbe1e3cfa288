"""Structured pruning of Llama-family checkpoints by activation importance (Minitron).

Importance comes from the activations of a forward pass over calibration text (transformers
runs the model, hooks record):
  * MLP neurons: mean |act(gate) * up| over the calibration tokens, per intermediate channel;
  * attention: mean |attention output| per head (the input of o_proj, head by head), summed over
    the query heads of each KV group, so that GQA groups are kept or removed whole;
  * hidden channels: mean |x| of every RMSNorm output (the inputs of the attention and MLP blocks
    and of the LM head), per channel;
  * layers: 1 - cosine similarity between a decoder layer's input and output hidden states,
    averaged over tokens (a layer that barely changes its input matters least).
Removal slices the weights and writes a checkpoint of the same architecture with a smaller
config, which transformers and kvserve load as any other.

    kvserve.prune.prune_checkpoint("model", Path("calibration.txt").read_text(), "pruned",
                                   intermediate=256)
    python -m kvserve prune --model DIR --calibration FILE --out DIR [--layers N] [--heads N]
                            [--intermediate N] [--hidden N]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvserve.architectures import ARCHITECTURES
from kvserve.loader.checkpoint_writer import write_checkpoint

# Architectures whose decoder layers are Llama's (q/k/v/o, gate/up/down, two RMSNorms per layer).
PRUNABLE = sorted(name for name, a in ARCHITECTURES.items() if a.prunable)


def importance(model_dir: Path, calibration: str, max_tokens: int = 2048,
               window: int = 256) -> dict[str, torch.Tensor]:
    """Per-layer scores: "mlp.<i>" [intermediate], "kv_groups.<i>" [num_kv_heads], "hidden"
    [hidden], "layers" [num_layers] (higher = more important)."""
    from transformers import AutoModelForCausalLM

    from kvserve.tokenizer import Tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = model.config
    ids = Tokenizer.from_model_dir(model_dir).encode(calibration, add_special_tokens=False)
    ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError("the calibration text has fewer than 2 tokens")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    sums: dict[str, torch.Tensor] = {}

    def add(key, value):
        sums[key] = sums.get(key, 0) + value

    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(
            lambda m, args, i=i: add(f"mlp.{i}", args[0].abs().sum((0, 1)))))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(
            lambda m, args, i=i: add(f"heads.{i}", args[0].abs().sum((0, 1)).view(
                heads, head_dim).sum(1))))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            hooks.append(norm.register_forward_hook(
                lambda m, args, out: add("hidden", out.abs().sum((0, 1)))))
        hooks.append(layer.register_forward_hook(
            lambda m, args, kwargs, out, i=i: add(
                "layers", _one_hot(i, len(model.model.layers)) * _change(args, kwargs, out)),
            with_kwargs=True))
    hooks.append(model.model.norm.register_forward_hook(
        lambda m, args, out: add("hidden", out.abs().sum((0, 1)))))
    tokens = 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start:start + window]])
            model(chunk)
            tokens += chunk.shape[1]
    for h in hooks:
        h.remove()
    scores = {k: v / tokens for k, v in sums.items()}
    group = heads // kv_heads
    for i in range(config.num_hidden_layers):
        scores[f"kv_groups.{i}"] = scores.pop(f"heads.{i}").view(kv_heads, group).sum(1)
    return scores


def _one_hot(i: int, n: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), n).float()


def _change(args, kwargs, out) -> torch.Tensor:
    """Sum over tokens of 1 - cos(layer input, layer output)."""
    x = args[0] if args else kwargs["hidden_states"]
    y = out[0] if isinstance(out, tuple) else out
    return (1 - torch.nn.functional.cosine_similarity(x, y, dim=-1)).sum()


def _keep(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n highest scores, in their original order."""
    return torch.sort(torch.topk(scores, n).indices).values


def prune_checkpoint(model_dir: str | Path, calibration_text: str, out_dir: str | Path, *,
                     layers: int | None = None, heads: int | None = None,
                     intermediate: int | None = None, hidden: int | None = None,
                     max_tokens: int = 2048) -> dict:
    """Writes the pruned checkpoint to out_dir and returns what was kept, ranked on the
    activations of calibration_text (up to max_tokens tokens). layers: decoder layers
    to keep; heads: query heads per layer (a multiple of the GQA group: whole KV groups go);
    intermediate: MLP channels; hidden: model width. Raises ValueError for a target outside
    (0, current] or an architecture that is not Llama-shaped."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError("--out must be another directory than --model")
    config = json.loads((model_dir / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in PRUNABLE:
        raise ValueError(f"pruning supports {', '.join(PRUNABLE)}, not {arch}")
    n_layers, n_heads = config["num_hidden_layers"], config["num_attention_heads"]
    n_kv, width, inter = config["num_key_value_heads"], config["hidden_size"], \
        config["intermediate_size"]
    group = n_heads // n_kv
    head_dim = config.get("head_dim") or width // n_heads
    targets = {"layers": (layers, n_layers), "heads": (heads, n_heads),
               "intermediate": (intermediate, inter), "hidden": (hidden, width)}
    for name, (want, have) in targets.items():
        if want is not None and not 0 < want <= have:
            raise ValueError(f"--{name} must be in [1, {have}], got {want}")
    if heads is not None and heads % group:
        raise ValueError(f"--heads must be a multiple of the GQA group ({group} query heads per "
                         f"KV head), got {heads}")
    scores = importance(model_dir, calibration_text, max_tokens)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))

    kept_layers = list(range(n_layers)) if layers is None else \
        _keep(scores["layers"], layers).tolist()
    width_keep = None if hidden is None else _keep(scores["hidden"], hidden)
    out: dict[str, torch.Tensor] = {}

    def take(t, dim, index):
        return t if index is None else t.index_select(dim, index)

    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            out[name] = take(tensors[name], 1, width_keep)
    out["model.norm.weight"] = take(tensors["model.norm.weight"], 0, width_keep)
    for new, old in enumerate(kept_layers):
        src, dst = f"model.layers.{old}.", f"model.layers.{new}."
        groups = None if heads is None else _keep(scores[f"kv_groups.{old}"], heads // group)
        q_rows = kv_rows = None
        if groups is not None:
            kv_rows = (groups[:, None] * head_dim + torch.arange(head_dim)).flatten()
            q_heads = (groups[:, None] * group + torch.arange(group)).flatten()
            q_rows = (q_heads[:, None] * head_dim + torch.arange(head_dim)).flatten()
        neurons = None if intermediate is None else _keep(scores[f"mlp.{old}"], intermediate)
        # (kept output rows, kept input columns) of each projection; biases take the rows.
        kept = {"self_attn.q_proj.": (q_rows, width_keep),
                "self_attn.k_proj.": (kv_rows, width_keep),
                "self_attn.v_proj.": (kv_rows, width_keep),
                "self_attn.o_proj.": (width_keep, q_rows),
                "mlp.gate_proj.": (neurons, width_keep), "mlp.up_proj.": (neurons, width_keep),
                "mlp.down_proj.": (width_keep, neurons)}
        for name, t in tensors.items():
            if not name.startswith(src):
                continue
            part = name[len(src):]
            projection = next((p for p in kept if part.startswith(p)), None)
            if part.endswith("layernorm.weight"):
                t = take(t, 0, width_keep)
            elif projection is not None:
                rows, columns = kept[projection]
                t = take(t, 0, rows)
                t = take(t, 1, columns) if t.dim() == 2 else t
            elif not (part.startswith("self_attn.") and "norm" in part):  # q/k norms stay
                raise ValueError(f"pruning does not know the tensor {name}")
            out[dst + part] = t.contiguous()
    new_config = dict(config, num_hidden_layers=len(kept_layers),
                      num_attention_heads=heads or n_heads,
                      num_key_value_heads=(heads or n_heads) // group,
                      intermediate_size=intermediate or inter, hidden_size=hidden or width,
                      head_dim=head_dim)
    if isinstance(config.get("layer_types"), list):  # per-layer attention types
        new_config["layer_types"] = [config["layer_types"][i] for i in kept_layers]
    write_checkpoint(model_dir, out_dir, out, skip=("config.json", "README.md"))
    (out_dir / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
    return dict(layers=kept_layers, config=new_config)
