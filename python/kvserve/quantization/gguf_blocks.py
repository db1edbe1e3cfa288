"""llama.cpp's GGUF weight blocks as kvserve's quantized weights, exactly.

Every block type read here stores, per sub-block of 16 or 32 inputs, integers q and an affine map
`value = a * q + b`, so each maps onto `QuantizedWeight` with no loss of what the file means.
The K-quants' sub-block scales and minimums are small integers under fp16 factors per
super-block of 256 inputs, and are held so, as two-level scales (`super_scales`,
`super_mins`; kvserve.quantization.weights), which the CPU's integer kernels widen a step at
a time. A fused projection whose parts differ in type (a Q4_K_M file's q and k in Q4_K, v in
Q6_K) is held in parts, each in its own layout (the loader's `QuantizedWeight.runs`):

| GGUF type | block | kvserve weight |
|---|---|---|
| Q8_0 | 32 int8 and an fp16 scale d | int8, groups of 32, scale d (fp16) |
| Q4_0 | 32 nibbles (byte j: inputs j, j + 16) and d; value d * (q - 8) | int4 (the same bytes), groups of 32, zero 8 (fp16 scales and zeros) |
| Q4_1 | 32 nibbles, d and a minimum m; value d * q + m | int4, groups of 32, zero -m / d (fp32) |
| Q4_K | 256 inputs: 8 sub-blocks of 32 nibbles with 6-bit scales sc and minimums m under fp16 d, dmin; value d * sc * q - dmin * m | int4, groups of 32, two-level: scales sc, zeros m, super_scales d, super_mins dmin |
| Q5_K | as Q4_K with a fifth bit per input (q in 0..31) | int8 (q as is), groups of 32, two-level as Q4_K |
| Q6_K | 256 inputs: 16 sub-blocks of 16 six-bit q with int8 scales sc under fp16 d; value d * sc * (q - 32) | int8 (q - 32), groups of 16, two-level: scales sc, super_scales d |

Bits a weight, file against kvserve: Q4_K 4.5 against 4.625 (the 6-bit scales and minimums
take a byte each), Q5_K 5.5 against 8.625 and Q6_K 6.56 against 8.56 (kvserve has no 5- or
6-bit layout); the others keep theirs. Q8_0 and Q4_0 keep their fp16 scales as they are
(Q4_0's zero 8, written out per block here, is kept once by the engine's CPU layers: 18 bytes a
block, as in the file); Q4_1's derived zero (-m / d) is not an fp16 number and stays fp32.
`QuantizedWeight.one_level()` turns the two-level ones into fp32 scales and zero points (what
CUDA takes). The layouts are ggml's (ggml-common.h: block_q4_K and friends).
"""

from __future__ import annotations


import numpy as np
import torch

from kvserve.quantization.weights import (QuantizedWeight, affine_groups, pack_int4,
                                           unpack_int4)

QK_K = 256  # inputs of a K-quant super-block
# name -> (inputs per block, bytes per block)
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (QK_K, 144),
          "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210)}


def _blocks(data: np.ndarray, kind: str, n: int, k: int) -> torch.Tensor:
    """The raw bytes [n, k / block, bytes per block] of a weight [n, k]."""
    size, nbytes = BLOCKS[kind]
    if k % size:
        raise ValueError(f"{kind} needs in_features that are a multiple of {size}, got {k}")
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, k // size, nbytes)
    return torch.from_numpy(raw.copy())


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """fp16 numbers stored as pairs of bytes [..., 2] -> fp32 [...]."""
    return _half(raw).float()


def _half(raw: torch.Tensor) -> torch.Tensor:
    """fp16 numbers stored as pairs of bytes [..., 2] -> fp16 [...], as they are."""
    return raw.contiguous().view(torch.float16).squeeze(-1).contiguous()


def _k_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and minimums of a Q4_K / Q5_K super-block's 12 bytes [..., 12] ->
    ([..., 8], [..., 8]): sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    (minimums); sub-blocks 4-7 in the nibbles of bytes 8-11, their top 2 bits in the top bits of
    bytes 0-3 (scales) and 4-7 (minimums)."""
    s = raw.long()
    low = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mins = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return low.float(), mins.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A Q4_K / Q5_K super-block's 128 bytes [..., 128] -> the low 4 bits of its 256 inputs
    [..., 8, 32]: each 32 bytes hold sub-block 2c in their low nibbles, 2c + 1 in their high."""
    pairs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([pairs & 15, pairs >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)


def to_quantized(data: np.ndarray, kind: str, n: int, k: int) -> QuantizedWeight:
    """A GGUF tensor of type `kind` holding a weight [n, k] (data: its bytes, as the gguf
    package's reader gives them) as the QuantizedWeight that means the same numbers."""
    b = _blocks(data, kind, n, k)
    if kind == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return QuantizedWeight(q, _half(b[..., 0:2]), None, 32)
    if kind == "Q4_0":
        d = _half(b[..., 0:2])
        return QuantizedWeight(b[..., 2:].reshape(n, k // 2).contiguous(), d,
                               torch.full_like(d, 8.0), 32)
    if kind == "Q4_1":
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        q = unpack_int4(b[..., 4:].reshape(n, k // 2).contiguous()).view(n, k // 32, 32)
        q, scale, zero = affine_groups(q.float(), d, m)
        return QuantizedWeight(pack_int4(q.reshape(n, k).to(torch.uint8)), scale, zero, 32)
    if kind in ("Q4_K", "Q5_K"):
        sc, mins = _k_scales(b[..., 4:16])
        if kind == "Q4_K":
            q = pack_int4(_k_nibbles(b[..., 16:144]).reshape(n, k))
        else:  # the fifth bit of input i of sub-block j: bit j of qh[i]
            qh = b[..., 16:48].long()
            high = torch.stack([(qh >> j) & 1 for j in range(8)], dim=-2)
            q = (_k_nibbles(b[..., 48:176]).long() | (high << 4)).reshape(n, k).to(torch.int8)
        return QuantizedWeight(q, sc.reshape(n, k // 32).to(torch.int8),
                               mins.reshape(n, k // 32).to(torch.int8), 32,
                               super_scales=_half(b[..., 0:2]), super_mins=_half(b[..., 2:4]))
    if kind == "Q6_K":
        ql, qh = b[..., 0:128].long(), b[..., 128:192].long()
        sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, k // 16)
        # Each half of 128 inputs: 64 bytes of low nibbles (inputs 0-63 low, 64-127 high) and 32
        # bytes of 2-bit pairs (inputs i, i + 32, i + 64, i + 96 in bits 0-1, 2-3, 4-5, 6-7).
        low = ql.reshape(n, k // QK_K, 2, 1, 64)
        low = torch.cat([low & 15, low >> 4], dim=-2).reshape(n, k // QK_K, 2, 4, 32)
        high = qh.reshape(n, k // QK_K, 2, 1, 32)
        high = torch.cat([(high >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)
        q = ((low | (high << 4)) - 32).reshape(n, k)
        return QuantizedWeight(q.to(torch.int8), sc.contiguous(), None, 16,
                               super_scales=_half(b[..., 208:210]))
    raise ValueError(f"GGUF block type {kind} is not one kvserve converts")
