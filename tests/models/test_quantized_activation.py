"""quantized_activation="int8" end to end: int8 and int4 checkpoints written by `kvserve quantize`
against transformers running the weights the files mean, each quantized projection's input
rounded to int8 blocks by the reference's own rounding (a forward pre-hook): logits and greedy
tokens, up to the rounding flips that fp32 noise decides; the default resolves to int8 on the
CPU, and only for int8 / int4 weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import kvserve
from kvserve.quantization.quantize import quantize_checkpoint
from kvserve.testing import reference
from tests.models.test_parity import NUM_GREEDY_TOKENS, PROMPTS, kvserve_prompt_logits
from tests.models.test_quantized_models import (awq_dequantize, linear_modules, original,  # noqa: F401
                                                reference_model)

transformers = pytest.importorskip("transformers")

# A long prompt: past 32 tokens the projections round the input and take the GEMM.
LONG_PROMPT = [1] + [3 + (17 * i) % 300 for i in range(44)]


def rounded_inputs(model, group_sizes: dict[str, int]) -> None:
    """Rounds the input of each module named in group_sizes as quantize_input does."""
    for name, module in model.named_modules():
        if name in group_sizes:
            g = group_sizes[name]

            def hook(mod, args, g=g):
                x = args[0]
                flat = reference.round_input_to_int8_blocks(x.reshape(-1, x.shape[-1]), g)
                return (flat.reshape(x.shape).to(x.dtype),)

            module.register_forward_pre_hook(hook)


def meaning(out, method: str) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The dequantized weight of each quantized module and its group size."""
    t = load_file(out / "model.safetensors")
    if method == "int4":
        modules = linear_modules(t, ".qweight")
        return {m: awq_dequantize(t, m, 32) for m in modules}, {m: 32 for m in modules}
    modules = linear_modules(t, ".weight_scale")
    weights = {m: t[m + ".weight"].float() * t[m + ".weight_scale"].float() for m in modules}
    return weights, {m: weights[m].shape[1] for m in modules}  # one scale per row: g = k


def assert_rounded_computation(ours, want, exact) -> None:
    """ours against the reference with rounded inputs (want), [positions, vocab]. A rounding can
    flip: an input a hair from a rounding boundary (x * 127 / max|x| near k + 1/2) lands on either
    side depending on fp32 noise upstream, and moves that position's logits by up to a few
    hundredths (and, through attention, the positions after it). So every position is within a
    flip's reach, and ours is much nearer the rounded computation than the exact one (`exact`)."""
    error = (ours - want).abs()
    assert error.max() <= 0.05 * want.abs().max(), error.amax(dim=1)
    ratio = error.mean() / (ours - exact).abs().mean()
    assert ratio < 0.3, ratio


def assert_near_greedy(model, prompt: list[int], tokens: list[int]) -> None:
    """Each generated token is the reference's greedy choice, or within a rounding flip of its
    best logit (a near tie that the flip decided the other way), teacher-forced on ours."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert (chosen >= logits.amax(dim=1) - 0.05).all()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_int8_inputs_match_transformers_with_rounded_inputs(original, tmp_path,  # noqa: F811
                                                            method):
    out = tmp_path / method
    quantize_checkpoint(original, out, method, group_size=32)
    weights, groups = meaning(out, method)
    assert len(weights) == 2 * 7
    model = reference_model(original, weights)
    rounded_inputs(model, groups)
    llm = kvserve.LLM(out, dtype=torch.float32, quantized_activation="int8")
    exact = kvserve.LLM(out, dtype=torch.float32, quantized_activation="exact")
    assert llm.config.quantization.activation == "int8"
    for prompt in [*PROMPTS, LONG_PROMPT]:
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0]
        assert_rounded_computation(kvserve_prompt_logits(llm, prompt), want,
                                   kvserve_prompt_logits(exact, prompt))
    params = kvserve.SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    for prompt, got in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert_near_greedy(model, prompt, got.outputs[0].token_ids)


def test_default_is_int8_on_the_cpu_for_int8_and_int4_only(original, tmp_path):  # noqa: F811
    for method in ("int4", "fp8"):
        quantize_checkpoint(original, tmp_path / method, method, group_size=32)
    assert kvserve.LLM(tmp_path / "int4").config.quantization.activation == "int8"
    assert kvserve.LLM(tmp_path / "fp8").config.quantization.activation == "exact"
    assert kvserve.LLM(original).config.quantization.activation == "exact"
    with pytest.raises(ValueError, match="quantized_activation must be one of"):
        kvserve.LLM(tmp_path / "int4", quantized_activation="int4")
