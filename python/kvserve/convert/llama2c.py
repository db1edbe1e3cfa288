"""llama2.c checkpoints (legacy version 0 ``.bin``) as Hugging Face ``LlamaForCausalLM`` dirs.

The ``.bin`` is a header of 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
seq_len; a negative vocab_size means an untied classifier follows) and then fp32 arrays in this
order: token_embedding [vocab, dim]; rms_att [L, dim]; wq [L, dim, dim]; wk [L, kv_dim, dim];
wv [L, kv_dim, dim]; wo [L, dim, dim]; rms_ffn [L, dim]; w1 [L, hidden, dim]; w2 [L, dim, hidden];
w3 [L, hidden, dim]; rms_final [dim]; freq_cis_real and freq_cis_imag [seq_len, head_dim / 2]
(skipped: RoPE is recomputed); wcls [vocab, dim] only when untied.
"""

from __future__ import annotations

import argparse
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from kvserve.convert.llama2c_tokenizer import (BOS_ID, EOS_ID, build_tokenizer,
                                               read_llama2c_tokenizer, tokenizer_config)

_HEADER = struct.Struct("<7i")
_VERSIONED_MAGIC = 0x616B3432  # "ak42": llama2.c's newer export formats, not the legacy one
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RMS_NORM_EPS = 1e-5
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class Llama2cConfig:
    """The header of a llama2.c checkpoint."""

    dim: int
    hidden_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    seq_len: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def array_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every fp32 array of the file, in file order."""
        L, d, h, kv, v = self.num_layers, self.dim, self.hidden_dim, self.kv_dim, self.vocab_size
        shapes = [("token_embedding", (v, d)), ("rms_att", (L, d)), ("wq", (L, d, d)),
                  ("wk", (L, kv, d)), ("wv", (L, kv, d)), ("wo", (L, d, d)), ("rms_ffn", (L, d)),
                  ("w1", (L, h, d)), ("w2", (L, d, h)), ("w3", (L, h, d)), ("rms_final", (d,)),
                  ("freq_cis_real", (self.seq_len, self.head_dim // 2)),
                  ("freq_cis_imag", (self.seq_len, self.head_dim // 2))]
        return shapes if self.tied else shapes + [("wcls", (v, d))]

    def file_size(self) -> int:
        return _HEADER.size + 4 * sum(int(np.prod(shape)) for _, shape in self.array_shapes())


def read_llama2c_header(path: Path) -> Llama2cConfig:
    """Reads and checks the header. Raises FileNotFoundError or ValueError (with the reason)."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    with open(path, "rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size:
        raise ValueError(f"{path} is not a llama2.c checkpoint: {len(raw)} bytes, "
                         f"shorter than the {_HEADER.size}-byte header")
    dim, hidden_dim, num_layers, num_heads, num_kv_heads, vocab_size, seq_len = _HEADER.unpack(raw)
    if dim == _VERSIONED_MAGIC:
        raise ValueError(f"{path} is a versioned llama2.c export (magic 'ak42'); only the legacy "
                         "version 0 format (export.py --version 0) is supported")
    c = Llama2cConfig(dim, hidden_dim, num_layers, num_heads, num_kv_heads, abs(vocab_size),
                      seq_len, vocab_size > 0)
    sizes = dict(dim=dim, hidden_dim=hidden_dim, n_layers=num_layers, n_heads=num_heads,
                 n_kv_heads=num_kv_heads, vocab_size=c.vocab_size, seq_len=seq_len)
    if any(value <= 0 or value > 1 << 20 for value in sizes.values()) or (
            dim % num_heads or num_heads % num_kv_heads or c.head_dim % 2):
        raise ValueError(f"{path} is not a llama2.c checkpoint: implausible header {sizes} (sizes "
                         "in [1, 2^20], dim divisible by n_heads into an even head size, n_heads "
                         "by n_kv_heads)")
    actual = path.stat().st_size
    if actual != c.file_size():
        raise ValueError(f"{path} has {actual} bytes but its header {sizes} "
                         f"({'tied' if c.tied else 'untied'} classifier) implies {c.file_size()}: "
                         "the file is truncated or not a legacy llama2.c checkpoint")
    return c


def read_llama2c_arrays(path: Path, c: Llama2cConfig) -> dict[str, np.ndarray]:
    """Every array of the file by its llama2.c name, as fp32 numpy arrays."""
    arrays = {}
    with open(path, "rb") as f:
        f.seek(_HEADER.size)
        for name, shape in c.array_shapes():
            arrays[name] = np.fromfile(f, dtype="<f4", count=int(np.prod(shape))).reshape(shape)
    return arrays


def interleaved_to_halves(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorders the output rows of a q or k projection [num_heads * head_dim, dim] per head from
    llama2.c's RoPE pairs (0,1), (2,3), ... to Hugging Face's rotate-half pairs (i, i + head_dim/2)
    (the permutation of transformers' convert_llama_weights_to_hf)."""
    rows, cols = w.shape
    return w.reshape(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_state_dict(arrays: dict[str, np.ndarray], c: Llama2cConfig,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The llama2.c arrays under Hugging Face Llama parameter names, in `dtype`."""
    t = {name: torch.from_numpy(a) for name, a in arrays.items()}
    state = {"model.embed_tokens.weight": t["token_embedding"], "model.norm.weight": t["rms_final"]}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = t["rms_att"][i]
        state[p + "self_attn.q_proj.weight"] = interleaved_to_halves(t["wq"][i], c.num_heads)
        state[p + "self_attn.k_proj.weight"] = interleaved_to_halves(t["wk"][i], c.num_kv_heads)
        state[p + "self_attn.v_proj.weight"] = t["wv"][i]
        state[p + "self_attn.o_proj.weight"] = t["wo"][i]
        state[p + "post_attention_layernorm.weight"] = t["rms_ffn"][i]
        state[p + "mlp.gate_proj.weight"] = t["w1"][i]
        state[p + "mlp.down_proj.weight"] = t["w2"][i]
        state[p + "mlp.up_proj.weight"] = t["w3"][i]
    if not c.tied:
        state["lm_head.weight"] = t["wcls"]
    return {name: w.to(dtype).contiguous() for name, w in state.items()}


def hf_config(c: Llama2cConfig, dtype_name: str) -> dict:
    """config.json of the equivalent LlamaForCausalLM."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.dim,
        "intermediate_size": c.hidden_dim,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_NORM_EPS,
        # transformers >= 5 reads rope_parameters, older versions rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "rope_theta": ROPE_THETA,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": c.tied,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "dtype": dtype_name,
    }


@dataclass(frozen=True)
class ConversionSummary:
    """What convert_llama2c wrote."""

    config: Llama2cConfig
    num_params: int
    out_dir: Path

    def __str__(self) -> str:
        c = self.config
        return (f"{self.num_params:,} params, {c.num_layers} layers, {c.num_heads} heads / "
                f"{c.num_kv_heads} kv heads, vocab {c.vocab_size}, "
                f"{'tied' if c.tied else 'untied'} classifier -> {self.out_dir}")


def convert_llama2c(checkpoint: str | Path, tokenizer: str | Path, out_dir: str | Path, *,
                    dtype: str = "float32") -> ConversionSummary:
    """Writes config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json of a Hugging Face LlamaForCausalLM to `out_dir` (created if needed).

    Both inputs are read and checked before anything is written. Raises FileNotFoundError for a
    missing input, ValueError for a malformed or truncated one, a tokenizer whose size differs
    from the model's vocabulary, or an unknown dtype ("float32", "bfloat16", "float16").
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    checkpoint, tokenizer, out_dir = Path(checkpoint), Path(tokenizer), Path(out_dir)
    c = read_llama2c_header(checkpoint)
    vocab = read_llama2c_tokenizer(tokenizer)
    if len(vocab.pieces) != c.vocab_size:
        raise ValueError(f"{tokenizer} has {len(vocab.pieces)} tokens but {checkpoint} a "
                         f"vocabulary of {c.vocab_size}")
    state = hf_state_dict(read_llama2c_arrays(checkpoint, c), c, _DTYPES[dtype])
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    _write_json(out_dir / "config.json", hf_config(c, dtype))
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    build_tokenizer(vocab).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(c.seq_len))
    return ConversionSummary(c, sum(w.numel() for w in state.values()), out_dir)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def _run(args: argparse.Namespace) -> int:
    summary = convert_llama2c(args.checkpoint, args.tokenizer, args.out, dtype=args.dtype)
    print(f"converted {args.checkpoint}: {summary}")
    return 0


def add_llama2c_parser(formats: argparse._SubParsersAction) -> None:
    """Registers ``convert llama2c`` on the ``convert`` command's subparsers."""
    p = formats.add_parser("llama2c", help="a llama2.c checkpoint and tokenizer (.bin files)")
    p.add_argument("--checkpoint", required=True, help="model .bin (legacy llama2.c format)")
    p.add_argument("--tokenizer", required=True, help="tokenizer .bin (e.g. tokenizer.bin)")
    p.add_argument("--out", required=True, help="output directory (created if needed)")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.set_defaults(func=_run)
