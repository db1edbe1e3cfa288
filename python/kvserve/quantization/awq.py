"""AWQ (activation-aware weight quantization, Lin et al. 2023) for `kvserve quantize --method awq`.

The few input channels that see large activations matter most; scaling them up before int4
rounding (and the operation that feeds them down by the same factor, which leaves the float model
unchanged) protects them. Per layer and per set of projections that read one input:

1. calibration: the input each projection sees, from one forward of the float model (transformers)
   over --calibration text, a sample of its tokens kept per projection;
2. scale search: s = mean|x|^a per input channel (normalised by sqrt(max * min)) for a on a grid of
   20 in [0, 1); the a whose int4-rounded (W s) / s gives the smallest error of the projections'
   outputs on the calibration inputs wins; W *= s, and the feeding operation /= s: the
   preceding RMSNorm's weight (for q/k/v and gate/up), up_proj's rows (for down_proj), v_proj's
   rows (for o_proj, when it has as many outputs as o_proj has inputs);
3. clipping search: per output row and group, the largest |w| kept among 1, 0.95, ..., 0.55 of the
   group's maximum, by the error of that row's partial output (not for q and k, whose errors the
   attention softmax amplifies);
4. round to nearest int4 with zero points per group, as `quantize --method int4`.

Needs transformers (the calibration forward). Llama-family layers: Llama, Mistral, Qwen2/3 and
Gemma 2/3 ((1 + w) norms); anything else is a ValueError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.quantization.weights import quantize_int4

GRID = 20
MAX_TOKENS = 4096        # calibration tokens kept per projection input
CLIP_TOKENS = 512        # of which the clipping search uses
GEMMA = ("gemma2", "gemma3_text", "gemma3")


@dataclass
class ScaleGroup:
    """Projections that read one input, and what feeds that input."""
    prev: str            # a norm's or a projection's weight name (without .weight)
    prev_is_norm: bool
    linears: list[str]   # module names
    clip: list[bool]     # per linear: search clipping


def fake_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w rounded to asymmetric int4 per group and back (fp32)."""
    return quantize_int4(w, group_size).dequantize()


def scale_groups(config: dict, layer: int, kv_heads_equal: bool) -> list[ScaleGroup]:
    p = f"model.layers.{layer}."
    attn, mlp = p + "self_attn.", p + "mlp."
    groups = [ScaleGroup(p + "input_layernorm", True,
                         [attn + "q_proj", attn + "k_proj", attn + "v_proj"], [False, False, True])]
    if kv_heads_equal:
        groups.append(ScaleGroup(attn + "v_proj", False, [attn + "o_proj"], [True]))
    norm = p + ("pre_feedforward_layernorm" if config.get("model_type") in GEMMA
                else "post_attention_layernorm")
    groups.append(ScaleGroup(norm, True, [mlp + "gate_proj", mlp + "up_proj"], [True, True]))
    groups.append(ScaleGroup(mlp + "up_proj", False, [mlp + "down_proj"], [True]))
    return groups


def calibration_inputs(model, samples: torch.Tensor, modules: list[str]) -> dict[str, torch.Tensor]:
    """The input of each module over the samples [N, T], flattened to [tokens, in] and sampled
    down to MAX_TOKENS rows (evenly)."""
    captured: dict[str, list[torch.Tensor]] = {m: [] for m in modules}
    named = dict(model.named_modules())
    hooks = [named[m].register_forward_pre_hook(
        lambda mod, args, m=m: captured[m].append(args[0].detach().reshape(-1, args[0].shape[-1])))
        for m in modules]
    try:
        with torch.no_grad():
            for row in samples:
                model(row[None])
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for m, parts in captured.items():
        x = torch.cat(parts).float()
        if x.shape[0] > MAX_TOKENS:
            x = x[torch.linspace(0, x.shape[0] - 1, MAX_TOKENS).long()]
        out[m] = x
    return out


def search_scale(x: torch.Tensor, weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """The per-input-channel scale s (AWQ's grid over a) that minimises the projections' output
    error."""
    x_mean = x.abs().mean(dim=0)
    want = [x @ w.T for w in weights]
    best, best_s = math.inf, torch.ones_like(x_mean)
    for i in range(GRID):
        a = i / GRID
        s = x_mean.pow(a).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        error = sum(((x @ (fake_int4(w * s, group_size) / s).T - y) ** 2).mean().item()
                    for w, y in zip(weights, want))
        if error < best:
            best, best_s = error, s
    return best_s


def search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w with each (row, group) clamped to the fraction of its max |w| that minimises the row's
    partial output error on CLIP_TOKENS calibration rows."""
    if x.shape[0] > CLIP_TOKENS:
        x = x[torch.linspace(0, x.shape[0] - 1, CLIP_TOKENS).long()]
    n, k = w.shape
    groups = k // group_size
    xg = x.view(-1, groups, group_size)                              # [T, G, g]
    wg = w.view(n, groups, group_size)                               # [n, G, g]
    want = torch.einsum("tgi,ngi->tng", xg, wg)
    original_max = wg.abs().amax(dim=2, keepdim=True)                # [n, G, 1]
    best_error = torch.full((n, groups), math.inf)
    best_max = original_max.clone()
    for i in range(GRID // 2):
        max_val = original_max * (1 - i / GRID)
        clipped = torch.clamp(wg, -max_val, max_val).view(n, k)
        q = fake_int4(clipped, group_size).view(n, groups, group_size)
        error = ((torch.einsum("tgi,ngi->tng", xg, q) - want) ** 2).mean(dim=0)  # [n, G]
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_max = torch.where(better[:, :, None], max_val, best_max)
    return torch.clamp(wg, -best_max, best_max).view(n, k)


def awq_transform(model_dir: Path, tensors: dict[str, torch.Tensor], calibration: Path,
                  group_size: int, num_samples: int = 32, seq_len: int = 256,
                  clip: bool = True) -> list[str]:
    """Applies AWQ's scales and (with `clip`) clipping to the float `tensors` (a checkpoint's
    state dict, in place), calibrating on the text file. Returns the modules whose inputs it
    scaled. The caller then rounds every projection to int4 (round to nearest per group)."""
    import json

    try:
        import transformers
    except ImportError as e:
        raise ValueError("--method awq needs transformers for its calibration forward "
                         "(pip install transformers)") from e
    from kvserve.tokenizer import Tokenizer

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("model_type") not in ("llama", "mistral", "qwen2", "qwen3") + GEMMA:
        raise ValueError(f"--method awq supports Llama, Mistral, Qwen2/3 and Gemma 2/3 layers, "
                         f"not model_type {config.get('model_type')!r}")
    offset = 1.0 if config.get("model_type") in GEMMA else 0.0
    tokenizer = Tokenizer.from_model_dir(model_dir)
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer.json to encode the calibration text with")
    ids = tokenizer.encode(Path(calibration).read_text(encoding="utf-8"))
    seq_len = min(seq_len, config.get("max_position_embeddings", seq_len))
    n = min(num_samples, len(ids) // seq_len)
    if n < 1:
        raise ValueError(f"--calibration {calibration} has {len(ids)} tokens; AWQ needs at least "
                         f"{seq_len}")
    samples = torch.tensor(ids[:n * seq_len]).view(n, seq_len)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads",
                                                                 config["num_attention_heads"])
    groups = [g for layer in range(config["num_hidden_layers"])
              for g in scale_groups(config, layer, heads == kv_heads)]
    inputs = calibration_inputs(model, samples, [g.linears[0] for g in groups])
    del model
    scaled = []
    for g in groups:
        weights = [tensors[m + ".weight"].float() for m in g.linears]
        if any(w.shape[1] % group_size for w in weights):
            continue  # quantize keeps these plain
        x = inputs[g.linears[0]]
        s = search_scale(x, weights, group_size)
        prev = tensors[g.prev + ".weight"]
        if g.prev_is_norm:
            tensors[g.prev + ".weight"] = ((prev.float() + offset) / s - offset).to(prev.dtype)
        else:
            tensors[g.prev + ".weight"] = (prev.float() / s[:, None]).to(prev.dtype)
        x = x / s
        for m, w, clips in zip(g.linears, weights, g.clip):
            w = w * s
            tensors[m + ".weight"] = (search_clip(x, w, group_size) if clip and clips else w).to(
                tensors[m + ".weight"].dtype)
        scaled.extend(g.linears)
    return scaled
