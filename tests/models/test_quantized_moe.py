"""Quantized mixture-of-experts checkpoints end to end: `kvserve quantize` (int8 / fp8 as
compressed-tensors, int4 in AWQ's gemm layout) of Mixtral, Qwen3-MoE, DeepSeek-V2 and
Nemotron-H (experts without a gate) keeps the
routed experts quantized (fused_moe_quantized runs them), and generation matches transformers
running the same model on the weights the files mean (written out as a plain checkpoint)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvserve
from kvserve.loader.safetensors_loader import load_weights
from kvserve.quantization.quantize import quantize_checkpoint
from tests.models.test_quantized_models import assert_same_generation, awq_dequantize

transformers = pytest.importorskip("transformers")
from kvserve.testing.checkpoints import make_checkpoint  # noqa: E402

GROUP = 32
# Expert sizes that int4 groups of 32 divide (else quantize keeps them plain).
SHAPES = {"MixtralForCausalLM": {}, "Qwen3MoeForCausalLM": dict(moe_intermediate_size=64),
          "DeepseekV2ForCausalLM": {},
          # Nemotron 3's experts without a gate (relu2), beside its mixers and attention
          "NemotronHForCausalLM": dict(
              layers_block_type=["linear_attention", "moe", "full_attention", "moe", "mlp"],
              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
              moe_shared_expert_intermediate_size=64, intermediate_size=64)}


def meaning(quantized, method: str) -> dict[str, torch.Tensor]:
    """The fp32 weight each quantized module of the directory stands for, by module name."""
    t = load_file(quantized / "model.safetensors")
    if method == "llm.int8":  # bitsandbytes: w = weight * SCB / 127
        return {name.removesuffix(".SCB"): t[name.replace("SCB", "weight")].float()
                * (t[name] / 127.0)[:, None] for name in t if name.endswith(".SCB")}
    if method == "int4":
        return {name.removesuffix(".qweight"): awq_dequantize(t, name.removesuffix(".qweight"),
                                                              GROUP)
                for name in t if name.endswith(".qweight")}
    return {name.removesuffix(".weight_scale"): t[name.replace("weight_scale", "weight")].float()
            * t[name].float() for name in t if name.endswith(".weight_scale")}


def dequantized_checkpoint(original, quantized, method: str, out):
    """original's directory with every quantized module's weight replaced by its meaning."""
    shutil.copytree(original, out)
    t = load_file(original / "model.safetensors")
    weights = meaning(quantized, method)
    for module, w in weights.items():
        assert t[module + ".weight"].shape == w.shape, module
        t[module + ".weight"] = w.to(t[module + ".weight"].dtype)
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    return out, weights


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("architecture", sorted(SHAPES))
def test_quantized_experts_generate_like_transformers_on_the_meaning(architecture, method,
                                                                     tmp_path):
    original = make_checkpoint(tmp_path / "plain", architecture, **SHAPES[architecture])
    quantized = tmp_path / method
    quantize_checkpoint(original, quantized, method, group_size=GROUP)
    reference_dir, weights = dequantized_checkpoint(original, quantized, method, tmp_path / "ref")
    assert any(".experts.0." in m for m in weights)

    llm = kvserve.LLM(quantized, dtype=torch.float32, quantized_activation="exact")
    loaded = load_weights(quantized, llm.model.config, torch.float32)
    experts = [name for name in loaded if ".experts." in name]
    assert experts and all(name.rsplit(".", 1)[1] in ("qweight", "scales", "zeros")
                           for name in experts)
    model = transformers.AutoModelForCausalLM.from_pretrained(reference_dir).eval()
    assert_same_generation(quantized, model)
    plain = kvserve.LLM(original, dtype=torch.float32).model.weight_bytes
    assert llm.model.weight_bytes < plain * 0.6  # fp32 embeddings and LM head stay as they are


def test_llm_int8_experts_run_weight_only(tmp_path):
    """LLM.int8() (bitsandbytes 8-bit) experts run weight-only int8 (fused_moe_quantized) while
    the attention runs LLM.int8(): against transformers with the experts' weights the file means
    and every attention projection on the reference decomposition."""
    from tests.models.test_llm_int8 import assert_matches_reference
    from tests.models.test_llm_int8 import reference_model as llm_int8_reference

    original = make_checkpoint(tmp_path / "plain", "MixtralForCausalLM")
    quantized = tmp_path / "llm.int8"
    quantize_checkpoint(original, quantized, "llm.int8")
    llm = kvserve.LLM(quantized, dtype=torch.float32)
    loaded = load_weights(quantized, llm.model.config, torch.float32)
    expert = "layers.0.mlp.experts.0.gate_up_proj."
    assert loaded[expert + "qweight"].dtype == torch.int8
    quantization = llm.model.config.quantization  # named once, for the whole checkpoint
    assert (quantization.scheme, quantization.outlier_threshold) == ("llm.int8", 6.0)
    assert not any(name.endswith("outlier_threshold") for name in loaded)

    reference_dir, _ = dequantized_checkpoint(original, quantized, "llm.int8", tmp_path / "ref")
    assert_matches_reference(llm, llm_int8_reference(reference_dir, quantized, 6.0))
