"""Quantized checkpoint formats: what `quantization_config` in config.json says, the tensors each
format stores for a linear layer, and their conversion to and from `QuantizedWeight`.

Read: AWQ ("gemm" layout), GPTQ (desc_act false), compressed-tensors (int-quantized and
float-quantized int8 / fp8 per channel or tensor, pack-quantized int4 per group; int8 W8A8 with
dynamic per-token activations runs them so), bitsandbytes 8-bit (LLM.int8(): int8 `weight` with its
per-row absmax `SCB`). Written by `kvserve quantize`: AWQ gemm for int4, compressed-tensors for
int8, w8a8 and fp8, bitsandbytes 8-bit for llm.int8.

Every layer's linear projections are quantized (attention and MLP); embeddings, norms, the LM
head and MoE routers stay as they are, as in these formats' own tools.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvserve.quantization.weights import QuantizedWeight, pack_int4, unpack_int4

# AWQ's gemm layout keeps outputs 8c + AWQ_ORDER[j] in nibble j of int32 column c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SUPPORTED = ("awq (version gemm, 4 bits, zero_point), gptq (4 bits, desc_act false), "
             "compressed-tensors (int-quantized / float-quantized 8-bit per channel or tensor, "
             "W8A8 int8 with dynamic per-token activations, "
             "pack-quantized 4-bit per group), bitsandbytes (load_in_8bit: LLM.int8())")

# (shape, safetensors dtypes) of each tensor a format stores for one linear layer
Expected = dict[str, tuple[tuple[int, ...], tuple[str, ...]]]
Reader = Callable[[str], torch.Tensor]  # a tensor by its full name, in its stored dtype
FLOAT = ("F32", "BF16", "F16")


@dataclass
class CheckpointQuantization:
    """One checkpoint's quantization_config, parsed and checked."""
    method: str          # "awq", "gptq", "compressed-tensors", "bitsandbytes"
    bits: int
    group_size: int      # -1: one group per row
    symmetric: bool = True
    fmt: str = ""        # compressed-tensors format, "float" / "int" for its 8-bit ones
    ignore: list[str] = field(default_factory=list)
    per_tensor: bool = False  # compressed-tensors 8-bit: one scale for the whole weight
    outlier_threshold: float = 6.0  # bitsandbytes: llm_int8_threshold
    int8_activations: bool = False  # compressed-tensors W8A8: activations to int8 per token
    # The LM head quantized too: compressed-tensors when "lm_head" is not ignored; AWQ / GPTQ
    # with "lm_head": true (the key vLLM reads; GPTQModel writes it).
    lm_head: bool = False
    # The input embedding quantized too: compressed-tensors whose config group targets
    # "Embedding" (as compressed-tensors compresses and decompresses it); AWQ / GPTQ layouts
    # hold linear layers only.
    embeddings: bool = False

    @property
    def scheme(self) -> str:
        """The scheme its quantized projections run in (_C.QuantizationConfig.scheme's names)."""
        if self.method == "bitsandbytes" or self.int8_activations:
            return "llm.int8"  # W8A8: LLM.int8() with no outlier columns
        if self.bits == 4:
            return "int4"
        return "fp8" if self.fmt == "float" else "int8"

    @property
    def linear_outlier_threshold(self) -> float:
        """The llm.int8 scheme's threshold: bitsandbytes' own, or 0 (none) for W8A8."""
        return 0.0 if self.int8_activations else self.outlier_threshold

    def covers(self, module: str) -> bool:
        """Whether the linear layer `module`, by kvserve's name (e.g.
        model.layers.0.mlp.down_proj, model.layers.1.mixer.in_proj, lm_head), is quantized."""
        if module == "lm_head":
            return self.lm_head
        if module == "model.embed_tokens":
            return self.embeddings
        projection = re.search(r"\.(self_attn|mlp|block_sparse_moe|mixer)\.", module)
        if not projection or module.endswith(".gate"):
            return False  # embeddings and routers stay plain
        return not self.ignores(module)

    def ignores(self, module: str) -> bool:
        """Whether the ignore list (modules_to_not_convert) names `module`."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif module == pattern or module.endswith("." + pattern):
                return True
        return False

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size in (-1, 0) else in_features // self.group_size

    def expected(self, module: str, out_features: int, in_features: int) -> Expected:
        """The tensors this format stores for a linear layer [out, in]."""
        n, k, g = out_features, in_features, self.groups(in_features)
        if self.method == "awq":
            return {f"{module}.qweight": ((k, n // 8), ("I32",)),
                    f"{module}.qzeros": ((g, n // 8), ("I32",)),
                    f"{module}.scales": ((g, n), FLOAT)}
        if self.method == "bitsandbytes":
            return {f"{module}.weight": ((n, k), ("I8",)), f"{module}.SCB": ((n,), ("F32",))}
        if self.method == "gptq":
            return {f"{module}.qweight": ((k // 8, n), ("I32",)),
                    f"{module}.qzeros": ((g, n // 8), ("I32",)),
                    f"{module}.scales": ((g, n), FLOAT),
                    f"{module}.g_idx": ((k,), ("I32",))}
        if self.fmt == "pack-quantized":
            out = {f"{module}.weight_packed": ((n, k // 8), ("I32",)),
                   f"{module}.weight_scale": ((n, g), FLOAT),
                   f"{module}.weight_shape": ((2,), ("I32", "I64"))}
            if not self.symmetric:
                out[f"{module}.weight_zero_point"] = ((n // 8, g), ("I32",))
            return out
        return {f"{module}.weight": ((n, k), ("F8_E4M3",) if self.fmt == "float" else ("I8",)),
                f"{module}.weight_scale": ((1,) if self.per_tensor else (n, 1), FLOAT)}

    def optional(self, module: str) -> list[str]:
        """Tensors a linear layer may carry that weight-only kernels do not read (static
        activation scales of FP8 / INT8 W8A8 checkpoints)."""
        if self.method == "bitsandbytes":
            return [f"{module}.weight_format"]  # bitsandbytes' layout tag (0: row-major)
        return [f"{module}.input_scale", f"{module}.weight_zero_point"] if self.method == (
            "compressed-tensors") and self.fmt in ("float", "int") else []

    def read(self, read: Reader, module: str, out_features: int,
             in_features: int) -> QuantizedWeight:
        """The layer's weight as quantized_linear reads it."""
        n, k = out_features, in_features
        group = k if self.group_size in (-1, 0) else self.group_size
        if self.method == "awq":
            q = unpack_int32(read(f"{module}.qweight"), AWQ_ORDER).T          # [n, k]
            zeros = unpack_int32(read(f"{module}.qzeros"), AWQ_ORDER).T       # [n, g]
            scales = _params(read(f"{module}.scales").T)
            return QuantizedWeight(pack_int4(q), scales, zeros.to(scales.dtype).contiguous(),
                                   group)
        if self.method == "bitsandbytes":  # w = weight * SCB / 127, SCB the row's max |w|
            scale = (_fp32(read(f"{module}.SCB")) / 127.0).view(n, 1).contiguous()
            return QuantizedWeight(read(f"{module}.weight").contiguous(), scale, None, k,
                                   self.outlier_threshold)
        if self.method == "gptq":
            g_idx = read(f"{module}.g_idx").long()
            if not torch.equal(g_idx, torch.arange(k) // group):
                raise ValueError(f"{module}.g_idx: kvserve loads GPTQ without act-order "
                                 "(desc_act false), whose g_idx is input // group_size")
            q = unpack_int32(read(f"{module}.qweight").T.contiguous())          # [n, k]
            zeros = unpack_int32(read(f"{module}.qzeros")).T.float() + 1  # stored as zero - 1
            scales = _params(read(f"{module}.scales").T)
            return QuantizedWeight(pack_int4(q), scales, zeros.to(scales.dtype).contiguous(),
                                   group)
        if self.fmt == "pack-quantized":
            q = unpack_int32(read(f"{module}.weight_packed"))                 # signed + 8
            zeros = (torch.full((n, k // group), 8.0) if self.symmetric else
                     unpack_int32(read(f"{module}.weight_zero_point").T.contiguous()).T.float())
            scales = _params(read(f"{module}.weight_scale"))
            return QuantizedWeight(pack_int4(q), scales, zeros.to(scales.dtype).contiguous(),
                                   group)
        scale = _fp32(read(f"{module}.weight_scale")).reshape(-1, 1).expand(n, 1).contiguous()
        weight = read(f"{module}.weight")
        if self.fmt == "float" and torch.isnan(weight.float()).any():
            raise ValueError(f"{module}.weight holds fp8 NaNs")
        # W8A8: llm_int8_linear with no outliers (threshold 0) rounds activations per token.
        return QuantizedWeight(weight.contiguous(), scale, None, k,
                               0.0 if self.int8_activations else None)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def _params(t: torch.Tensor) -> torch.Tensor:
    """Group-wise scales as quantized_linear reads them: fp16 as the file stores them (AWQ's and
    GPTQ's; half the bytes of fp32 beside 4-bit weights), any other dtype widened to fp32."""
    return (t if t.dtype == torch.float16 else t.float()).contiguous()


def unpack_int32(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [r, c] holding 8 nibbles each -> uint8 [r, 8c], nibble j of column c giving element
    8c + order[j]."""
    r, c = packed.shape
    nibbles = torch.stack([(packed >> (4 * j)) & 0xF for j in range(8)], dim=2)  # [r, c, j]
    out = torch.empty_like(nibbles)
    out[:, :, list(order)] = nibbles
    return out.reshape(r, 8 * c).to(torch.uint8)


def pack_int32(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """uint8 [r, 8c] with values in 0..15 -> int32 [r, c]: the inverse of unpack_int32."""
    r, k = q.shape
    grouped = q.to(torch.int64).view(r, k // 8, 8)
    packed = torch.zeros(r, k // 8, dtype=torch.int64)
    for j in range(8):
        packed |= grouped[:, :, order[j]] << (4 * j)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def awq_tensors(module: str, w: QuantizedWeight) -> dict[str, torch.Tensor]:
    """An int4 weight in AWQ's gemm layout (fp16 scales, as AutoAWQ writes them)."""
    q = unpack_int4(w.qweight)                                    # [n, k]
    return {f"{module}.qweight": pack_int32(q.T.contiguous(), AWQ_ORDER),
            f"{module}.qzeros": pack_int32(w.zeros.round().to(torch.uint8).T.contiguous(),
                                           AWQ_ORDER),
            f"{module}.scales": w.scales.T.contiguous().half()}


def compressed_tensors_tensors(module: str, w: QuantizedWeight) -> dict[str, torch.Tensor]:
    """An int8 or fp8 weight per channel in compressed-tensors' int-/float-quantized layout."""
    return {f"{module}.weight": w.qweight, f"{module}.weight_scale": w.scales.contiguous()}


def bitsandbytes_tensors(module: str, w: QuantizedWeight) -> dict[str, torch.Tensor]:
    """An int8 weight per channel as bitsandbytes saves a Linear8bitLt: the int8 `weight`, `SCB`
    (127 x the row's scale: its max |w|) and the row-major layout tag."""
    return {f"{module}.weight": w.qweight, f"{module}.SCB": (w.scales.view(-1) * 127.0).float(),
            f"{module}.weight_format": torch.tensor(0, dtype=torch.uint8)}


def bitsandbytes_config(threshold: float, plain: list[str] | None = None) -> dict:
    """transformers' BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=threshold);
    plain: modules left unquantized (full names)."""
    return {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False,
            "llm_int8_threshold": threshold, "llm_int8_skip_modules": plain or None,
            "llm_int8_has_fp16_weight": False}


def awq_config(group_size: int, plain: list[str] | None = None, lm_head: bool = False) -> dict:
    """plain: modules left unquantized (full names); lm_head: the LM head quantized too."""
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": plain or None}
    if lm_head:
        config["lm_head"] = True
    return config


def compressed_tensors_config(kind: str, int8_activations: bool = False,
                              lm_head: bool = False, embeddings: bool = False,
                              plain: list[str] | None = None) -> dict:
    """kind: "int" (int8) or "float" (fp8 E4M3); per-channel symmetric weights; activations in
    the model's dtype, or (int8_activations) int8 with a dynamic scale per token (W8A8);
    lm_head: the LM head quantized too (not in "ignore"); embeddings: the input embedding too
    (the group targets "Embedding" besides "Linear"); plain: modules left unquantized (full
    names, in "ignore")."""
    activations = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                   "dynamic": True, "group_size": None, "observer": None}
    return {
        "quant_method": "compressed-tensors",
        "format": f"{kind}-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear", "Embedding"] if embeddings else ["Linear"],
            "weights": {"num_bits": 8, "type": kind, "strategy": "channel", "symmetric": True,
                        "dynamic": False, "group_size": None, "observer": "minmax"},
            "input_activations": activations if int8_activations else None,
            "output_activations": None}},
        "ignore": ([] if lm_head else ["lm_head"]) + list(plain or []),
    }


def parse_quantization_config(config: dict) -> CheckpointQuantization | None:
    """The checkpoint's quantization, or None for plain weights. Raises ValueError for a method or
    option kvserve does not load, naming what it does."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()

    def unsupported(what: str) -> ValueError:
        return ValueError(f"quantization_config: {what} is not supported; kvserve loads "
                          f"{SUPPORTED}")

    if method == "mxfp4":  # gpt-oss's experts: dequantized at load (kvserve.quantization.mxfp4)
        return None
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() != "gemm" or qc.get("bits", 4) != 4 or not qc.get(
                "zero_point", True):
            raise unsupported(f"AWQ version {qc.get('version')!r}, {qc.get('bits')} bits, "
                              f"zero_point {qc.get('zero_point')}")
        ignore = list(qc.get("modules_to_not_convert") or [])
        return CheckpointQuantization("awq", 4, int(qc.get("group_size", 128)), False,
                                      ignore=ignore, lm_head=bool(qc.get("lm_head", False)))
    if method == "gptq":
        if qc.get("bits", 4) != 4 or qc.get("desc_act", False) or str(
                qc.get("checkpoint_format", "gptq")) != "gptq":
            raise unsupported(f"GPTQ with {qc.get('bits')} bits, desc_act {qc.get('desc_act')}, "
                              f"checkpoint_format {qc.get('checkpoint_format')!r}")
        return CheckpointQuantization("gptq", 4, int(qc.get("group_size", 128)),
                                      bool(qc.get("sym", True)),
                                      lm_head=bool(qc.get("lm_head", False)))
    if method == "compressed-tensors":
        return _compressed_tensors(qc, unsupported)
    if method == "bitsandbytes":
        if not qc.get("load_in_8bit") or qc.get("load_in_4bit") or qc.get(
                "llm_int8_has_fp16_weight"):
            raise unsupported("bitsandbytes other than load_in_8bit with int8 weights "
                              "(4-bit NF4 / FP4, or fp16 weights kept for training)")
        threshold = float(qc.get("llm_int8_threshold", 6.0))
        return CheckpointQuantization("bitsandbytes", 8, -1, True,
                                      ignore=list(qc.get("llm_int8_skip_modules") or []),
                                      outlier_threshold=threshold)
    raise unsupported(f"quant_method {method!r}")


def _compressed_tensors(qc: dict, unsupported) -> CheckpointQuantization:
    groups = list((qc.get("config_groups") or {}).values())
    fmt = qc.get("format")
    if len(groups) != 1 or qc.get("sparsity_config"):
        raise unsupported("compressed-tensors with several config groups or sparsity")
    weights = groups[0].get("weights") or {}
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    symmetric = bool(weights.get("symmetric", True))
    ignore = list(qc.get("ignore") or [])
    targets = list(groups[0].get("targets") or [])
    if fmt == "pack-quantized" and bits == 4 and kind == "int" and strategy in ("group", "channel"):
        group = int(weights.get("group_size") or -1) if strategy == "group" else -1
        quant = CheckpointQuantization("compressed-tensors", 4, group, symmetric, fmt, ignore)
        return _ct_extent(quant, targets)
    if (fmt in ("float-quantized", "int-quantized", "naive-quantized") and bits == 8
            and kind in ("float", "int") and strategy in ("channel", "tensor") and symmetric):
        # Dynamic per-token int8 activations run as W8A8; static activation scales (and fp8
        # activations) are not used: those activations stay in the model's dtype.
        a = groups[0].get("input_activations") or {}
        int8_activations = kind == "int" and a.get("num_bits") == 8 and a.get("type") == "int" \
            and a.get("strategy") == "token" and bool(a.get("dynamic")) \
            and a.get("symmetric", True)
        quant = CheckpointQuantization("compressed-tensors", 8, -1, True, kind, ignore,
                                       strategy == "tensor", int8_activations=int8_activations)
        return _ct_extent(quant, targets)
    raise unsupported(f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights "
                      f"({strategy}, symmetric {symmetric})")


def _ct_extent(quant: CheckpointQuantization, targets: list[str]) -> CheckpointQuantization:
    """Whether a compressed-tensors group reaches the LM head (not ignored) and the input
    embedding (targeted by class, "Embedding", or by a "re:" pattern its name matches)."""
    quant.lm_head = not quant.ignores("lm_head")
    embedding = "model.embed_tokens"
    quant.embeddings = not quant.ignores(embedding) and any(
        t == "Embedding" or (t.startswith("re:") and re.match(t[3:], embedding))
        for t in targets)
    return quant
