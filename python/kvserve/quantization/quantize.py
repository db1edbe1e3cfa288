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
The output directory's model card (README.md: the source's, or a new one) gains a "Quantization"
section: method, format, and with --eval-text FILE (default: the calibration text) the perplexity
of the quantized and of the original model on its first --eval-tokens tokens.

Attention, MLP and state-space mixer projections are quantized (by their kvserve names,
Architecture.weight_names); embeddings, norms, the LM head, MoE routers and stacked experts are
copied as they are, and so is a projection whose shape the int4 layout cannot hold (in_features
not a multiple of the group size, out_features not of 8): it is listed in the config's
`modules_to_not_convert`, as AutoAWQ does. With --lm-head (int8, fp8, int4, awq) the LM head is
quantized too, round to nearest in the same format (llama.cpp keeps its output layer in 6 bits):
a head tied to the embedding is untied first (the embedding stays as it was, the config gets
tie_word_embeddings false). With --embeddings (int8, fp8: compressed-tensors, whose config group
then targets "Embedding" too; AWQ's layout holds linear layers only) the input embedding is
quantized per row the same way, and its lookup dequantizes the rows it reads; a tied head is
that one matrix, so it is quantized with it and the checkpoint stays tied.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvserve.architectures import split_weights, weight_names
from kvserve.config import load_checkpoint_info
from kvserve.loader.checkpoint_writer import write_checkpoint
from kvserve.loader.weight_index import kvserve_name
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
LM_HEAD_METHODS = ("int8", "fp8", "int4", "awq")  # weight-only: the head's input is per token
EMBEDDING_METHODS = ("int8", "fp8")  # compressed-tensors: a config group can target Embedding
LLM_INT8_THRESHOLD = 6.0  # bitsandbytes' default: the paper's outlier magnitude


def quantize_checkpoint(model_dir: Path, out_dir: Path, method: str, group_size: int = 128,
                        calibration: Path | None = None, eval_text: Path | None = None,
                        eval_tokens: int = 4096, lm_head: bool = False,
                        embeddings: bool = False) -> dict:
    """Writes the quantized checkpoint to out_dir (config.json with its quantization_config, one
    model.safetensors, the other files copied, the model card's Quantization section) and
    returns its quantization_config. Raises ValueError for an unknown method, an already
    quantized checkpoint or a layer whose shape the format cannot hold."""
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
    if lm_head and method not in LM_HEAD_METHODS:
        raise ValueError(f"--lm-head takes --method {', '.join(LM_HEAD_METHODS)}, got {method!r}")
    if embeddings and method not in EMBEDDING_METHODS:
        raise ValueError(f"--embeddings takes --method {', '.join(EMBEDDING_METHODS)} "
                         f"(compressed-tensors; AWQ and bitsandbytes hold linear layers only), "
                         f"got {method!r}")
    source: dict[str, torch.Tensor] = {}
    for file in files:
        source.update(load_file(file))
    tied = "lm_head.weight" not in source
    if lm_head and tied and not embeddings:  # the head becomes its own matrix
        source["lm_head.weight"] = source["model.embed_tokens.weight"].clone()
        config["tie_word_embeddings"] = False
        tied = False
    if method == "awq":
        from kvserve.quantization.awq import awq_transform

        awq_transform(model_dir, source, Path(calibration), group_size)
    covers = CheckpointQuantization(method, 8, -1, lm_head=lm_head, embeddings=embeddings).covers
    model_config = load_checkpoint_info(model_dir).config
    if split_weights(model_config) and int4:
        raise ValueError(f"{model_config.architecture} keeps fused projections (q/k/v, gate/up) "
                         "that kvserve reads by rows; int4 packs outputs in columns: use "
                         "--method int8, w8a8, llm.int8 or fp8")
    renames = weight_names(model_config)  # covers takes kvserve's names
    tensors: dict[str, torch.Tensor] = {}
    plain: list[str] = []
    for name, t in source.items():
        module = name.removesuffix(".weight")
        ours = kvserve_name(name, renames)
        covered = covers(ours.removesuffix(".weight"))
        if not (name.endswith(".weight") and t.dim() == 2 and covered):
            tensors[name] = t
            if ours.endswith(".weight") and t.dim() == 3 and covered:  # stacked experts:
                plain.append(module)  # the loader reads them plain only
        elif int4 and (t.shape[1] % group_size or t.shape[0] % 8):
            tensors[name] = t
            plain.append(module)
        else:
            tensors.update(_quantized(module, t, method, group_size))
    if lm_head and "lm_head" in plain:
        raise ValueError(f"--lm-head: the LM head [{source['lm_head.weight'].shape[0]}, "
                         f"{source['lm_head.weight'].shape[1]}] does not fit int4 groups of "
                         f"{group_size} (vocabulary a multiple of 8, hidden of the group)")
    if int4:
        qc = awq_config(group_size, plain, lm_head)
    elif method == "llm.int8":
        qc = bitsandbytes_config(LLM_INT8_THRESHOLD, plain)
    else:
        qc = compressed_tensors_config("float" if method == "fp8" else "int", method == "w8a8",
                                       lm_head and not tied, embeddings, plain)
    write_checkpoint(model_dir, out_dir, tensors, skip=("config.json",))
    config["quantization_config"] = qc
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    eval_text = eval_text if eval_text is not None else calibration
    _write_card(model_dir, out_dir, method, group_size if int4 else None, qc, plain,
                (lm_head, embeddings, tied),
                _perplexities(model_dir, out_dir, eval_text, eval_tokens) if eval_text else None,
                eval_text)
    return qc


def _perplexities(model_dir: Path, out_dir: Path, text: Path,
                  max_tokens: int) -> tuple[float, float, int]:
    """(quantized, original, tokens scored) on the first max_tokens tokens of `text`."""
    from kvserve.llm import LLM
    from kvserve.perplexity import evaluate_perplexity

    results = []
    for path in (out_dir, model_dir):
        llm = LLM(path, log_memory_plan=False)
        if llm.tokenizer is None:
            raise ValueError(f"{model_dir} has no tokenizer.json to encode --eval-text with")
        ids = llm.tokenizer.encode(Path(text).read_text(encoding="utf-8"))[:max_tokens]
        results.append(evaluate_perplexity(llm, ids))
        llm.shutdown()
    return results[0].perplexity, results[1].perplexity, results[0].num_tokens


def _write_card(model_dir: Path, out_dir: Path, method: str, group_size: int | None, qc: dict,
                plain: list[str], extent: tuple[bool, bool, bool],
                ppl: tuple[float, float, int] | None, text: Path | None) -> None:
    """extent: (--lm-head, --embeddings, whether the source's head was tied)."""
    lm_head, embeddings, tied = extent
    head = lm_head or (embeddings and tied)
    card = model_dir / "README.md"
    kept = ", ".join(part for part, quantized in (
        ("Embeddings", embeddings), ("norms", False), ("the LM head", head)) if not quantized)
    kept = kept[0].upper() + kept[1:] + " and MoE routers"
    lines = [card.read_text().rstrip() + "\n" if card.is_file() else f"# {out_dir.name}\n",
             "## Quantization\n",
             f"- `python -m kvserve quantize --method {method}"
             f"{f' --group-size {group_size}' if group_size else ''}"
             f"{' --lm-head' if lm_head else ''}{' --embeddings' if embeddings else ''}` "
             f"of `{model_dir.name}`, "
             f"written as `{qc['quant_method']}`.",
             f"- {kept} are kept as they were"
             f"{'; so are ' + ', '.join(plain) if plain else ''}."]
    if embeddings:
        lines.append("- The input embedding is quantized too (per row; a lookup dequantizes "
                     "the rows it reads)"
                     + ("; the LM head is tied to it, and so quantized with it." if tied
                        else "."))
    if lm_head and not (embeddings and tied):
        lines.append("- The LM head is quantized too (untied from the embedding where it was "
                     "tied).")
    if ppl is not None:
        quantized, original, tokens = ppl
        lines.append(f"- Perplexity on the first {tokens:,} tokens of `{Path(text).name}`: "
                     f"{quantized:.4f} quantized, {original:.4f} original "
                     f"({quantized / original - 1:+.2%}).")
    else:
        lines.append("- Perplexity: not measured (`--eval-text FILE` measures it).")
    (out_dir / "README.md").write_text("\n".join(lines) + "\n")


def _quantized(module: str, w: torch.Tensor, method: str,
               group_size: int) -> dict[str, torch.Tensor]:
    if method in ("int8", "w8a8"):
        return compressed_tensors_tensors(module, quantize_int8(w))
    if method == "llm.int8":
        return bitsandbytes_tensors(module, quantize_int8(w))
    if method == "fp8":
        return compressed_tensors_tensors(module, quantize_fp8(w))
    return awq_tensors(module, quantize_int4(w, group_size))
