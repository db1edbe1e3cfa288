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
from kvserve.loader.safetensors_loader import load_weights
from kvserve.quantization.quantize import quantize_checkpoint
from kvserve.testing import reference
from tests.models.test_llm_int8 import LOGIT_TOLERANCE, NUM_GREEDY_TOKENS
from tests.models.test_parity import PROMPTS, hf_greedy, kvserve_prompt_logits

transformers = pytest.importorskip("transformers")


class ReferenceW8A8Linear(torch.nn.Module):
    def __init__(self, weight, weight_scale, bias):
        super().__init__()
        self.weight, self.scales, self.bias = weight, weight_scale.view(-1).float(), bias

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        out = reference.llm_int8_linear(flat, self.weight, self.scales, 0.0, self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], -1)


def reference_model(original, quantized_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(original).eval()
    tensors = load_file(quantized_dir / "model.safetensors")
    replaced = 0
    for name, module in list(model.named_modules()):
        if f"{name}.weight_scale" not in tensors:
            continue
        parent_name, _, attr = name.rpartition(".")
        bias = module.bias.detach() if module.bias is not None else None
        setattr(model.get_submodule(parent_name), attr, ReferenceW8A8Linear(
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"], bias))
        replaced += 1
    assert replaced == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    return model


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
    assert loaded["layers.0.mlp.down_proj.outlier_threshold"].item() == 0.0
    ref = reference_model(original, tmp_path / "w8a8")
    for prompt in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
        err = ((kvserve_prompt_logits(llm, prompt) - want).abs().max() / want.abs().max()).item()
        assert err <= LOGIT_TOLERANCE, f"max relative logit error {err:.2e}"
    params = kvserve.SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NUM_GREEDY_TOKENS)


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
