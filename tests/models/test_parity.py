"""kvserve's C++ runtime against Hugging Face transformers on tiny random checkpoints of every
supported architecture: prompt logits, and greedy continuations as one mixed-length batch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import kvserve
from tests.conftest import ARCHITECTURES

transformers = pytest.importorskip("transformers")

# Tolerances on logits, relative to the largest |logit| of the reference. fp32 differs only by
# summation order; bf16 rounds every activation (kvserve rounds once per fused op, transformers
# after each elementwise op), so it gets a looser bound and is compared on the first tokens only.
LOGIT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-2, torch.float16: 8e-3}
PROMPTS = [
    [1, 5, 9, 200, 31, 7, 8, 9, 10, 11, 12],
    [1, 77],
    [1, 3, 4, 5, 6, 300, 301, 302, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 7],
    [1, 250, 251, 13, 14, 15, 16],
]
NUM_GREEDY_TOKENS = 40

# LongRoPE's per-frequency factors for heads of 24 (12 rotated pairs), far from 1.
_SHORT_FACTORS = [1.0 + 0.25 * i for i in range(12)]
_LONG_FACTORS = [2.0 + 3.0 * i for i in range(12)]

# Variants that exercise config paths beyond the defaults.
VARIANTS = {
    # Phi-3's LongRoPE within its original context (max_model_len = max_position_embeddings =
    # the original 128): the short factors, and an attention factor from the given factor 2.
    "phi3-longrope-short": ("Phi3ForCausalLM", dict(
        max_position_embeddings=128, original_max_position_embeddings=128, rope_parameters={
            "rope_type": "longrope", "short_factor": _SHORT_FACTORS,
            "long_factor": _LONG_FACTORS, "original_max_position_embeddings": 128,
            "factor": 2.0, "rope_theta": 10000.0})),
    # Phi-4-mini's three quarters of each head rotated, with a window of 6.
    "phi3-partial-rotary-window": ("Phi3ForCausalLM", dict(
        sliding_window=6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.75})),
    "mistral-sliding-window": ("MistralForCausalLM", dict(sliding_window=8)),
    "llama3-rope-tied-bias": ("LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                         "rope_theta": 500000.0},
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "llama-mqa-linear-rope": ("LlamaForCausalLM", dict(
        num_key_value_heads=1, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 10000.0})),
    "qwen2-yarn": ("Qwen2ForCausalLM", dict(
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                         "rope_theta": 10000.0})),
    # MLA without q_lora_rank, and yarn whose mscale_all_dim scales the softmax.
    "deepseek-v2-q-proj-yarn": ("DeepseekV2ForCausalLM", dict(
        q_lora_rank=None,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                         "beta_slow": 1, "rope_theta": 10000.0})),
    # The latent norms keep eps 1e-6 whatever rms_norm_eps says (transformers' code).
    "deepseek-v2-norm-eps": ("DeepseekV2ForCausalLM", dict(rms_norm_eps=1e-4)),
    "deepseek-v2-group-routing": ("DeepseekV2ForCausalLM", dict(
        topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    # Every layer dense: no MoE at all, its expert fields (num_experts_per_tok null) unread.
    "deepseek-v2-all-dense": ("DeepseekV2ForCausalLM", dict(first_k_dense_replace=2,
                                                            num_experts_per_tok=None)),
    "granite-biases-tied": ("GraniteForCausalLM", dict(attention_bias=True, mlp_bias=True,
                                                       tie_word_embeddings=True)),
    # GLM-4.5's attention bias (q/k/v only, not o_proj) and per-head q/k norms over its
    # half-rotated heads.
    "glm4-moe-qkv-bias-qk-norm": ("Glm4MoeForCausalLM", dict(attention_bias=True,
                                                             use_qk_norm=True)),
    "olmo2-attention-bias-mqa": ("Olmo2ForCausalLM", dict(attention_bias=True,
                                                          num_key_value_heads=1)),
    # SmolLM3's NoPE layers listed per layer, here the first and the last.
    "smollm3-listed-nope-layers": ("SmolLM3ForCausalLM", dict(no_rope_layers=[0, 1, 0])),
    "deepseek-v3-neox-rope-all-dense": ("DeepseekV3ForCausalLM", dict(
        rope_interleave=False, first_k_dense_replace=2)),
    "deepseek-v3-all-moe-attention-bias": ("DeepseekV3ForCausalLM", dict(
        first_k_dense_replace=0, attention_bias=True)),
    "qwen3-moe-dense-layer": ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[0],
                                                          norm_topk_prob=False)),
    # Windowed Qwen: only the layers from max_window_layers on slide (transformers' code).
    "qwen2-window-upper-layers": ("Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3-window-upper-layers": ("Qwen3ForCausalLM", dict(
        use_sliding_window=True, sliding_window=5, max_window_layers=1, num_hidden_layers=3)),
    # Gemma 3 with linearly scaled RoPE on its global layer only, and no soft-caps.
    "gemma3-scaled-global-rope": ("Gemma3ForCausalLM", dict(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    "gemma2-untied-head-3-layers": ("Gemma2ForCausalLM", dict(tie_word_embeddings=False,
                                                          num_hidden_layers=3)),
    # Granite 4's dense hybrids (the shared MLP alone), and RoPE on the attention layer.
    "granite-hybrid-dense-rope": ("GraniteMoeHybridForCausalLM", dict(
        num_local_experts=0, position_embedding_type="rope")),
    # Bamba with its attention in the first and last layers, and yarn over its half-rotated heads.
    "bamba-attention-first-and-last-yarn": ("BambaForCausalLM", dict(
        attn_layer_indices=[0, 3], rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 10000.0})),
    # FalconH1's mixer norm after the gate (Mamba2's order) with every bias, and before it with
    # its own head_dim (not hidden_size / heads) and a tied head.
    "falcon-h1-gate-then-norm-biases": ("FalconH1ForCausalLM", dict(
        mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_proj_bias=True,
        projectors_bias=True, attention_bias=True, mlp_bias=True)),
    "falcon-h1-norm-then-gate-head-dim-tied": ("FalconH1ForCausalLM", dict(
        mamba_rms_norm=True, mamba_norm_before_gate=True, head_dim=16,
        tie_word_embeddings=True)),
    # Nemotron-H with attention first, two MLP layers in a row, every bias (the mixer's in and
    # out projections: use_bias; its convolution's off), tie_word_embeddings (which its
    # transformers code ignores: the head stays its own) and a time step clamped far above its
    # random values.
    "nemotron-h-attention-first-biases-tied": ("NemotronHForCausalLM", dict(
        layers_block_type=["full_attention", "linear_attention", "mlp", "mlp",
                           "linear_attention"],
        mlp_bias=True, use_bias=True, use_conv_bias=False, tie_word_embeddings=True,
        time_step_min=0.7)),
    # Nemotron-H's mixture-of-experts layers (E): experts without a gate, DeepSeek-V3's router
    # (8 experts in 4 groups, the best 2 groups compete, weights renormalised and scaled) and a
    # shared expert; then in a latent space (fc1 / fc2 latent projections), with biases where
    # transformers has them (the shared expert, the latent projections), plain top-2.
    "nemotron-h-moe-grouped": ("NemotronHForCausalLM", dict(
        layers_block_type=["linear_attention", "moe", "full_attention", "moe", "mlp"],
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40, n_group=4, topk_group=2,
        routed_scaling_factor=2.5)),
    "nemotron-h-moe-latent-biases": ("NemotronHForCausalLM", dict(
        layers_block_type=["moe", "linear_attention", "full_attention", "moe", "mlp"],
        n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=20,
        moe_shared_expert_intermediate_size=28, moe_latent_size=16, mlp_bias=True,
        norm_topk_prob=False)),
}


def hf_model(path, dtype=torch.float32):
    # Eager attention: the reference implementation of soft-caps and windows in every version.
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager").eval()


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding by full forward passes: no cache, no generate() heuristics."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(num_tokens):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def kvserve_prompt_logits(llm: kvserve.LLM, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position through the contiguous KVCache loop (on the CPU), or for
    a model with state-space layers (which KVCache does not serve) through a paged pool with one
    state slot."""
    if llm.config.num_ssm_layers():
        return paged_prompt_logits(llm, prompt)
    device = llm.model.device
    caches = kvserve.KVCache.for_model(1, len(prompt), llm.config, llm.dtype, device=device)
    return llm.model(torch.tensor([prompt], device=device), caches)[0].cpu()


def paged_prompt_logits(llm: kvserve.LLM, prompt: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits of every prompt position in one forward over a fresh paged pool."""
    device = llm.model.device
    blocks = -(-len(prompt) // block_size) + 1  # and the null block
    cache = kvserve._C.PagedKVCache(kvserve._C.KVCacheLayout.for_model(llm.config), blocks,
                                    block_size, llm.dtype, device, num_state_slots=1)
    builder = kvserve._C.ForwardBatchBuilder(block_size)
    builder.add(prompt, 0, list(range(1, blocks)), state_slot=0)
    batch = builder.build(device)
    hidden = llm.model.forward(batch.input_ids, batch.positions, batch.metadata, cache)
    return llm.model.compute_logits(hidden).cpu()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype):
    ref = ref.float()
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err <= LOGIT_TOLERANCE[dtype], f"max relative logit error {err:.2e}"


# A router's choice between its k-th and (k+1)-th expert is a near tie when their scores differ by
# less than this (softmax routers: in logits; sigmoid routers: in biased sigmoid scores). Rounding
# to bf16 decides such a choice either way, and transformers' bf16 run is one arbitrary outcome
# among them. Routers whose logits are rounded to bf16 (Mixtral, Qwen3-MoE) tie far more often
# than DeepSeek's fp32 routers, which see rounded inputs only.
NEAR_TIE = {("softmax", False): 0.1, ("softmax", True): 0.02, ("sigmoid", True): 0.005}


def routed_prefix_len(ref32, prompt: list[int], llm: kvserve.LLM) -> int:
    """Positions before the first token whose routing is a near tie in some MoE layer of the
    fp32 reference (causal: later positions cannot change earlier ones)."""
    moe = llm.config.moe
    if moe.num_experts == 0:
        return len(prompt)
    # Each router's logits from its input, caught by a hook (output_router_logits is not
    # returned by every model in every transformers version).
    gates = [m for name, m in ref32.named_modules() if name.endswith((".gate", ".router"))
             and hasattr(m, "weight") and m.weight.dim() == 2 and m.weight.size(0) == moe.num_experts]
    routers: list[torch.Tensor] = []
    hooks = [gate.register_forward_pre_hook(
        lambda gate, args: routers.append(torch.nn.functional.linear(
            args[0].float().reshape(-1, gate.weight.size(1)), gate.weight.float(),
            None if getattr(gate, "bias", None) is None else gate.bias.float())))
        for gate in gates]
    try:
        with torch.no_grad():
            ref32(torch.tensor([prompt]))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(routers) == len(gates), "a router ran more or less than once"
    first = len(prompt)
    for layer, logits in enumerate(routers):
        scores = logits.view(len(prompt), -1)
        if moe.scoring_func == "sigmoid":
            scores = scores.sigmoid() + gates[layer].e_score_correction_bias.float()
        top = scores.topk(moe.num_experts_per_tok + 1, dim=-1).values
        gap = top[:, -2] - top[:, -1]
        ties = (gap < NEAR_TIE[moe.scoring_func, moe.fp32_router]).nonzero()
        if len(ties):
            first = min(first, int(ties[0]))
    return first


def check_parity(path, dtype=torch.float32, device="cpu", prompts=PROMPTS, **llm_args):
    ref = hf_model(path, dtype)
    llm = kvserve.LLM(path, dtype=dtype, device=device, **llm_args)
    # Routers and state-space layers in reduced precision: against transformers' fp32 logits
    # (its own bf16 scan strays from them as far as kvserve's: 5e-2 on the Granite hybrid).
    rounded = llm.config.moe.num_experts or llm.config.num_ssm_layers()
    ref32 = hf_model(path) if rounded and dtype != torch.float32 else None
    compared = 0
    for prompt in prompts:
        with torch.no_grad():
            ref_logits = ref(torch.tensor([prompt])).logits[0]
        ours = kvserve_prompt_logits(llm, prompt)
        if ref32 is None:
            assert_logits_close(ours, ref_logits, dtype)
            continue
        # MoE in reduced precision: against the fp32 reference, up to the first near tie.
        n = routed_prefix_len(ref32, prompt, llm)
        with torch.no_grad():
            truth = ref32(torch.tensor([prompt[:n]])).logits[0] if n else None
        if n:
            assert_logits_close(ours[:n], truth, dtype)
        compared += n
    assert ref32 is None or compared >= sum(map(len, prompts)) // 4, "too few positions compared"
    if dtype != torch.float32:
        return
    params = kvserve.SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)  # one batch of mixed lengths
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NUM_GREEDY_TOKENS)
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_fp32_logits_and_greedy_match_transformers(checkpoint_factory, architecture):
    check_parity(checkpoint_factory(architecture))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(checkpoint_factory, variant):
    architecture, overrides = VARIANTS[variant]
    check_parity(checkpoint_factory(architecture, **overrides))


def test_nemotron_h_reads_its_layers_as_letters(checkpoint_factory, tmp_path):
    """Nemotron-H checkpoints name their layers in hybrid_override_pattern (M mixer, * attention,
    - MLP), transformers 5 in layers_block_type: the same model either way."""
    listed = checkpoint_factory("NemotronHForCausalLM")
    lettered = tmp_path / "lettered"
    shutil.copytree(listed, lettered)
    config = json.loads((lettered / "config.json").read_text())
    letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}
    config["hybrid_override_pattern"] = "".join(letters[k]
                                                for k in config.pop("layers_block_type"))
    config.pop("num_hidden_layers", None)
    (lettered / "config.json").write_text(json.dumps(config))
    a, b = (kvserve.LLM(path, dtype=torch.float32) for path in (listed, lettered))
    assert list(b.config.ssm.layers) == [1, 3, 0, 1, 3] and b.config.num_layers == 5
    for prompt in PROMPTS[:2]:
        torch.testing.assert_close(kvserve_prompt_logits(b, prompt),
                                   kvserve_prompt_logits(a, prompt), rtol=0, atol=0)


def test_longrope_long_factors_past_the_original_context(checkpoint_factory):
    """A context longer than the original one takes LongRoPE's long factors. kvserve picks the
    set once, by max_model_len (256 > 8); transformers per forward, by its longest position:
    the two agree on prompts already past 8 tokens, where every forward of transformers' takes
    the long set too."""
    path = checkpoint_factory("Phi3ForCausalLM", original_max_position_embeddings=8,
                              rope_parameters={"rope_type": "longrope",
                                               "short_factor": _SHORT_FACTORS,
                                               "long_factor": _LONG_FACTORS,
                                               "original_max_position_embeddings": 8,
                                               "rope_theta": 10000.0})
    long_prompts = [p for p in PROMPTS if len(p) > 8]
    check_parity(path, prompts=long_prompts)
    # Within the original context (max_model_len 8) the short set: equal to the prompt's
    # first 8 tokens in transformers.
    llm = kvserve.LLM(path, dtype=torch.float32, max_model_len=8)
    ref = hf_model(path, torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor([long_prompts[0][:8]])).logits[0]
    assert_logits_close(kvserve_prompt_logits(llm, long_prompts[0][:8]), want, torch.float32)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_bf16_logits_within_tolerance(checkpoint_factory, architecture):
    check_parity(checkpoint_factory(architecture, dtype=torch.bfloat16), torch.bfloat16)


def test_fp16_logits_within_tolerance(checkpoint_factory):
    check_parity(checkpoint_factory("Qwen3ForCausalLM", dtype=torch.float16), torch.float16)


def test_bf16_greedy_starts_like_transformers(checkpoint_factory):
    """bf16 rounding differs op by op, so only the first tokens must agree."""
    path = checkpoint_factory("LlamaForCausalLM", dtype=torch.bfloat16)
    ref = hf_model(path, torch.bfloat16)
    llm = kvserve.LLM(path)  # dtype "auto" -> the checkpoint's bf16
    assert llm.dtype == torch.bfloat16
    params = kvserve.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert out.outputs[0].token_ids[:2] == hf_greedy(ref, prompt, 2)


def test_eos_and_stop_tokens_end_generation(checkpoint_factory, tmp_path):
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"))
    prompt = PROMPTS[2]
    free = llm.generate([prompt], kvserve.SamplingParams(temperature=0, max_tokens=30,
                                                         ignore_eos=True))[0].outputs[0].token_ids
    stop_at = free[6]
    out = llm.generate([prompt], kvserve.SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == free[:free.index(stop_at) + 1] and out.finish_reason == "stop"

    # A copy of the checkpoint whose EOS is a token the model produces greedily.
    eos = free[9]
    eos_dir = tmp_path / "eos"
    shutil.copytree(llm.model_dir, eos_dir)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((eos_dir / name).read_text())
        (eos_dir / name).write_text(json.dumps({**config, "eos_token_id": eos}))
    eos_llm = kvserve.LLM(eos_dir)
    out = eos_llm.generate([prompt], kvserve.SamplingParams(temperature=0, max_tokens=30))[0]
    assert out.outputs[0].token_ids == free[:free.index(eos) + 1]
    assert out.outputs[0].finish_reason == "stop"
    ignored = eos_llm.generate([prompt], kvserve.SamplingParams(temperature=0, max_tokens=30,
                                                                ignore_eos=True))[0]
    assert ignored.outputs[0].token_ids == free


def test_requests_must_fit_max_model_len(checkpoint_factory):
    """prompt + max_tokens may reach max_model_len, not exceed it (rejected when added)."""
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), max_model_len=16)
    fits = 16 - len(PROMPTS[0])
    out = llm.generate([PROMPTS[0]], kvserve.SamplingParams(temperature=0, max_tokens=fits,
                                                            ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == fits and out.finish_reason == "length"
    with pytest.raises(ValueError, match="exceeds max_model_len 16"):
        llm.generate([PROMPTS[0]], kvserve.SamplingParams(max_tokens=fits + 1))


def test_long_prompt_mlp_chunks_match_transformers(checkpoint_factory):
    """A prompt whose gate_up output passes the MLP's 16 MiB chunk (700 tokens x 2 x 4,096 fp32
    = 22 MiB) runs in chunks; its logits must not change."""
    path = checkpoint_factory("LlamaForCausalLM", intermediate_size=4096, num_hidden_layers=1,
                              max_position_embeddings=1024, initializer_range=0.05)
    prompt = [1] + [3 + (i * 37) % 380 for i in range(699)]
    with torch.no_grad():
        ref_logits = hf_model(path)(torch.tensor([prompt])).logits[0]
    assert_logits_close(kvserve_prompt_logits(kvserve.LLM(path), prompt), ref_logits, torch.float32)
