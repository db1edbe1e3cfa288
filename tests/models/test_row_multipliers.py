"""Row multipliers folded into a projection's weights at load (config_families.scale_rows, as
FalconH1's multipliers are): a fused projection held in parts (QuantizedWeight.runs) takes each
part's rows of them, and its bias the whole projection's."""

import torch

from kvserve.config_families import scale_rows
from kvserve.quantization import quantize_int4, quantize_int8
from kvserve.quantization.weights import QuantizedWeight


def test_row_multipliers_fold_into_each_part():
    g = torch.Generator().manual_seed(0)
    parts = [quantize_int4(torch.randn(64, 96, generator=g), 32),
             quantize_int8(torch.randn(32, 96, generator=g), 32)]
    w = {"m.bias": torch.randn(96, generator=g)}
    for i, q in enumerate(parts):
        for field in ("qweight", "scales", "zeros"):
            if getattr(q, field) is not None:
                w[f"m.parts.{i}.{field}"] = getattr(q, field)
    rows, bias_rows = torch.rand(96, generator=g) + 0.5, torch.rand(96, generator=g)
    bias = w["m.bias"].clone()
    scale_rows(w, "m", rows, bias_rows)
    for i, (q, part_rows) in enumerate(zip(parts, rows.split([64, 32]))):
        got = QuantizedWeight(w[f"m.parts.{i}.qweight"], w[f"m.parts.{i}.scales"],
                              w.get(f"m.parts.{i}.zeros"), 32)
        torch.testing.assert_close(got.dequantize(), q.dequantize() * part_rows[:, None])
    torch.testing.assert_close(w["m.bias"], bias * bias_rows)
    assert "m.parts.0.bias" not in w and "m.qweight" not in w
