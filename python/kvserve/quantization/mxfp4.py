"""MXFP4 (OCP Microscaling FP4), the format of gpt-oss's released expert weights, read by
dequantizing at load.

A tensor [..., rows, cols] is stored as `<name>_blocks` uint8 [..., rows, cols / 32, 16] (two
E2M1 values a byte, the low nibble first) and `<name>_scales` uint8 [..., rows, cols / 32] (each
block of 32 values' power of two, E8M0, biased by 127). kvserve dequantizes the experts to the
model's dtype as it loads them, one expert at a time: every MXFP4 value times a power of two is
exact in bf16, and the memory cost is that of a bf16 checkpoint: 16 bits a value against
MXFP4's 4.25, about 3.8 times the experts' bytes in the file. (Open Compute Project,
"OCP Microscaling Formats (MX) Specification v1.0", 2023.)
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale

# The E2M1 values of the 16 codes: sign bit, then two exponent bits and one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4(hf: dict) -> bool:
    """Whether a config.json's quantization_config is MXFP4 (gpt-oss's experts)."""
    qc = hf.get("quantization_config")
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "mxfp4"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> `dtype` [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales "
                         f"{list(scales.shape)} (blocks [..., G, 16], scales [..., G])")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [..., G, 32]: low nibble, high nibble, ...
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., cols] (cols a multiple of 32) -> (blocks, scales) as dequantize reads them:
    each block's scale the power of two that brings its largest magnitude to at most 6, each
    value rounded to the nearest E2M1 code (tests and small checkpoints write MXFP4 with it)."""
    w = weight.float().unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    top = w.abs().amax(-1).clamp_min(2.0 ** -126)
    exponents = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127)
    scaled = w / torch.exp2(exponents).unsqueeze(-1)
    lut = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(-1)  # nearest magnitude
    codes = codes + 8 * (scaled < 0)
    codes = codes.to(torch.uint8).unflatten(-1, (BLOCK // 2, 2))
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks.contiguous(), (exponents + 127).to(torch.uint8)
