"""Load Hugging Face weights (Llama family, Gemma, DeepSeek MLA, mixtures of experts) from (sharded)
safetensors files.

Every header is read and checked first (``WeightIndex``), and every tensor the config implies is
checked against it (``check_weights``): names, dtypes, shapes, offsets and file sizes are all
known good before a byte of tensor data is read. The tensors are then memory-mapped by
``safetensors``, converted to the requested dtype and fused the way the C++ layers expect: q/k/v
into ``qkv_proj`` and gate/up into ``gate_up_proj`` (per expert too; MLA's projections are kept
as they are). The returned names drop the ``model.`` prefix.

A quantized checkpoint (``quantization_config``: AWQ, GPTQ, compressed-tensors) has its attention
and MLP projections converted to the layout the quantized_linear op reads: ``<name>.qweight``,
``.scales``, ``.zeros`` instead of ``<name>.weight`` (fused the same way, or, where the fused
layers' layouts differ, as a GGUF file's types may, held in parts ``<name>.parts.<i>.*``, each
run of one layout stacked: ``QuantizedWeight.runs``); routed experts too,
when every expert's projections are quantized: fused_moe_quantized runs them weight-only (int8
experts of an LLM.int8() or W8A8 checkpoint keep their activations in the model's dtype). The
projections the C++ layers transform at load (MLA's) are dequantized to the model's dtype.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from kvserve import _C
from kvserve.architectures import ARCHITECTURES, split_weights, weight_names
from kvserve.loader.sharding import (Shard, check_shardable, local_columns, local_heads,
                                     local_intermediate, local_ssm, local_vocab, shard_config)
from kvserve.loader.weight_check import check_weights, moe_names
from kvserve.loader.weight_index import WeightIndex, kvserve_name
from kvserve.quantization import mxfp4
from kvserve.quantization.formats import CheckpointQuantization, parse_quantization_config
from kvserve.quantization.weights import QuantizedWeight


class _TensorReader:
    """Reads checked tensors, opening each file once; linear weights plain or quantized."""

    def __init__(self, index: WeightIndex, dtype: torch.dtype,
                 quant: CheckpointQuantization | None):
        self.index, self.dtype, self.quant, self.handles = index, dtype, quant, {}

    def __call__(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.raw(name, dtype or self.dtype)

    def raw(self, name: str, dtype: torch.dtype | None = None,
            part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor in `dtype` (default: as stored), a copy rather than a view of the file.
        part (dim, start, length): only those rows (dim 0) or columns (dim 1), read alone."""
        info = self.index.tensors[name]
        try:
            if info.file not in self.handles:
                self.handles[info.file] = safe_open(str(info.file), framework="pt")
            if part is None and info.rows is None:
                tensor = self.handles[info.file].get_tensor(info.name)
            else:
                view = self.handles[info.file].get_slice(info.name)
                first, count = info.rows or (0, info.shape[0])  # a split tensor's rows
                dim, start, length = part or (0, 0, count)
                tensor = (view[first + start:first + start + length] if dim == 0
                          else view[first:first + count, start:start + length])
        except Exception as e:  # safetensors raises its own error types; its checks mirror ours
            raise ValueError(f"{info.file}: cannot read tensor '{name}': {e}") from e
        # A copy: a tensor that views the memory map would keep the whole file mapped (and its
        # pages resident) for as long as the model lives.
        return tensor.to(dtype or tensor.dtype, copy=True)

    def quantized(self, module: str) -> bool:
        return self.quant is not None and self.quant.covers(module)

    def linear(self, module: str, shape: tuple[int, int]) -> QuantizedWeight:
        """A quantized linear layer [out, in] as quantized_linear reads it."""
        return self.quant.read(self.raw, module, *shape)

    def weight(self, module: str, shape: tuple[int, int]) -> torch.Tensor:
        """A linear layer's plain weight, dequantized when the checkpoint quantized it."""
        if self.quantized(module):
            return self.linear(module, shape).dequantize().to(self.dtype)
        return self(module + ".weight")

    def put(self, w: dict[str, torch.Tensor], out: str, modules: list[str],
            shapes: list[tuple[int, int]], parts: list[tuple[int, int, int]] | None = None
            ) -> None:
        """The linear layers `modules` fused along the output dimension as `out` (a kvserve name
        without .weight): plain, or quantized when the checkpoint quantized them (in the scheme
        that ModelConfig.quantization names). parts: per module, the (dim, start, length) a
        tensor-parallel rank holds: plain rows or columns read alone; a quantized module is
        unpacked whole (one module at a time) and narrowed with its scales and zeros."""
        if all(self.quantized(m) for m in modules):
            linears = [self.linear(m, s) for m, s in zip(modules, shapes)]
            if parts is not None:
                linears = [q.narrow(*part, name=m) for q, m, part in zip(linears, modules, parts)]
            runs = QuantizedWeight.runs(linears)
            for i, run in enumerate(runs):
                q = QuantizedWeight.concat(run)
                name = out if len(runs) == 1 else f"{out}.parts.{i}"
                w[name + ".qweight"], w[name + ".scales"] = q.qweight, q.scales
                for field in ("zeros", "super_scales", "super_mins"):
                    if getattr(q, field) is not None:
                        w[f"{name}.{field}"] = getattr(q, field)
        elif parts is not None:
            w[out + ".weight"] = torch.cat([self.part(m, s, part)
                                            for m, s, part in zip(modules, shapes, parts)])
        else:
            w[out + ".weight"] = torch.cat([self.weight(m, s) for m, s in zip(modules, shapes)])

    def part(self, module: str, shape: tuple[int, int], part: tuple[int, int, int]
             ) -> torch.Tensor:
        """A tensor-parallel rank's rows or columns of a plain linear weight: read alone, or,
        when the checkpoint quantized the layer, dequantized from the narrowed quantized one."""
        if self.quantized(module):
            return self.linear(module, shape).narrow(*part, name=module).dequantize().to(
                self.dtype)
        return self.raw(module + ".weight", self.dtype, part)


def load_weights(model_dir: Path, config: _C.ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu",
                 shard: Shard | None = None,
                 layers_of: Callable[[WeightIndex], WeightIndex] | None = None
                 ) -> dict[str, torch.Tensor]:
    """Reads, checks, converts and fuses every weight the model needs (config: the whole
    model's). shard: only what this tensor-parallel rank holds (kvserve.loader.sharding), each
    weight read in part, so that no rank ever holds the whole model's projections.
    layers_of: a view of the checkpoint's (renamed) tensors that holds decoder layers and a final
    norm only, read as the model's; no embedding or LM head is read (a multi-token-prediction
    module's block, which shares the target's: kvserve.loader.mtp_weights).

    Raises FileNotFoundError for a missing weight file and ValueError, naming the file and the
    tensor, for a malformed one or one that disagrees with the config."""
    if shard is not None and shard.size == 1:
        shard = None
    if shard is not None:
        check_shardable(config, shard.size)
    hf, read = _open_checkpoint(Path(model_dir), config, dtype, device, layers_of)
    w: dict[str, torch.Tensor] = {"norm.weight": read("model.norm.weight")}
    if layers_of is None:
        _vocab_matrix(read, "model.embed_tokens", "embed_tokens", config, shard, w)
        if not config.tie_word_embeddings:
            _vocab_matrix(read, "lm_head", "lm_head", config, shard, w)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out = f"layers.{i}."
        if not config.post_norms:
            w[out + "input_layernorm.weight"] = read(p + "input_layernorm.weight")
        if config.has_mixer(i):
            _read_mixer(read, config, p + "mixer.", out + "mixer.", w, shard)
        if not config.has_attention(i):
            pass
        elif config.use_mla():
            _read_mla(read, config, p + "self_attn.", out + "self_attn.", w, shard)
        else:
            _read_attention(read, config, i, p + "self_attn.", out + "self_attn.", w, shard)
        if config.mlp_only(i) and config.is_moe_layer(i):  # Nemotron-H: an MoE alone
            _read_moe(read, config, p, out + "mlp.", w, shard)
            continue
        if config.mlp_only(i):  # Nemotron-H: the layer is its MLP, after the input norm
            _read_ungated_mlp(read, config, p + "mlp.", out + "mlp.", w, shard)
            continue
        if not config.ssm.mlp:
            continue
        if not config.parallel_block:  # Cohere: one norm before attention and MLP
            w[out + "post_attention_layernorm.weight"] = read(p + "post_attention_layernorm.weight")
        mlp_norms = ((["pre_feedforward_layernorm"] if config.sandwich_norms else [])
                     + (["post_feedforward_layernorm"]
                        if config.sandwich_norms or config.post_norms else []))
        for norm in mlp_norms:
            w[out + norm + ".weight"] = read(p + norm + ".weight")
        if config.is_moe_layer(i):
            _read_moe(read, config, p, out + "mlp.", w, shard)
        elif not config.gated_mlp:
            _read_ungated_mlp(read, config, p + "mlp.", out + "mlp.", w, shard)
        elif ARCHITECTURES[config.architecture].fused_mlp:
            _read_fused_mlp(read, config, p + "mlp.", out + "mlp.", w, shard,
                            config.intermediate_size)
        else:
            _read_mlp(read, p + "mlp.", out + "mlp.", config.mlp_bias, w,
                      (config.intermediate_size, config.hidden_size),
                      shard=None if shard is None else (shard.rank,
                                                        *local_intermediate(config, shard)))
    fold = ARCHITECTURES[config.architecture].fold_weights
    if fold is not None:  # over the rank's rows, as its config counts them
        fold(config if shard is None else shard_config(config, shard), hf, w)
    return {name: t.to(device).contiguous() for name, t in w.items()}


def _open_checkpoint(model_dir: Path, config: _C.ModelConfig, dtype: torch.dtype,
                     device: torch.device | str,
                     layers_of: Callable[[WeightIndex], WeightIndex] | None = None
                     ) -> tuple[dict, _TensorReader]:
    """The checkpoint's config.json values and a reader of its tensors, renamed as kvserve names
    them and checked against `config` (a GGUF file's: its own reader)."""
    if model_dir.suffix == ".gguf" and model_dir.is_file():  # a llama.cpp file, read as it is
        from kvserve.loader.gguf_checkpoint import GGUFCheckpoint, GGUFTensorReader

        checkpoint = GGUFCheckpoint(model_dir)
        # CUDA's quantized kernels take one level of scales (quantized_linear.h).
        one_level = torch.device(device).type != "cpu"
        hf, read = checkpoint.hf_config, GGUFTensorReader(checkpoint, dtype, one_level)
    else:
        config_path = model_dir / "config.json"
        hf = json.loads(config_path.read_text())
        quant = parse_quantization_config(hf)
        if quant is not None and quant.bits != 8 and split_weights(config):
            raise ValueError(f"{config_path}: a {quant.bits}-bit {config.architecture} "
                             "checkpoint; kvserve reads its fused projections (q/k/v, gate/up) "
                             "by rows, from plain or 8-bit weights only (int4 formats pack "
                             "outputs in columns)")
        index = (WeightIndex.from_dir(model_dir).renamed(weight_names(config))
                 .split(split_weights(config)))
        if quant is not None:  # its ignore list as the renamed index names the modules
            renames = weight_names(config)  # which match a tensor's name: its module's + "."
            quant.ignore = [p if p.startswith("re:")
                            else kvserve_name(p + ".", renames).removesuffix(".")
                            for p in quant.ignore]
        if layers_of is not None:
            index = layers_of(index)
        check_weights(index, config, config_path, quant, mxfp4.is_mxfp4(hf),
                      vocab=layers_of is None)
        read = _TensorReader(index, dtype, quant)
    return hf, read


def load_embedding(model_dir: Path, config: _C.ModelConfig, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """The whole input embedding [vocab, hidden] in `dtype` (dequantized where the checkpoint
    quantized it) times the config's embedding_multiplier, rounded as CausalLM.embed_inputs
    rounds it: for a speculative head on rank 0 of a tensor-parallel target, whose own
    embedding holds only its rows of the vocabulary."""
    _, read = _open_checkpoint(Path(model_dir), config, dtype, device)
    shape = (config.vocab_size, config.hidden_size)
    table = (read.linear("model.embed_tokens", shape).dequantize().to(dtype)
             if read.quantized("model.embed_tokens") else read.raw("model.embed_tokens.weight",
                                                                   dtype))
    if config.embedding_multiplier != 1.0:
        table = table * torch.tensor(config.embedding_multiplier, dtype=table.dtype)
    return table.to(device).contiguous()


def _read_ungated_mlp(read: _TensorReader, c: _C.ModelConfig, mlp: str, out: str,
                      w: dict[str, torch.Tensor], shard: Shard | None,
                      sizes: tuple[int, int] | None = None, bias: bool | None = None,
                      plain: bool = False) -> None:
    """An MLP without a gate (Nemotron-H): up [intermediate, hidden], down [hidden,
    intermediate]; sizes (intermediate, hidden) and bias default to the dense MLP's. plain:
    dequantized (routed experts that fused_moe runs). shard: up's rows and down's columns of the
    rank's share of the intermediate size (down's bias on rank 0)."""
    inter, hidden = sizes or (c.intermediate_size, c.hidden_size)
    first, n = (0, inter) if shard is None else local_columns(inter, shard)
    for name, shape, part in (("up_proj", (inter, hidden), (0, first, n)),
                              ("down_proj", (hidden, inter), (1, first, n))):
        if shard is not None and plain:
            w[out + name + ".weight"] = read.part(mlp + name, shape, part)
        elif shard is not None:
            read.put(w, out + name, [mlp + name], [shape], [part])
        elif plain:
            w[out + name + ".weight"] = read.weight(mlp + name, shape)
        else:
            read.put(w, out + name, [mlp + name], [shape])
    if c.mlp_bias if bias is None else bias:
        w[out + "up_proj.bias"] = read.raw(mlp + "up_proj.bias", read.dtype, (0, first, n))
        if shard is None or shard.rank == 0:  # added once to the ranks' sum
            w[out + "down_proj.bias"] = read(mlp + "down_proj.bias")


def _read_ungated_moe(read: _TensorReader, c: _C.ModelConfig, prefix: str, out: str,
                      w: dict[str, torch.Tensor], shard: Shard | None) -> None:
    """Nemotron-H's experts (up and down, no gate, no biases; on the latent projection of the
    hidden state with moe_latent_size), its shared expert of that form and the latent
    projections. The experts stay quantized when every one is, else are dequantized."""
    m, hidden = c.moe, c.hidden_size
    width = m.latent_size or hidden
    experts = [f"{prefix}experts.{e}." for e in range(m.num_experts)]
    plain = not all(read.quantized(x + name) for x in experts for name in ("up_proj", "down_proj"))
    for e, expert in enumerate(experts):
        _read_ungated_mlp(read, c, expert, f"{out}experts.{e}.", w, shard,
                          (m.moe_intermediate_size, width), bias=False, plain=plain)
    _read_ungated_mlp(read, c, prefix + "shared_experts.", out + "shared_experts.", w, shard,
                      (m.shared_intermediate_size, hidden))
    if m.latent_size:
        for name, shape in (("fc1_latent_proj", (width, hidden)),
                            ("fc2_latent_proj", (hidden, width))):
            read.put(w, out + name, [prefix + name], [shape])
            if c.mlp_bias:
                w[out + name + ".bias"] = read(prefix + name + ".bias")


def _read_fused_mlp(read: _TensorReader, c: _C.ModelConfig, mlp: str, out: str,
                    w: dict[str, torch.Tensor], shard: Shard | None, inter: int) -> None:
    """An MLP of `inter` columns whose checkpoint holds gate and up as one tensor (gate rows
    first). shard: the rows of the rank's columns of gate and of up, down's columns (its bias on
    rank 0)."""
    hidden = c.hidden_size
    if shard is None:
        w[out + "gate_up_proj.weight"] = read.weight(mlp + "gate_up_proj", (2 * inter, hidden))
        w[out + "down_proj.weight"] = read.weight(mlp + "down_proj", (hidden, inter))
        if c.mlp_bias:
            for name in ("gate_up_proj", "down_proj"):
                w[out + name + ".bias"] = read(mlp + name + ".bias")
        return
    first, n = local_columns(inter, shard)
    rows = [(0, first, n), (0, inter + first, n)]  # of gate, then of up
    w[out + "gate_up_proj.weight"] = torch.cat([
        read.part(mlp + "gate_up_proj", (2 * inter, hidden), part) for part in rows])
    w[out + "down_proj.weight"] = read.part(mlp + "down_proj", (hidden, inter), (1, first, n))
    if c.mlp_bias:
        w[out + "gate_up_proj.bias"] = torch.cat([
            read.raw(mlp + "gate_up_proj.bias", read.dtype, part) for part in rows])
        if shard.rank == 0:  # added once to the ranks' sum
            w[out + "down_proj.bias"] = read(mlp + "down_proj.bias")


def _read_mixer(read: _TensorReader, c: _C.ModelConfig, mixer: str, out: str,
                w: dict[str, torch.Tensor], shard: Shard | None = None) -> None:
    """A state-space mixer's weights (csrc/layers/mamba2_mixer.h, mamba_mixer.h): its
    projections plain or quantized, the convolution's [conv_dim, 1, kernel] weight as [conv_dim,
    kernel]; A_log in fp32, as the reference keeps it. shard: a Mamba2 mixer's part on that rank
    (kvserve.loader.sharding)."""
    s = c.ssm
    if s.kind == "mamba":
        _read_mamba_mixer(read, c, mixer, out, w, shard)
        return
    if shard is not None:
        _read_mixer_shard(read, c, mixer, out, w, shard)
        return
    _read_mixer_common(read, c, mixer, out, w, (
        ("in_proj", (2 * s.inner_size + 2 * s.n_groups * s.state_size + s.num_heads,
                     c.hidden_size), s.proj_bias),
        ("out_proj", (c.hidden_size, s.inner_size), s.out_proj_bias)))
    for name in ("D", "dt_bias") + (("norm.weight",) if s.norm != "gate_only" else ()):
        w[out + name] = read(mixer + name)


def _read_mixer_common(read: _TensorReader, c: _C.ModelConfig, mixer: str, out: str,
                       w: dict[str, torch.Tensor], projections: tuple) -> None:
    """What both mixers hold: the (name, [out, in], bias) projections, plain or quantized, the
    convolution, A_log in fp32."""
    for proj, shape, bias in projections:
        read.put(w, out + proj, [mixer + proj], [shape])  # quantized if the file is
        if bias:
            w[out + proj + ".bias"] = read(mixer + proj + ".bias")
    w[out + "conv1d.weight"] = read(mixer + "conv1d.weight").squeeze(1)
    if c.ssm.conv_bias:
        w[out + "conv1d.bias"] = read(mixer + "conv1d.bias")
    w[out + "A_log"] = read(mixer + "A_log", torch.float32)


def _rows(read: _TensorReader, mixer: str, name: str, parts: list[tuple[int, int]],
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows (first, count) of the mixer's tensor `name`, concatenated (a rank's part)."""
    return torch.cat([read.raw(mixer + name, dtype or read.dtype, (0, *p)) for p in parts])


def _read_mixer_shard(read: _TensorReader, c: _C.ModelConfig, mixer: str, out: str,
                      w: dict[str, torch.Tensor], shard: Shard) -> None:
    """A rank's part of a Mamba2 mixer: its heads' rows of in_proj's z, x and dt, its groups'
    rows of B and C, the same channels of the convolution, its heads of A, D and dt_bias and of
    the norm's weight, its columns of out_proj (the bias on rank 0)."""
    s = c.ssm
    h0, h, g0, g = local_ssm(c, shard)
    d, n, inner, bc = s.head_dim, s.state_size, s.inner_size, s.n_groups * s.state_size
    heads = (h0 * d, h * d)  # the rank's channels of z, of x and of the norm
    # Its channels of x, B and C among the convolution's, then its rows of in_proj: z, x, B, C,
    # dt.
    conv_rows = [heads, (inner + g0 * n, g * n), (inner + bc + g0 * n, g * n)]
    in_rows = ([heads] + [(inner + first, count) for first, count in conv_rows]
               + [(2 * inner + 2 * bc + h0, h)])
    in_shape = (2 * inner + 2 * bc + s.num_heads, c.hidden_size)
    rows = functools.partial(_rows, read, mixer)
    read.put(w, out + "in_proj", [mixer + "in_proj"] * 5, [in_shape] * 5,
             [(0, *p) for p in in_rows])
    if s.proj_bias:
        w[out + "in_proj.bias"] = rows("in_proj.bias", in_rows)
    read.put(w, out + "out_proj", [mixer + "out_proj"], [(c.hidden_size, inner)],
             [(1, h0 * d, h * d)])
    if s.out_proj_bias and shard.rank == 0:  # added once to the ranks' sum
        w[out + "out_proj.bias"] = read(mixer + "out_proj.bias")
    w[out + "conv1d.weight"] = rows("conv1d.weight", conv_rows).squeeze(1)
    if s.conv_bias:
        w[out + "conv1d.bias"] = rows("conv1d.bias", conv_rows)
    w[out + "A_log"] = rows("A_log", [(h0, h)], torch.float32)
    for name in ("D", "dt_bias"):
        w[out + name] = rows(name, [(h0, h)])
    if s.norm != "gate_only":
        w[out + "norm.weight"] = rows("norm.weight", [heads])


# A Mamba mixer's RMSNorms of dt, B and C (dt_bc_norm "weighted"): the checkpoint's names (Jamba's)
# and kvserve's.
_DT_BC_NORMS = (("dt_layernorm", "dt_norm"), ("b_layernorm", "B_norm"), ("c_layernorm", "C_norm"))


def _read_mamba_mixer(read: _TensorReader, c: _C.ModelConfig, mixer: str, out: str,
                      w: dict[str, torch.Tensor], shard: Shard | None = None) -> None:
    """A Mamba mixer's weights (csrc/layers/mamba_mixer.h): dt_proj's bias as the scan's
    dt_bias; the norms of dt, B and C where it has weighted ones (whole on every rank). shard:
    the rank's inner channels: in_proj's rows of x and of the gate, x_proj's and out_proj's
    columns (out_proj's bias on rank 0), dt_proj's rows, the convolution, A_log, D and dt_bias."""
    s = c.ssm
    inner, states, rank = s.inner_size, s.state_size, s.time_step_rank
    in_shape = (2 * inner, c.hidden_size)
    if shard is None:
        _read_mixer_common(read, c, mixer, out, w, (
            ("in_proj", in_shape, s.proj_bias),
            ("x_proj", (rank + 2 * states, inner), False),
            ("dt_proj", (inner, rank), False),
            ("out_proj", (c.hidden_size, inner), s.out_proj_bias)))
        w[out + "D"] = read(mixer + "D")
        w[out + "dt_bias"] = read(mixer + "dt_proj.bias")
    else:
        first, n = local_ssm(c, shard)[:2]  # a Mamba mixer's heads are its channels
        rows = functools.partial(_rows, read, mixer)
        in_rows = [(first, n), (inner + first, n)]  # of x, then of the gate
        read.put(w, out + "in_proj", [mixer + "in_proj"] * 2, [in_shape] * 2,
                 [(0, *p) for p in in_rows])
        if s.proj_bias:
            w[out + "in_proj.bias"] = rows("in_proj.bias", in_rows)
        for name, shape, part in (("x_proj", (rank + 2 * states, inner), (1, first, n)),
                                  ("dt_proj", (inner, rank), (0, first, n)),
                                  ("out_proj", (c.hidden_size, inner), (1, first, n))):
            read.put(w, out + name, [mixer + name], [shape], [part])
        if s.out_proj_bias and shard.rank == 0:  # added once to the ranks' sum
            w[out + "out_proj.bias"] = read(mixer + "out_proj.bias")
        w[out + "conv1d.weight"] = rows("conv1d.weight", [(first, n)]).squeeze(1)
        if s.conv_bias:
            w[out + "conv1d.bias"] = rows("conv1d.bias", [(first, n)])
        w[out + "A_log"] = rows("A_log", [(first, n)], torch.float32)
        w[out + "D"] = rows("D", [(first, n)])
        w[out + "dt_bias"] = rows("dt_proj.bias", [(first, n)])
    if s.dt_bc_norm == "weighted":
        for name, ours in _DT_BC_NORMS:
            w[out + ours + ".weight"] = read(mixer + name + ".weight")


def _vocab_rows(read: _TensorReader, name: str, config: _C.ModelConfig,
                shard: Shard | None) -> torch.Tensor:
    """An embedding or LM head: whole, or the rank's rows of the vocabulary (local_vocab),
    zero rows past its end."""
    if shard is None:
        return read(name)
    first, n = local_vocab(config, shard)
    held = max(0, min(n, config.vocab_size - first))
    if held == n:
        return read.raw(name, read.dtype, (0, first, n))
    rows = [read.raw(name, read.dtype, (0, first, held))] if held else []
    return torch.cat(rows + [torch.zeros(n - held, config.hidden_size, dtype=read.dtype)])


def _vocab_matrix(read: _TensorReader, module: str, out: str, config: _C.ModelConfig,
                  shard: Shard | None, w: dict[str, torch.Tensor]) -> None:
    """The input embedding or the untied LM head, as `out`: plain (out.weight), or quantized when
    the checkpoint quantized it (out.qweight / .scales / .zeros); a tensor-parallel rank's rows
    of the vocabulary, zero rows past its end."""
    if not read.quantized(module):
        w[out + ".weight"] = _vocab_rows(read, module + ".weight", config, shard)
        return
    q = read.linear(module, (config.vocab_size, config.hidden_size))
    if shard is not None:
        first, n = local_vocab(config, shard)
        held = max(0, min(n, config.vocab_size - first))
        q = q.narrow(0, first, held, name=module).padded(n - held)
    w[out + ".qweight"], w[out + ".scales"] = q.qweight, q.scales
    for name in ("zeros", "super_scales", "super_mins"):
        if getattr(q, name) is not None:
            w[f"{out}.{name}"] = getattr(q, name)


def _read_attention(read: _TensorReader, c: _C.ModelConfig, layer: int, attn: str, out: str,
                    w: dict[str, torch.Tensor], shard: Shard | None = None) -> None:
    # A layer that shares an earlier layer's KV (CLA) projects queries only.
    fused, names = ("q_proj", "q") if c.kv_source(layer) != layer else ("qkv_proj", "qkv")
    hidden, q_out, kv_out = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    rows = {"q": (0, q_out), "k": (0, kv_out), "v": (0, kv_out)}
    if shard is not None:  # the rank's heads: q/k/v rows, o_proj columns
        q0, nq, kv0, nkv = (n * c.head_dim for n in local_heads(c, shard))
        rows = {"q": (q0, nq), "k": (kv0, nkv), "v": (kv0, nkv)}
    read.put(w, out + fused, [attn + f"{x}_proj" for x in names],
             [(q_out if x == "q" else kv_out, hidden) for x in names],
             None if shard is None else [(0, *rows[x]) for x in names])
    if c.qkv_bias:
        w[out + fused + ".bias"] = torch.cat([read.raw(attn + f"{x}_proj.bias", read.dtype,
                                                       (0, *rows[x])) for x in names])
    read.put(w, out + "o_proj", [attn + "o_proj"], [(hidden, q_out)],
             None if shard is None else [(1, *rows["q"])])
    if c.o_proj_bias and (shard is None or shard.rank == 0):  # added once to the sum
        w[out + "o_proj.bias"] = read(attn + "o_proj.bias")
    if c.attention_sinks:  # one per query head: the rank's heads
        w[out + "sinks"] = read.raw(attn + "sinks", torch.float32,
                                    None if shard is None else (0, rows["q"][0] // c.head_dim,
                                                                rows["q"][1] // c.head_dim))
    if c.qk_norm:  # per head: replicated; over all heads (OLMo 2): the rank's heads' part
        part = shard is not None and c.qk_norm_full_width
        w[out + "q_norm.weight"] = read.raw(attn + "q_norm.weight", read.dtype,
                                            (0, *rows["q"]) if part else None)
        if c.kv_source(layer) == layer:
            w[out + "k_norm.weight"] = read.raw(attn + "k_norm.weight", read.dtype,
                                                (0, *rows["k"]) if part else None)


# MLA's projections that the C++ layer transforms at load: dequantized when the checkpoint
# quantized them (o_proj is a plain Linear, read like any other).
MLA_PROJECTIONS = ("kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "q_a_proj.weight",
                   "q_b_proj.weight", "q_proj.weight")


def _read_mla(read: _TensorReader, c: _C.ModelConfig, attn: str, out: str,
              w: dict[str, torch.Tensor], shard: Shard | None = None) -> None:
    """MLA's projections as they are: the C++ layer fuses and reorders them itself. shard: the
    rank's heads, rows of q_b_proj (q_proj) and kv_b_proj, columns of o_proj; the latent
    projections (kv_a, q_a) and their norms are every rank's."""
    names = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
             "o_proj.weight"]
    names += (["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
              if c.mla.q_lora_rank else ["q_proj.weight"])
    if c.qkv_bias:
        names += ["kv_a_proj_with_mqa.bias"] + (["q_a_proj.bias"] if c.mla.q_lora_rank else [])
    if c.o_proj_bias and (shard is None or shard.rank == 0):  # added once to the sum
        names.append("o_proj.bias")
    m = c.mla
    # Per head: rows of q_b_proj / q_proj, of kv_b_proj; columns of o_proj.
    per_head = {"q_b_proj.weight": m.qk_nope_head_dim + m.qk_rope_head_dim,
                "q_proj.weight": m.qk_nope_head_dim + m.qk_rope_head_dim,
                "kv_b_proj.weight": m.qk_nope_head_dim + m.v_head_dim,
                "o_proj.weight": m.v_head_dim}
    first, heads = (0, c.num_heads) if shard is None else local_heads(c, shard)[:2]
    for name in names:
        module = attn + name.removesuffix(".weight")
        part = None
        if shard is not None and name in per_head:
            part = (1 if name == "o_proj.weight" else 0, first * per_head[name],
                    heads * per_head[name])
        if name == "o_proj.weight":
            read.put(w, out + "o_proj", [module], [(c.hidden_size, c.num_heads * m.v_head_dim)],
                     None if part is None else [part])
        elif part is not None:
            w[out + name] = read.part(module, _mla_shape(c, name), part)
        elif name in MLA_PROJECTIONS and read.quantized(module):
            w[out + name] = read.weight(module, _mla_shape(c, name))
        else:
            w[out + name] = read(attn + name)


def _mla_shape(c: _C.ModelConfig, name: str) -> tuple[int, int]:
    m = c.mla
    q_in = m.q_lora_rank or c.hidden_size
    return {"kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, c.hidden_size),
            "kv_b_proj.weight": (c.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            "q_a_proj.weight": (m.q_lora_rank, c.hidden_size),
            "q_b_proj.weight": (c.num_heads * m.qk_head_dim, q_in),
            "q_proj.weight": (c.num_heads * m.qk_head_dim, c.hidden_size)}[name]


def _read_mlp(read: _TensorReader, mlp: str, out: str, bias: bool, w: dict[str, torch.Tensor],
              sizes: tuple[int, int],
              names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
              plain: bool = False, shard: tuple[int, int, int] | None = None) -> None:
    """sizes: (intermediate, hidden). plain: dequantize (routed experts fused_moe runs; routed
    experts kept quantized run weight-only, by the C++ layer's rule). shard: (rank, first
    intermediate column, columns) of a tensor-parallel rank: gate/up rows, down columns."""
    gate, up, down = names
    inter, hidden = sizes
    if shard is not None:
        rank, first, n = shard
        if plain:  # experts dequantized for fused_moe: the rank's part of each
            w[out + "gate_up_proj.weight"] = torch.cat([
                read.part(mlp + x, (inter, hidden), (0, first, n)) for x in (gate, up)])
            w[out + "down_proj.weight"] = read.part(mlp + down, (hidden, inter), (1, first, n))
        else:
            read.put(w, out + "gate_up_proj", [mlp + gate, mlp + up], [(inter, hidden)] * 2,
                     [(0, first, n)] * 2)
            read.put(w, out + "down_proj", [mlp + down], [(hidden, inter)], [(1, first, n)])
        if bias:
            w[out + "gate_up_proj.bias"] = torch.cat([
                read.raw(f"{mlp}{x}.bias", read.dtype, (0, first, n)) for x in (gate, up)])
            if rank == 0:  # added once to the sum
                w[out + "down_proj.bias"] = read(f"{mlp}{down}.bias")
        return
    if plain:
        w[out + "gate_up_proj.weight"] = torch.cat([read.weight(mlp + gate, (inter, hidden)),
                                                    read.weight(mlp + up, (inter, hidden))])
        w[out + "down_proj.weight"] = read.weight(mlp + down, (hidden, inter))
    else:
        read.put(w, out + "gate_up_proj", [mlp + gate, mlp + up], [(inter, hidden)] * 2)
        read.put(w, out + "down_proj", [mlp + down], [(hidden, inter)])
    if bias:
        w[out + "gate_up_proj.bias"] = torch.cat([read(f"{mlp}{gate}.bias"),
                                                  read(f"{mlp}{up}.bias")])
        w[out + "down_proj.bias"] = read(f"{mlp}{down}.bias")


def _read_moe(read: _TensorReader, c: _C.ModelConfig, layer: str, out: str,
              w: dict[str, torch.Tensor], shard: Shard | None = None) -> None:
    """Router, per-expert fused gate_up and down, shared experts, under the kvserve names.
    shard: each expert's (and the shared expert's) columns of a tensor-parallel rank."""
    prefix, names = moe_names(c, layer)

    def columns(size: int) -> tuple[int, int, int] | None:
        return None if shard is None else (shard.rank, *local_columns(size, shard))

    w[out + "gate.weight"] = read(prefix + "gate.weight")
    if c.moe.router_bias:
        w[out + "gate.bias"] = read(prefix + "gate.bias")
    if c.moe.scoring_func == "sigmoid":  # kept in fp32, as transformers does
        w[out + "gate.e_score_correction_bias"] = read(prefix + "gate.e_score_correction_bias",
                                                       torch.float32)
    arch = ARCHITECTURES[c.architecture]
    if c.moe.activation == "relu2":
        _read_ungated_moe(read, c, prefix, out, w, shard)
    elif arch.stacked_experts:
        _read_stacked_experts(read, c, prefix + "experts.", out + "experts.", w, shard)
    else:
        experts = [f"{prefix}experts.{e}." for e in range(c.moe.num_experts)]
        # fused_moe_quantized takes every expert in one quantized format, or fused_moe plain ones.
        plain = not all(read.quantized(expert + name) for expert in experts for name in names)
        for e, expert in enumerate(experts):
            _read_mlp(read, expert, f"{out}experts.{e}.", False, w,
                      (c.moe.moe_intermediate_size, c.hidden_size), names, plain=plain,
                      shard=columns(c.moe.moe_intermediate_size))
    if c.moe.activation == "relu2":
        pass  # its shared expert read with its experts
    elif c.moe.shared_intermediate_size and arch.fused_mlp:
        _read_fused_mlp(read, c, prefix + "shared_experts.", out + "shared_experts.", w, shard,
                        c.moe.shared_intermediate_size)
    elif c.moe.shared_intermediate_size:
        _read_mlp(read, prefix + "shared_experts.", out + "shared_experts.", False, w,
                  (c.moe.shared_intermediate_size, c.hidden_size),
                  shard=columns(c.moe.shared_intermediate_size))


def _read_stacked_experts(read: _TensorReader, c: _C.ModelConfig, experts: str, out: str,
                          w: dict[str, torch.Tensor], shard: Shard | None) -> None:
    """Routed experts stored as two tensors over all experts (Architecture.stacked_experts), as
    kvserve's per-expert gate_up_proj [2 * intermediate, hidden] (gate rows first) and down_proj
    [hidden, intermediate], and their biases: plain, or MXFP4 blocks and scales (gpt-oss's
    released checkpoints) dequantized to the model's dtype an expert at a time; no other
    quantized form. gpt-oss's ("columns") are transposed, its gate and up alternating (MXFP4
    blocks are not transposed). shard: each expert's intermediate columns of a tensor-parallel
    rank (gate and up rows, down columns), the down projection's bias on rank 0 only (zeros on
    the others: the ranks' outputs are summed)."""
    columns = ARCHITECTURES[c.architecture].stacked_experts == "columns"
    inter = c.moe.moe_intermediate_size
    first, n = (0, inter) if shard is None else local_columns(inter, shard)
    rows = torch.cat([torch.arange(first, first + n),
                      torch.arange(inter + first, inter + first + n)])
    for name in ("gate_up_proj", "down_proj"):
        if read.quantized(experts + name):
            raise ValueError(f"{c.architecture}: quantized stacked experts ({experts}{name}) "
                             "are not supported")
        index = getattr(read, "index", None)  # MXFP4: blocks [experts, out, ...]
        packed = index is not None and f"{experts}{name}.blocks" in index.tensors
        if packed:
            blocks, scales = read.raw(f"{experts}{name}.blocks"), read.raw(f"{experts}{name}.scales")
        else:
            stacked = read(f"{experts}{name}.weight")
        bias = read(f"{experts}{name}.bias") if c.moe.expert_bias else None
        for e in range(c.moe.num_experts):
            if packed:  # dequantized one expert at a time, already [out, in]
                weight = mxfp4.dequantize(blocks[e], scales[e], read.dtype)
            else:
                weight = stacked[e].T if columns else stacked[e]
            b = None if bias is None else bias[e]
            if columns and name == "gate_up_proj":  # rows 0, 2, ... gate; 1, 3, ... up
                weight = torch.cat([weight[0::2], weight[1::2]])
                b = None if b is None else torch.cat([b[0::2], b[1::2]])
            if shard is not None and name == "gate_up_proj":  # the rank's gate rows, up rows
                weight = weight[rows]
                b = None if b is None else b[rows]
            elif shard is not None:
                weight = weight[:, first:first + n]
                b = b if b is None or shard.rank == 0 else torch.zeros_like(b)
            w[f"{out}{e}.{name}.weight"] = weight.contiguous()
            if b is not None:
                w[f"{out}{e}.{name}.bias"] = b.contiguous()
