"""AWQ (`kvserve quantize --method awq`): its scales leave the float model unchanged (they move
between a projection and what feeds it, norms with a (1 + w) offset included), its search never
does worse than round to nearest on its own objective, and its output loads and generates as
transformers does on the weights the files mean."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.quantization.awq import awq_transform, fake_int4, search_clip, search_scale
from kvserve.quantization.quantize import quantize_checkpoint
from tests.models.test_parity import PROMPTS
from tests.models.test_quantized_models import (assert_same_generation, awq_dequantize,
                                                linear_modules, reference_model)

transformers = pytest.importorskip("transformers")
from kvserve.testing.checkpoints import make_checkpoint  # noqa: E402

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was "
        "the age of foolishness, it was the epoch of belief, it was the epoch of "
        "incredulity. ") * 40


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "calibration.txt"
    path.write_text(TEXT)
    return path


@pytest.mark.parametrize("arch, overrides", [
    ("LlamaForCausalLM", dict(num_key_value_heads=4)),  # MHA: o_proj is scaled against v_proj
    ("Qwen2ForCausalLM", {}),                            # GQA, q/k/v biases
    ("Gemma2ForCausalLM", {}),                           # (1 + w) norms, sandwich norms
])
def test_scales_leave_the_float_model_unchanged(tmp_path, calibration, arch, overrides):
    original = make_checkpoint(tmp_path / "plain", arch, **overrides)
    tensors = load_file(original / "model.safetensors")
    before = {k: v.clone() for k, v in tensors.items()}
    scaled = awq_transform(original, tensors, calibration, 32, num_samples=2, seq_len=64,
                           clip=False)
    layers = 2
    expected = 7 if arch == "LlamaForCausalLM" else 6  # q, k, v, (o), gate, up, down
    assert len(scaled) == expected * layers
    assert not torch.equal(tensors["model.layers.0.mlp.down_proj.weight"],
                           before["model.layers.0.mlp.down_proj.weight"])
    out = tmp_path / "scaled"
    shutil.copytree(original, out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    a = transformers.AutoModelForCausalLM.from_pretrained(original).eval()
    b = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(b(ids).logits, a(ids).logits, atol=1e-4, rtol=1e-4)


def test_search_is_no_worse_than_round_to_nearest():
    """Scale a = 0 and clip ratio 1 are round to nearest; the searches pick them or better, on
    inputs with a few large channels (where AWQ helps)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g)
    x[:, :4] *= 20
    w = torch.randn(64, 128, generator=g) / 12
    rtn = ((x @ fake_int4(w, 32).T - x @ w.T) ** 2).mean()
    s = search_scale(x, [w], 32)
    awq = ((x @ (fake_int4(w * s, 32) / s).T - x @ w.T) ** 2).mean()
    assert awq < 0.8 * rtn
    clipped = search_clip(x / s, w * s, 32)
    after_clip = ((x @ (fake_int4(clipped, 32) / s).T - x @ w.T) ** 2).mean()
    assert after_clip <= awq * 1.0001


def test_awq_checkpoint_generates_like_transformers(tmp_path, calibration):
    original = make_checkpoint(tmp_path / "plain", "LlamaForCausalLM")
    out = tmp_path / "awq"
    qc = quantize_checkpoint(original, out, "awq", 32, calibration)
    assert qc["quant_method"] == "awq" and qc["group_size"] == 32
    t = load_file(out / "model.safetensors")
    modules = linear_modules(t, ".qweight")
    weights = {m: awq_dequantize(t, m, 32) for m in modules}
    # The norms AWQ scaled are written plain; the reference reads them from the output directory.
    norms = {k: v for k, v in t.items() if "norm" in k}
    model = reference_model(original, weights)
    model.load_state_dict({**model.state_dict(), **norms})
    assert_same_generation(out, model)


def test_awq_needs_its_calibration_text(tmp_path):
    original = make_checkpoint(tmp_path / "plain", "LlamaForCausalLM")
    with pytest.raises(ValueError, match="--calibration FILE"):
        quantize_checkpoint(original, tmp_path / "awq", "awq", 32)
