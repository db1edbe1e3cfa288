"""Weight quantization: the formats the quantized_linear op reads (`weights`) and round-to-nearest
quantizers for int8, int4 and fp8."""

from kvserve.quantization.weights import (
    QuantizedWeight,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)

__all__ = ["QuantizedWeight", "pack_int4", "unpack_int4", "quantize_int8", "quantize_int4",
           "quantize_fp8"]
