"""W8A8 end to end: `kvserve quantize --method w8a8` writes a compressed-tensors int8 directory
whose config asks for dynamic per-token int8 activations, and kvserve running it (llm_int8_linear
with no outliers) matches transformers' model whose every quantized projection runs the reference
W8A8 product (kvserve.testing.reference.llm_int8_linear at threshold 0) on the int8 weight and
weight_scale read from the file here. A directory without the activations runs weight-only."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import kvserve
from kvserve import _C
from kvserve.config import load_checkpoint_info
from kvserve.loader.safetensors_loader import load_weights
from kvserve.quantization.quantize import quantize_checkpoint
from tests.models.test_llm_int8 import (ReferenceInt8Linear, assert_matches_reference,
                                        reference_model)
from tests.models.test_parity import PROMPTS, kvserve_prompt_logits

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM",
                                          "Gemma2ForCausalLM"])
def test_matches_the_reference_w8a8_product(checkpoint_factory, tmp_path, architecture):
    original = checkpoint_factory(architecture)
    qc = quantize_checkpoint(original, tmp_path / "w8a8", "w8a8")
    activations = qc["config_groups"]["group_0"]["input_activations"]
    assert (activations["num_bits"], activations["type"], activations["strategy"],
            activations["dynamic"]) == (8, "int", "token", True)
    llm = kvserve.LLM(tmp_path / "w8a8", dtype="float32")
    loaded = load_weights(tmp_path / "w8a8", llm.model.config, torch.float32)
    quantization = llm.model.config.quantization
    assert (quantization.scheme, quantization.outlier_threshold) == ("llm.int8", 0.0)
    assert loaded["layers.0.mlp.down_proj.qweight"].dtype == torch.int8
    # weight_scale [out, 1] per row; threshold 0: no outliers, every activation to int8.
    ref = reference_model(original, tmp_path / "w8a8", 0.0, "weight_scale",
                          lambda scale: scale.view(-1).float())
    assert sum(isinstance(m, ReferenceInt8Linear) for m in ref.modules()) == 2 * 7
    assert_matches_reference(llm, ref)


def test_activations_in_the_config_decide(checkpoint_factory, tmp_path):
    """The same int8 weights: W8A8 rounds activations (logits move); without input_activations,
    or with static ones (not used), they run weight-only, as `--method int8` writes."""
    original = checkpoint_factory("LlamaForCausalLM")
    quantize_checkpoint(original, tmp_path / "w8a8", "w8a8")
    quantize_checkpoint(original, tmp_path / "int8", "int8")
    t8, tw = (load_file(tmp_path / d / "model.safetensors") for d in ("int8", "w8a8"))
    assert t8.keys() == tw.keys() and all(torch.equal(t8[k], tw[k]) for k in t8)
    static = tmp_path / "static"
    static.mkdir()
    for f in (tmp_path / "w8a8").iterdir():
        (static / f.name).symlink_to(f)
    config = json.loads((tmp_path / "w8a8" / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(
        dynamic=False, strategy="tensor")
    (static / "config.json").unlink()
    (static / "config.json").write_text(json.dumps(config))
    logits = {name: kvserve_prompt_logits(kvserve.LLM(tmp_path / name, dtype="float32"),
                                          PROMPTS[2]) for name in ("int8", "w8a8", "static")}
    assert (logits["w8a8"] - logits["int8"]).abs().max() > 1e-4
    torch.testing.assert_close(logits["static"], logits["int8"])


def test_the_weights_must_be_in_the_scheme_the_config_names(checkpoint_factory, tmp_path):
    """The scheme is named by the checkpoint's config, not guessed from the tensors: int8
    weights under another scheme, or under none, are refused by name."""
    original = checkpoint_factory("LlamaForCausalLM")
    quantize_checkpoint(original, tmp_path / "w8a8", "w8a8")
    config = load_checkpoint_info(tmp_path / "w8a8").config
    loaded = load_weights(tmp_path / "w8a8", config, torch.float32)
    assert _C.create_causal_lm(config, loaded, 64) is not None
    for scheme, message in [("fp8", "the fp8 scheme stores Float8_e4m3fn"),
                            ("int4", "the int4 scheme stores Byte"),
                            ("none", "names no scheme")]:
        config.quantization.scheme = scheme
        with pytest.raises(ValueError, match=message):
            _C.create_causal_lm(config, loaded, 64)
    config.quantization.scheme = "int3"
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        config.validate()
