"""LLM.int8() end to end: `kvserve quantize --method llm.int8` writes a bitsandbytes 8-bit
directory (int8 `weight`, `SCB`, `weight_format`, load_in_8bit config), and kvserve running it
matches transformers' model whose every quantized projection runs the reference decomposition
(kvserve.testing.reference.llm_int8_linear) on the int8 weight and SCB / 127 read from the file
here — with the paper's threshold 6.0 and with a low one that makes many columns outliers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import kvserve
from kvserve.quantization.quantize import quantize_checkpoint
from kvserve.testing import reference
from tests.models.test_parity import PROMPTS, hf_greedy, kvserve_prompt_logits

transformers = pytest.importorskip("transformers")

# Relative to the largest |logit|: both sides round the same activations to int8, but a value
# that lands on a rounding boundary in one fp32 summation order may not in the other.
LOGIT_TOLERANCE = 2e-3
NUM_GREEDY_TOKENS = 16


class ReferenceInt8Linear(torch.nn.Module):
    """A projection on the reference decomposition (threshold 0: W8A8)."""

    def __init__(self, weight, scales, bias, threshold):
        super().__init__()
        self.weight, self.scales, self.bias, self.threshold = weight, scales, bias, threshold

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        out = reference.llm_int8_linear(flat, self.weight, self.scales, self.threshold, self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], -1)


def reference_model(original, quantized_dir, threshold, scale: str = "SCB",
                    to_scales=lambda scb: scb / 127.0):
    """transformers' model of `original` with every projection the file quantized (it has
    `<name>.<scale>`) on the reference decomposition of the file's int8 weight and scales."""
    model = transformers.AutoModelForCausalLM.from_pretrained(original).eval()
    tensors = load_file(quantized_dir / "model.safetensors")
    replaced = 0
    for name, module in list(model.named_modules()):
        if f"{name}.{scale}" not in tensors:
            continue
        parent_name, _, attr = name.rpartition(".")
        bias = module.bias.detach() if module.bias is not None else None
        setattr(model.get_submodule(parent_name), attr, ReferenceInt8Linear(
            tensors[f"{name}.weight"], to_scales(tensors[f"{name}.{scale}"]), bias, threshold))
        replaced += 1
    assert replaced > 0
    return model


def assert_matches_reference(llm, ref) -> None:
    """Prompt logits within LOGIT_TOLERANCE of the largest and NUM_GREEDY_TOKENS greedy tokens
    equal, on every test prompt but at most one: there, from one position on, an activation that
    sits on an int8 rounding boundary may round the other way in one summation order (a change of
    transformers' fp32 arithmetic between versions did that once), and every later position
    differs with it. Positions before that one must still match."""
    flipped = []
    for prompt in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
        ours = kvserve_prompt_logits(llm, prompt)
        err = (ours - want).abs().max(dim=-1).values / want.abs().max()
        if (err > LOGIT_TOLERANCE).any():
            first = int((err > LOGIT_TOLERANCE).nonzero()[0])
            assert first >= len(prompt) // 2, f"relative logit error {err.max():.2e} at {first}"
            flipped.append(prompt)
    assert len(flipped) <= 1, f"{len(flipped)} prompts differ beyond a rounding flip"
    params = kvserve.SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        if prompt not in flipped:
            assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NUM_GREEDY_TOKENS)


@pytest.fixture(scope="module")
def quantized(checkpoint_factory, tmp_path_factory):
    def make(architecture, threshold=None):
        original = checkpoint_factory(architecture)
        out = tmp_path_factory.mktemp(f"{architecture}-llm-int8")
        qc = quantize_checkpoint(original, out, "llm.int8")
        assert qc["quant_method"] == "bitsandbytes" and qc["load_in_8bit"]
        if threshold is not None:
            config = json.loads((out / "config.json").read_text())
            config["quantization_config"]["llm_int8_threshold"] = threshold
            (out / "config.json").write_text(json.dumps(config))
        return original, out, threshold or 6.0
    return make


@pytest.mark.parametrize("threshold", [None, 1.5])
@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM",
                                          "Gemma2ForCausalLM"])
def test_matches_the_reference_decomposition(quantized, architecture, threshold):
    original, path, threshold = quantized(architecture, threshold)
    assert_matches_reference(kvserve.LLM(path, dtype="float32"),
                             reference_model(original, path, threshold))


def test_low_threshold_changes_the_result(quantized):
    """The outlier path is taken: a low threshold moves the logits (more columns in float)."""
    _, paper, _ = quantized("LlamaForCausalLM")
    _, low, _ = quantized("LlamaForCausalLM", 0.5)
    a = kvserve_prompt_logits(kvserve.LLM(paper, dtype="float32"), PROMPTS[2])
    b = kvserve_prompt_logits(kvserve.LLM(low, dtype="float32"), PROMPTS[2])
    assert (a - b).abs().max() > 1e-4


def test_file_layout_is_bitsandbytes(quantized):
    original, path, _ = quantized("LlamaForCausalLM")
    tensors = load_file(path / "model.safetensors")
    plain = load_file(original / "model.safetensors")
    name = "model.layers.0.mlp.down_proj"
    q, scb = tensors[f"{name}.weight"], tensors[f"{name}.SCB"]
    assert q.dtype == torch.int8 and scb.dtype == torch.float32 and scb.shape == (q.shape[0],)
    assert tensors[f"{name}.weight_format"].item() == 0
    w = plain[f"{name}.weight"].float()
    torch.testing.assert_close(scb, w.abs().amax(1))  # SCB is the row's max |w|
    assert torch.equal(q, torch.round(w * 127 / scb[:, None]).to(torch.int8))
    assert "lm_head.SCB" not in tensors and "model.embed_tokens.SCB" not in tensors


@pytest.mark.parametrize("change, message", [
    ({"load_in_8bit": False, "load_in_4bit": True}, "4-bit NF4"),
    ({"llm_int8_has_fp16_weight": True}, "fp16 weights kept for training"),
])
def test_unsupported_bitsandbytes_configs(quantized, tmp_path, change, message):
    _, path, _ = quantized("LlamaForCausalLM")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(change)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        kvserve.LLM(bad)
