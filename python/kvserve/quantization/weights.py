"""Quantized weights as the quantized_linear op reads them, and round-to-nearest quantizers.

A `QuantizedWeight` holds q packed as the op's contract says (csrc/kernels/linear/
quantized_linear.h) with scales and zeros (fp32, or both fp16 as AWQ, GPTQ and GGUF files
store them), one per output row and group of `group_size` inputs:

    w[o, i] = (q[o, i] - zeros[o, i // group_size]) * scales[o, i // group_size]

- int8: q int8 [n, k], symmetric (no zeros), one scale per row (`group_size` = k) by default;
- int4: q uint8 [n, k / 2], two per byte in chunks of 32 inputs (byte j holds input j in its low
  nibble and input j + 16 in its high one), asymmetric: zeros in 0..15, group-wise;
- fp8: q float8_e4m3fn [n, k], one scale per row (or one for the tensor, repeated per row);
- LLM.int8(): int8 with one scale per row and an `outlier_threshold` (>= 0): the layer then runs
  the llm_int8_linear op (activation columns with an |x| at or over the threshold in floating
  point, the rest rounded to int8 per token; csrc/kernels/linear/llm_int8_linear.h);
- two-level scales (GGUF's K-quants, kvserve.quantization.gguf_blocks): int8 or int4 q with
  int8 `scales` (and `zeros`, here integer minimums) per group under fp16 `super_scales` (and
  `super_mins`) per super-block of groups:

      w[o, i] = q[o, i] * super_scales[o, j // S] * scales[o, j] - super_mins[o, j // S] * zeros[o, j]

  (j = i // group_size, S groups a super-block). The CPU kernels take it as it is; `one_level()`
  gives the same numbers in the one-level form (fp32), which CUDA takes.

Checkpoint formats (AWQ, GPTQ, compressed-tensors) are converted to and from this in
`kvserve.quantization.formats`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    outlier_threshold: float | None = None  # LLM.int8(): int8 x int8 with outliers in float
    super_scales: torch.Tensor | None = None  # two-level scales: [n, supers] (module docstring)
    super_mins: torch.Tensor | None = None  # with zeros under two-level scales

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        n, packed = self.qweight.shape
        return n, packed * 2 if self.qweight.dtype == torch.uint8 else packed

    @property
    def super_group(self) -> int:
        """Groups a super-block holds (two-level scales), else 0."""
        return 0 if self.super_scales is None else self.scales.shape[1] // self.super_scales.shape[1]

    def two_level_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Two-level scales as each group's fp32 scale and minimum ([n, groups] each; the minimum
        None without zeros): w = q * scale - minimum."""
        s = self.super_group
        scale = self.super_scales.float().repeat_interleave(s, dim=1) * self.scales.float()
        if self.zeros is None:
            return scale, None
        return scale, self.super_mins.float().repeat_interleave(s, dim=1) * self.zeros.float()

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [n, k] this stands for."""
        q = unpack_int4(self.qweight) if self.qweight.dtype == torch.uint8 else self.qweight
        q = q.float()
        n, k = q.shape
        groups = k // self.group_size
        q = q.view(n, groups, self.group_size)
        if self.super_scales is not None:
            scale, minimum = self.two_level_params()
            w = q * scale[:, :, None]
            return (w if minimum is None else w - minimum[:, :, None]).view(n, k)
        if self.zeros is not None:  # [n, groups], or [1]: one for all
            q = q - (self.zeros.view(n, groups, 1) if self.zeros.dim() == 2 else self.zeros)
        return (q * self.scales.view(n, groups, 1)).view(n, k)

    def one_level(self) -> QuantizedWeight:
        """The same numbers with one level of fp32 scales and zero points (as CUDA takes them):
        scale = super_scale * scale, zero = minimum / scale; a group whose scale is 0 but whose
        minimum is not (every input the same value) becomes q = 1, zero 0, scale = its value."""
        if self.super_scales is None:
            return self
        scale, minimum = self.two_level_params()
        if minimum is None:
            return QuantizedWeight(self.qweight, scale.contiguous(), None, self.group_size)
        int4 = self.qweight.dtype == torch.uint8
        q = (unpack_int4(self.qweight) if int4 else self.qweight).float()
        n, k = q.shape
        q, scale, zero = affine_groups(q.view(n, -1, self.group_size), scale, -minimum)
        q = q.reshape(n, k)
        return QuantizedWeight(pack_int4(q.to(torch.uint8)) if int4 else q.to(torch.int8),
                               scale.contiguous(), zero.contiguous(), self.group_size)

    def take_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        """Output rows `rows` (a permutation or selection), with their scales and zeros."""
        def take(t):
            return None if t is None else t[rows].contiguous()
        zeros = self.zeros if self.zeros is not None and self.zeros.dim() == 1 else take(self.zeros)
        return QuantizedWeight(take(self.qweight), take(self.scales), zeros, self.group_size,
                               self.outlier_threshold, take(self.super_scales),
                               take(self.super_mins))

    def padded(self, rows: int) -> QuantizedWeight:
        """The weight with `rows` output rows of zeros below (q, scales and zeros 0): a
        vocabulary padded to whole tensor-parallel shards."""
        if rows == 0:
            return self

        def pad(t):
            if t is None or (t is self.zeros and t.dim() == 1):
                return t
            return torch.cat([t, t.new_zeros(rows, *t.shape[1:])])
        return QuantizedWeight(pad(self.qweight), pad(self.scales), pad(self.zeros),
                               self.group_size, self.outlier_threshold, pad(self.super_scales),
                               pad(self.super_mins))

    def narrow(self, dim: int, start: int, length: int, name: str = "the weight"
               ) -> QuantizedWeight:
        """Output rows (dim 0) or input columns (dim 1) [start, start + length) of the weight,
        with their scales and zeros: a tensor-parallel rank's part. Columns of an int4 weight
        must be whole chunks of 32 and, with more than one group a row, whole groups; a weight
        with one group a row keeps it (its group is then the part's columns). ValueError naming
        `name` otherwise."""
        n, k = self.shape
        if dim == 0:
            return self.take_rows(torch.arange(start, start + length))
        int4 = self.qweight.dtype == torch.uint8
        whole_rows = self.group_size == k
        unit = self.group_size if not whole_rows else 1
        if int4:
            unit = unit * 32 // math.gcd(unit, 32)
        two_level = self.super_scales is not None
        if two_level:  # whole super-blocks
            unit = self.group_size * self.super_group
        if start % unit or length % unit:
            what = "chunks of 32" if int4 and whole_rows else f"groups of {self.group_size}"
            if int4 and not whole_rows and self.group_size % 32:
                what += " and chunks of 32"
            if two_level:
                what = f"super-blocks of {unit}"
            raise ValueError(f"{name}: a tensor-parallel rank's {length} inputs (from {start}) "
                             f"are not whole {what}; choose a tensor_parallel_size that splits "
                             f"its {k} inputs into such parts")
        columns = (slice(start // 2, (start + length) // 2) if int4
                   else slice(start, start + length))
        groups = (slice(None) if whole_rows
                  else slice(start // self.group_size, (start + length) // self.group_size))
        zeros = (self.zeros if self.zeros is None or self.zeros.dim() == 1
                 else self.zeros[:, groups].contiguous())
        supers = (slice(start // unit, (start + length) // unit) if two_level else None)
        return QuantizedWeight(self.qweight[:, columns].contiguous(),
                               self.scales[:, groups].contiguous(), zeros,
                               length if whole_rows else self.group_size, self.outlier_threshold,
                               *(None if t is None else t[:, supers].contiguous()
                                 for t in (self.super_scales, self.super_mins)))

    @property
    def layout(self) -> tuple:
        """What weights must share to be stacked into one (concat): storage dtype, group size,
        zeros or none, outlier threshold, groups a super-block."""
        return (self.qweight.dtype, self.group_size, self.zeros is None, self.outlier_threshold,
                self.super_group)

    @staticmethod
    def runs(parts: list[QuantizedWeight]) -> list[list[QuantizedWeight]]:
        """parts in runs of consecutive weights of one layout (a GGUF file's q and k in Q4_K,
        then v in Q6_K): each run stacks (concat); a fused projection of several runs is held
        in parts (the C++ Linear's `<name>.parts.<i>`)."""
        out: list[list[QuantizedWeight]] = []
        for p in parts:
            if out and out[-1][-1].layout == p.layout:
                out[-1].append(p)
            else:
                out.append([p])
        return out

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The weights stacked along the output dimension (q/k/v into qkv, gate/up into gate_up)."""
        group_sizes = {p.group_size for p in parts}
        if len({p.layout for p in parts}) != 1:
            raise ValueError("cannot fuse quantized weights of different formats or group sizes")
        zeros = None if parts[0].zeros is None else torch.cat(  # a single zero each row's
            [p.zeros.expand_as(p.scales) if p.zeros.dim() == 1 else p.zeros for p in parts])

        def cat(name):
            got = [getattr(p, name) for p in parts]
            return None if got[0] is None else torch.cat(got)
        return QuantizedWeight(torch.cat([p.qweight for p in parts]),
                               torch.cat([p.scales for p in parts]), zeros, group_sizes.pop(),
                               parts[0].outlier_threshold, cat("super_scales"), cat("super_mins"))


def affine_groups(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """value = scale * q + offset per group (q [..., size], scale and offset [...]) as
    (q, scale, zero) with value = (q - zero) * scale; a group with scale 0 becomes q = 1, zero 0,
    scale = offset."""
    flat = scale == 0
    zero = torch.where(flat, torch.zeros_like(scale), -offset / torch.where(flat, 1.0, scale))
    q = torch.where(flat[..., None], torch.ones_like(q), q)
    return q, torch.where(flat, offset, scale), zero


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [n, k] with values in 0..15 (k a multiple of 32) -> uint8 [n, k / 2] in chunks of 32."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"int4 weights need in_features that is a multiple of 32, got {k}")
    chunks = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k / 2] in chunks of 32 -> uint8 [n, k] with values in 0..15."""
    n, half = packed.shape
    chunks = packed.view(n, half // 16, 1, 16)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(n, half * 2)


def _check_groups(k: int, group_size: int) -> int:
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size must divide in_features ({k}), got {group_size}")
    return k // group_size


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8, round to nearest: scale = max |w| / 127 per row (or per group)."""
    n, k = w.shape
    group_size = group_size or k
    groups = _check_groups(k, group_size)
    wg = w.float().view(n, groups, group_size)
    scales = (wg.abs().amax(dim=2) / 127.0).clamp(min=1e-10)
    q = torch.round(wg / scales[:, :, None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return QuantizedWeight(q, scales.contiguous(), None, group_size)


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> QuantizedWeight:
    """Asymmetric int4 with zero points, round to nearest, per group of inputs (AWQ's and GPTQ's
    grid): scale = (max - min) / 15, zero = round(-min / scale) in 0..15."""
    n, k = w.shape
    groups = _check_groups(k, group_size)
    if group_size % 32:
        raise ValueError(f"int4 group_size must be a multiple of 32, got {group_size}")
    wg = w.float().view(n, groups, group_size)
    high, low = wg.amax(dim=2), wg.amin(dim=2)
    scales = ((high - low) / 15.0).clamp(min=1e-10)
    zeros = torch.round(-low / scales).clamp(0, 15)
    q = (torch.round(wg / scales[:, :, None]) + zeros[:, :, None]).clamp(0, 15).view(n, k)
    return QuantizedWeight(pack_int4(q), scales.contiguous(), zeros.contiguous(), group_size)


def quantize_fp8(w: torch.Tensor, per_channel: bool = True) -> QuantizedWeight:
    """float8_e4m3fn with scale = max |w| / 448 per row (per_channel) or for the whole tensor."""
    n, k = w.shape
    amax = w.float().abs().amax(dim=1, keepdim=True) if per_channel else w.float().abs().amax()
    scales = (amax / FP8_MAX).clamp(min=1e-12).expand(n, 1).contiguous()
    q = (w.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(q, scales, None, k)
