"""A llama.cpp GGUF file as a kvserve checkpoint: `LLM("model.gguf")` and `--model model.gguf`.

The `gguf` package (llama.cpp's own reader) parses the file; this module maps what it holds onto
what a Hugging Face directory would give:

- the config: `llama.*` metadata (block_count, embedding_length, feed_forward_length,
  attention.head_count / head_count_kv / layer_norm_rms_epsilon, rope.freq_base,
  context_length) as config.json fields for LlamaForCausalLM; tied when the file has no
  `output.weight`;
- the tokenizer: `tokenizer.ggml.*` (a SentencePiece vocabulary with scores, `llama`, or a
  byte-level BPE with merges, `gpt2`, split as its `pre` names: Llama 3's `llama-bpe`, GPT-2's,
  Qwen2's) as a `tokenizers` Tokenizer, the BOS prepended when `add_bos_token` says so;
- the tensors, by their Hugging Face names: F32 / F16 / BF16 as they are; Q8_0, Q4_0, Q4_1,
  Q4_K, Q5_K and Q6_K as kvserve quantized weights meaning the same numbers
  (`kvserve.quantization.gguf_blocks`), in the "mixed" scheme (each projection runs the layout
  its type converts to); an embedding stored quantized stays so (its lookup dequantizes the
  rows it reads). llama.cpp's converter permutes the rows of attn_q / attn_k (each head's halves
  interleaved for its RoPE); the permutation is undone here, on whole rows of blocks.

Any other architecture or tensor type is a ValueError naming it, as is a corrupt file: metadata
counts past the end of the file (checked before the gguf package reads it, `gguf_bounds`),
metadata that does not decode, and tensors whose bytes overlap or run past the end.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from kvserve.loader.gguf_bounds import check_metadata_bounds
from kvserve.loader.safetensors_loader import _TensorReader
from kvserve.quantization.gguf_blocks import BLOCKS, to_quantized
from kvserve.quantization.weights import QuantizedWeight

SUPPORTED_TYPES = ("F32", "F16", "BF16", *BLOCKS)
ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# GGUF tensor names of one layer -> Hugging Face's, under model.layers.N.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix == ".gguf" and path.is_file()


class GGUFCheckpoint:
    """One GGUF file: its metadata, its tensors by Hugging Face name, and the config and
    tokenizer they describe."""

    def __init__(self, path: str | Path):
        try:
            import gguf
        except ImportError as e:
            raise ImportError("loading a GGUF file needs the gguf package: pip install gguf") from e
        self.path = Path(path)
        check_metadata_bounds(self.path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:
            raise ValueError(f"{self.path}: not a GGUF file the gguf package reads: {e}") from e
        _check_layout(self.path, self.reader.tensors)
        self.tensors = {}
        for tensor in self.reader.tensors:
            name = _hf_name(tensor.name)
            if name is not None:
                self.tensors[name] = tensor
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{self.path}: architecture {self.arch!r} is not supported in GGUF "
                             f"(kvserve reads {', '.join(ARCHITECTURES)})")

    def field(self, key: str, default=None):
        """A metadata value (arrays as lists), or default when the file has none."""
        if key not in self.reader.fields:
            if default is None:
                raise ValueError(f"{self.path}: missing metadata {key!r}")
            return default
        return self.optional_field(key)

    def special_token_id(self, name: str) -> int | None:
        """tokenizer.ggml.<name>_token_id (name: bos, eos, unknown, padding), or None when the
        file has none; a ValueError when it is outside the vocabulary."""
        value = self.optional_field(f"tokenizer.ggml.{name}_token_id")
        if value is None:
            return None
        size = len(self.reader.fields["tokenizer.ggml.tokens"].data)
        if not 0 <= int(value) < size:
            raise ValueError(f"{self.path}: the {name} token id {int(value)} is outside the "
                             f"vocabulary of {size} tokens")
        return int(value)

    def optional_field(self, key: str):
        """A metadata value, or None when the file has none."""
        field = self.reader.fields.get(key)
        if field is None:
            return None
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:  # e.g. a string not in UTF-8
            raise ValueError(f"{self.path}: metadata {key!r} cannot be read ({e}); the file is "
                             "probably corrupt") from e

    # ------------------------------------------------------------------------------- config
    @cached_property
    def hf_config(self) -> dict:
        """The config.json a Hugging Face directory of this model would have."""
        a = self.arch
        tokens = self.field("tokenizer.ggml.tokens")
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        config = {
            "architectures": [ARCHITECTURES[a]],
            "model_type": a,
            "vocab_size": len(tokens),
            "hidden_size": hidden,
            "intermediate_size": int(self.field(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self.field(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(self.field(f"{a}.attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.field(f"{a}.context_length")),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        scaling = self.field(f"{a}.rope.scaling.type", "none")
        if scaling == "linear":
            config["rope_scaling"] = {"rope_type": "linear",
                                      "factor": float(self.field(f"{a}.rope.scaling.factor"))}
        elif scaling != "none":
            raise ValueError(f"{self.path}: RoPE scaling {scaling!r} in a GGUF file is not "
                             "supported yet (kvserve reads linear, and Llama 3's rope_freqs)")
        freqs = [t for t in self.reader.tensors if t.name == "rope_freqs.weight"]
        if freqs:
            factors = np.asarray(freqs[0].data, dtype=np.float64).reshape(-1)
            llama3 = llama3_rope_scaling(factors, config["rope_theta"], config["head_dim"])
            if llama3 is None:
                raise ValueError(f"{self.path}: rope_freqs is not Llama 3's frequency scaling "
                                 "(1 for high frequencies, a factor for low ones, a smooth "
                                 "step between)")
            config["rope_scaling"] = llama3
        for key in ("bos_token_id", "eos_token_id"):
            value = self.optional_field(f"tokenizer.ggml.{key}")
            if value is not None:
                config[key] = int(value)
        return config

    @property
    def quantized(self) -> bool:
        return any(t.tensor_type.name in BLOCKS for t in self.tensors.values())

    # ---------------------------------------------------------------------------- tokenizer
    def tokenizer(self):
        """The file's vocabulary as a tokenizers.Tokenizer."""
        from kvserve.loader.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(self)

    # ------------------------------------------------------------------------------ tensors
    def kind(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """[out, in] for a matrix (GGUF lists the dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def _check(self, name: str) -> None:
        if name not in self.tensors:
            raise ValueError(f"{self.path} has no tensor for {name}")
        kind = self.kind(name)
        if kind not in SUPPORTED_TYPES:
            raise ValueError(f"{self.path}: tensor {self.tensors[name].name} is {kind}; kvserve "
                             f"reads {', '.join(SUPPORTED_TYPES)}")

    def _row_order(self, name: str) -> torch.Tensor | None:
        """For attn_q / attn_k: the file's row of each Hugging Face row (the converter's
        permutation, undone); None for the others."""
        c = self.hf_config
        if name.endswith("q_proj.weight"):
            heads = c["num_attention_heads"]
        elif name.endswith("k_proj.weight"):
            heads = c["num_key_value_heads"]
        else:
            return None
        rows = self.shape(name)[0]
        # The converter wrote file row i = HF row perm[i], perm taking each head's first and
        # second halves in turn; HF row r is file row inverse[r].
        perm = torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
        return torch.argsort(perm)

    def plain(self, name: str) -> torch.Tensor:
        """An F32 / F16 / BF16 tensor in fp32 (a quantized one dequantized)."""
        self._check(name)
        tensor = self.tensors[name]
        kind = self.kind(name)
        if kind in BLOCKS:
            return self.quantized_weight(name).dequantize()  # its rows already in HF order
        data = np.asarray(tensor.data)
        if kind == "BF16":
            out = torch.from_numpy(np.ascontiguousarray(data).view(np.int16).copy()).view(
                torch.bfloat16).float()
        else:
            out = torch.from_numpy(np.array(data, dtype=np.float32))
        out = out.reshape(self.shape(name))
        order = self._row_order(name)
        return out if order is None else out[order].contiguous()

    def quantized_weight(self, name: str) -> QuantizedWeight:
        """A quantized matrix [out, in] as kvserve holds it."""
        self._check(name)
        n, k = self.shape(name)
        q = to_quantized(np.asarray(self.tensors[name].data), self.kind(name), n, k)
        order = self._row_order(name)
        return q if order is None else q.take_rows(order)

    def is_quantized(self, name: str) -> bool:
        return name in self.tensors and self.kind(name) in BLOCKS


def _check_layout(path: Path, tensors) -> None:
    """No two tensors' bytes may overlap, and none may run past the end of the file (llama.cpp
    also refuses such files): a corrupt offset would otherwise read another tensor's bytes as
    weights."""
    size = path.stat().st_size
    previous = None
    for t in sorted(tensors, key=lambda t: (int(t.data_offset), int(t.n_bytes))):
        begin, end = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ValueError(f"{path}: tensor {t.name!r} ends at byte {end}, past the end of the "
                             f"file ({size} bytes); it is truncated or corrupt")
        if previous is not None and begin < previous[1]:
            raise ValueError(f"{path}: tensor {t.name!r} (bytes {begin}..{end}) overlaps tensor "
                             f"{previous[0]!r} (bytes ..{previous[1]}); the file is corrupt")
        previous = (t.name, end)


def _hf_name(name: str) -> str | None:
    """token_embd.weight -> model.embed_tokens.weight, blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight; None for a tensor kvserve does not read."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


class GGUFTensorReader(_TensorReader):
    """The safetensors loader's tensor reader over a GGUF file: plain tensors in the requested
    dtype, quantized projections as kvserve's layouts (a fused one held in parts where their
    types differ; K-quants' two-level scales made one-level where the model runs on a device
    whose kernels take only that: one_level)."""

    def __init__(self, checkpoint: GGUFCheckpoint, dtype: torch.dtype, one_level: bool = False):
        self.checkpoint, self.dtype, self.quant, self.handles = checkpoint, dtype, None, {}
        self.one_level = one_level

    def raw(self, name: str, dtype: torch.dtype | None = None,
            part: tuple[int, int, int] | None = None) -> torch.Tensor:
        tensor = self.checkpoint.plain(name)
        if part is not None:
            dim, start, length = part
            tensor = tensor.narrow(dim, start, length)
        return tensor.to(dtype or self.dtype).contiguous()

    def quantized(self, module: str) -> bool:
        return self.checkpoint.is_quantized(module + ".weight")

    def linear(self, module: str, shape: tuple[int, int]) -> QuantizedWeight:
        got = self.checkpoint.shape(module + ".weight")
        if got != tuple(shape):
            raise ValueError(f"{self.checkpoint.path}: {module} is {list(got)}, the metadata "
                             f"implies {list(shape)}")
        q = self.checkpoint.quantized_weight(module + ".weight")
        return q.one_level() if self.one_level else q


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """The Llama 3 rope_scaling of a `rope_freqs` tensor (llama.cpp's converter writes each
    frequency's divisor: 1 below the high-frequency wavelength, `factor` above the low-frequency
    one, 1 / ((1 - s) / factor + s) between, s linear in 1 / wavelength), or None when the
    divisors are not of that form. Only the ratios of original_max_position_embeddings and the
    two frequency factors are fixed by the divisors; the context is rounded to an integer and the
    factors follow it."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape or not np.all(np.isfinite(factors)):
        return None
    factor = float(factors.max())
    if factor <= 1.0 or factors.min() < 1.0 - 1e-6:
        return None
    x = inv_freq / (2 * np.pi)  # 1 / wavelength
    tol = 1e-5 * factor
    low, high = factors >= factor - tol, factors <= 1.0 + tol
    between = ~(low | high)
    if between.sum() >= 2:  # s = a x + b; with low_freq_factor 1: b = -1 / (high - 1), L = a ...
        s = (1.0 / factors[between] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, b = np.polyfit(x[between], s, 1)
        if a <= 0 or b >= 0:
            return None
        context, low_factor, high_factor = -a / b, 1.0, 1.0 - 1.0 / b
    elif between.sum() == 0 and low.any() and high.any() and x[low].max() < x[high].min():
        # a step: the boundaries anywhere between the two sets' wavelengths
        context, low_factor = 0.999 / x[low].max(), 1.0
        high_factor = context * x[high].min() / 0.999
    else:
        return None
    scale = round(context) / context
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low_factor * scale),
            "high_freq_factor": float(high_factor * scale),
            "original_max_position_embeddings": int(round(context))}
    # The divisors these parameters give (transformers' formula) must be the file's.
    lo, hi = rope["low_freq_factor"], rope["high_freq_factor"]
    ctx = rope["original_max_position_embeddings"]
    smooth = np.clip((ctx * x - lo) / (hi - lo), 0.0, 1.0)
    implied = 1.0 / ((1.0 - smooth) / factor + smooth)
    return rope if np.allclose(implied, factors, rtol=1e-4, atol=0.0) else None
