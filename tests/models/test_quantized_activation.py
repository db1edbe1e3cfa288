"""quantized_activation="int8" end to end: int8 and int4 checkpoints written by `kvserve quantize`
against transformers running the weights the files mean, each quantized projection's input
rounded to int8 blocks by the reference's own rounding (a forward pre-hook): logits and greedy
tokens, up to the rounding flips that fp32 noise decides; the default resolves to int8 on the
CPU, and only for int8 / int4 weights; what shares a step moves int8 inputs' logprobs by at most
such a flip, and the exact path's not at all."""

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


def run_with_logprobs(engine, requests) -> dict[str, tuple[list[int], list[float]]]:
    """Each (prompt, max_tokens, arrival step) run greedily on engine: tokens and their
    logprobs by request index."""
    pending = sorted((arrival, i) for i, (_, _, arrival) in enumerate(requests))
    out, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            prompt, n, _ = requests[i]
            engine.add_request(str(i), prompt, kvserve.SamplingParams(
                temperature=0, max_tokens=n, ignore_eos=True, logprobs=0))
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (c.token_ids, [lp.logprob for lp in c.logprobs])
        step += 1
    return out


@pytest.mark.parametrize("activation", ["exact", "int8"])
def test_what_shares_a_step_moves_int8_inputs_only_by_a_rounding(original, tmp_path,  # noqa: F811
                                                                 activation):
    """Each request alone, then all of them arriving over time with prefills cut into 16-token
    chunks. A token's int8-input product is summed in another order when another number of
    tokens shares the call (and by the AMX tiles from 16 tokens), and the next layer's rounding
    can turn that last bit into a whole step of an input: the logprobs move by at most a rounding
    flip's reach (docs/quantization.md). The exact path stays within fp32 noise, tokens equal."""
    out = tmp_path / "int4"
    quantize_checkpoint(original, out, "int4", group_size=32)
    requests = [([1] + [3 + (37 * i + 11 * j) % 300 for j in range(5 + 7 * i)], 12, i)
                for i in range(8)]

    def engine(**kwargs):
        return kvserve.LLMEngine(out, dtype="float32", log_memory_plan=False,
                                 quantized_activation=activation, **kwargs)

    solo = engine()
    alone = {str(i): run_with_logprobs(solo, [(p, n, 0)])["0"]
             for i, (p, n, _) in enumerate(requests)}
    mixed = run_with_logprobs(engine(max_num_batched_tokens=16), requests)
    for key, (tokens, logprobs) in alone.items():
        got_tokens, got_logprobs = mixed[key]
        if activation == "exact":
            assert got_tokens == tokens
            torch.testing.assert_close(got_logprobs, logprobs, rtol=0, atol=1e-4)
            continue
        same = next((j for j, (a, b) in enumerate(zip(tokens, got_tokens)) if a != b),
                    len(tokens))  # up to a greedy near-tie the rounding decided otherwise
        for a, b in zip(logprobs[:same], got_logprobs[:same]):
            assert abs(a - b) <= 0.1, (key, logprobs, got_logprobs)
