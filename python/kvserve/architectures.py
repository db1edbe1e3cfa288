"""The architectures kvserve runs: one entry each, read by the config parser (kvserve.config), the
C++ model factory (through ModelConfig.family), pruning, and the tests' tiny checkpoints
(kvserve.testing.checkpoints).

A new architecture whose layers kvserve already has is one entry here; one that needs new layers
adds them in C++ (csrc/layers/, csrc/models/) under a new family
(docs/contributing/adding-a-model-family.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve import config_families as families
from kvserve import config_ssm as ssm


@dataclass(frozen=True)
class Architecture:
    """name: the config.json `architectures` entry. family: the C++ model class that runs it
    (csrc/models/model_factory.cpp: "llama" is the Llama layer structure, which ModelConfig's
    flags adapt; "deepseek_v2" adds multi-head latent attention). read_family: reads the
    family's own config.json fields before the common ones (Gemma: fills in transformers'
    defaults and returns the completed config). prepare: before anything is read, the file with
    the fields the common reader needs put in where the family names them otherwise (Mamba2 has
    no attention: placeholders). read_attention: after the common fields (MLA).
    read_moe: the mixture-of-experts fields, when the architecture has them. read_ssm: the
    state-space mixers' fields (from the file as written). weight_names: (pattern, replacement)
    regular expressions from the checkpoint's tensor names to kvserve's (the Llama layout's
    model.layers.<i>. ...; a state-space mixer's weights under model.layers.<i>.mixer.), or a
    function of the ModelConfig that returns them. split_weights: a function of the ModelConfig
    that names the checkpoint's fused tensors and the parts each is read as, by rows
    (WeightIndex.split: Phi-3's qkv_proj and gate_up_proj). fold_weights: (config, config.json values,
    weights) rescales the loaded weights in place (FalconH1 folds its multipliers into them).
    fused_mlp: an MLP's gate and up projections
    are one [2 * intermediate, hidden] tensor, gate rows first (kvserve's name gate_up_proj;
    Granite's input_linear), in the dense MLP and the shared expert. stacked_experts: the routed
    experts are two tensors over all experts: "rows" (Granite), mlp.experts.gate_up_proj
    [experts, 2 * intermediate, hidden] (gate rows first) and mlp.experts.down_proj [experts,
    hidden, intermediate]; "columns" (gpt-oss), transposed, [experts, hidden, 2 * intermediate]
    with gate and up columns alternating and [experts, intermediate, hidden], with biases. partial_rotary: its attention honours
    partial_rotary_factor (rotates the first dims of each head; others refuse a factor but 1).
    qkv_bias: q/k/v
    always carry a bias. o_proj_bias: attention_bias puts a bias on o_proj too (GLM-4.5: on
    q/k/v only). qk_norm: q and k are RMS-normed per head. max_window_layers: without
    layer_types, only the layers from max_window_layers on use the sliding window. prunable:
    kvserve.prune can shrink it. tiny: transformers config overrides of a tiny random
    checkpoint for the tests (model_type first)."""

    name: str
    family: str = "llama"
    read_family: Callable | None = None
    prepare: Callable | None = None
    read_attention: Callable | None = None
    read_moe: Callable | None = None
    read_ssm: Callable | None = None
    weight_names: tuple[tuple[str, str], ...] | Callable = ()
    split_weights: Callable | None = None
    fold_weights: Callable | None = None
    fused_mlp: bool = False
    stacked_experts: str = ""
    partial_rotary: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = True
    qk_norm: bool = False
    max_window_layers: bool = False
    prunable: bool = False
    tiny: dict = field(default_factory=dict)


# Tiny shapes: initializer_range is large (kvserve.testing.checkpoints) so that logits are far
# from ties; windows (6) are shorter than the test sequences, and soft-caps low enough to bend
# the logits of random weights.
_MLA_TINY = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in [
    Architecture("LlamaForCausalLM", prunable=True, tiny=dict(model_type="llama")),
    Architecture("MistralForCausalLM", prunable=True,
                 tiny=dict(model_type="mistral", sliding_window=None)),
    Architecture("Qwen2ForCausalLM", qkv_bias=True, max_window_layers=True, prunable=True,
                 tiny=dict(model_type="qwen2")),
    Architecture("Qwen3ForCausalLM", qk_norm=True, max_window_layers=True, prunable=True,
                 tiny=dict(model_type="qwen3", head_dim=24)),
    Architecture("MixtralForCausalLM", read_moe=families.read_mixtral_moe,
                 tiny=dict(model_type="mixtral", sliding_window=None, num_local_experts=4,
                           num_experts_per_tok=2, intermediate_size=64)),
    Architecture("Qwen3MoeForCausalLM", qk_norm=True, read_moe=families.read_qwen3_moe,
                 tiny=dict(model_type="qwen3_moe", head_dim=24, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=48,
                           norm_topk_prob=True)),
    # transformers' MLA needs num_key_value_heads == num_attention_heads; layer 0 is dense.
    Architecture("DeepseekV2ForCausalLM", family="deepseek_v2", read_attention=families.read_mla,
                 read_moe=families.read_deepseek_moe,
                 tiny=dict(model_type="deepseek_v2", **_MLA_TINY)),
    Architecture("DeepseekV3ForCausalLM", family="deepseek_v2", read_attention=families.read_mla,
                 read_moe=families.read_deepseek_moe,
                 tiny=dict(model_type="deepseek_v3", **_MLA_TINY, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5)),
    Architecture("Gemma2ForCausalLM", read_family=families.read_gemma,
                 tiny=dict(model_type="gemma2", head_dim=24, sliding_window=6,
                           query_pre_attn_scalar=20, attn_logit_softcapping=4.0,
                           final_logit_softcapping=3.0, tie_word_embeddings=True)),
    Architecture("Gemma3ForCausalLM", read_family=families.read_gemma, qk_norm=True,
                 tiny=dict(model_type="gemma3_text", head_dim=24, sliding_window=6,
                           num_hidden_layers=3, sliding_window_pattern=3,
                           query_pre_attn_scalar=32, tie_word_embeddings=True)),
    # Granite (3.x): Llama's layers with its multipliers.
    Architecture("GraniteForCausalLM", read_family=families.read_granite,
                 tiny=dict(model_type="granite", embedding_multiplier=2.5,
                           attention_multiplier=0.09, residual_multiplier=0.6,
                           logits_scaling=2.5)),
    # SmolLM3: the middle of 3 layers without RoPE (NoPE every second layer).
    Architecture("SmolLM3ForCausalLM", read_family=families.read_smollm3,
                 tiny=dict(model_type="smollm3", num_hidden_layers=3,
                           no_rope_layer_interval=2, pad_token_id=0)),
    # OLMo 2: post-norms only, q/k norms over all heads (Architecture.qk_norm: per head
    # unless its reader says otherwise).
    Architecture("Olmo2ForCausalLM", read_family=families.read_olmo2, qk_norm=True,
                 tiny=dict(model_type="olmo2", pad_token_id=0)),
    # GLM-4.5 (MoE): half-rotated heads, a dense first layer, then DeepSeek-V3's sigmoid routing
    # in groups with a shared expert.
    Architecture("Glm4MoeForCausalLM", read_family=families.read_glm4_moe,
                 read_moe=families.read_deepseek_moe, partial_rotary=True, o_proj_bias=False,
                 tiny=dict(model_type="glm4_moe", n_routed_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, n_shared_experts=1,
                           first_k_dense_replace=1, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, head_dim=24)),
    # gpt-oss: sinks, windowed and full layers alternating (a window of 6), 4 experts with
    # biases (top 2) and the clamped SwiGLU in every layer, a vocabulary not a multiple of 8.
    Architecture("GptOssForCausalLM", read_family=families.read_gpt_oss,
                 read_moe=families.read_gpt_oss_moe, weight_names=families.GPT_OSS_WEIGHT_NAMES,
                 stacked_experts="columns",
                 tiny=dict(model_type="gpt_oss", num_hidden_layers=3, hidden_size=64, head_dim=24,
                           sliding_window=6, num_local_experts=4, num_experts_per_tok=2,
                           intermediate_size=40, vocab_size=381, swiglu_limit=1.5,
                           pad_token_id=0)),
    # Phi-3: q/k/v and gate/up fused in the checkpoint; LongRoPE is a variant in
    # tests/models/test_parity.py.
    Architecture("Phi3ForCausalLM", read_family=families.read_phi3,
                 split_weights=families.phi3_split_weights, partial_rotary=True,
                 tiny=dict(model_type="phi3", pad_token_id=0)),
    # Cohere2: LayerNorms, attention beside the MLP, RoPE on the sliding layers only (two of
    # four here).
    Architecture("Cohere2ForCausalLM", read_family=families.read_cohere2,
                 tiny=dict(model_type="cohere2", num_hidden_layers=4, sliding_window=6,
                           sliding_window_pattern=2, logit_scale=0.4, vocab_size=381)),
    # Mamba2: every layer a state-space mixer, no MLP; odd sizes (3 layers, 20 heads of 12,
    # 3 groups of 10 states) against kernels tuned for powers of two.
    Architecture("Mamba2ForCausalLM", prepare=ssm.prepare_mamba2,
                 read_ssm=ssm.read_mamba2_ssm, weight_names=ssm.MAMBA2_WEIGHT_NAMES,
                 tiny=dict(model_type="mamba2", hidden_size=120, num_hidden_layers=3,
                           num_heads=20, head_dim=12, expand=2, state_size=10, n_groups=5,
                           conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5,
                           use_conv_bias=True, use_bias=False, residual_in_fp32=False)),
    # Mamba: every layer Mamba's mixer (a decay per channel and state entry), no MLP; odd sizes
    # (88 channels of 10 states, not 2 * hidden_size; a time step of rank 5, 3 taps).
    Architecture("MambaForCausalLM", prepare=ssm.prepare_mamba2, read_ssm=ssm.read_mamba_ssm,
                 weight_names=ssm.MAMBA2_WEIGHT_NAMES,
                 tiny=dict(model_type="mamba", hidden_size=48, num_hidden_layers=3, expand=2,
                           intermediate_size=88, state_size=10, conv_kernel=3, time_step_rank=5,
                           layer_norm_epsilon=1e-5, use_conv_bias=True, use_bias=False,
                           residual_in_fp32=False)),
    # FalconMamba: Mamba with its time step, B and C RMS-normed (no weights) in the mixer.
    Architecture("FalconMambaForCausalLM", prepare=ssm.prepare_mamba2,
                 read_ssm=ssm.read_falcon_mamba_ssm, weight_names=ssm.MAMBA2_WEIGHT_NAMES,
                 tiny=dict(model_type="falcon_mamba", hidden_size=48, num_hidden_layers=3,
                           expand=2, intermediate_size=88, state_size=10, conv_kernel=3, time_step_rank=5,
                           mixer_rms_eps=1e-3, use_conv_bias=False, use_bias=True,
                           residual_in_fp32=False)),
    # Jamba: Mamba mixers (dt, B and C normed) in layers 0 and 2, NoPE attention in 1 and 3, each
    # followed by experts (8, top 2, not renormalized) in 1 and 3 (Jamba's offset), a dense MLP
    # in 0 and 2.
    Architecture("JambaForCausalLM", read_family=ssm.read_jamba, read_ssm=ssm.read_jamba_ssm,
                 read_moe=ssm.read_jamba_moe, weight_names=ssm.JAMBA_WEIGHT_NAMES,
                 tiny=dict(model_type="jamba", num_hidden_layers=4, attn_layer_period=2,
                           attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                           num_experts=8, num_experts_per_tok=2, mamba_d_state=10,
                           mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=5)),
    # Granite 4 hybrids: Mamba2 mixers and NoPE attention layers, a shared MLP beside 4 routed
    # experts (top 2) in every layer, Granite's multipliers; the dense form is a variant in
    # tests/models/test_parity.py.
    Architecture("GraniteMoeHybridForCausalLM", read_family=ssm.read_granite_hybrid,
                 read_moe=ssm.read_granite_moe, read_ssm=ssm.read_granite_ssm,
                 weight_names=ssm.granite_weight_names, fused_mlp=True,
                 stacked_experts="rows",
                 tiny=dict(model_type="granitemoehybrid", num_hidden_layers=4,
                           layer_types=["mamba", "attention", "mamba", "mamba"],
                           num_local_experts=4, num_experts_per_tok=2, intermediate_size=40,
                           shared_intermediate_size=136,
                           mamba_n_heads=12, mamba_d_head=16, mamba_expand=2, mamba_d_state=10,
                           mamba_n_groups=3, mamba_d_conv=3, mamba_chunk_size=8,
                           embedding_multiplier=1.7, attention_multiplier=0.09,
                           residual_multiplier=0.6, logits_scaling=2.5,
                           position_embedding_type="nope")),
    # Bamba: Mamba2 mixers but in attn_layer_indices, whose attention rotates half of each head.
    Architecture("BambaForCausalLM", read_family=ssm.read_bamba,
                 read_ssm=ssm.read_bamba_ssm, weight_names=ssm.BAMBA_WEIGHT_NAMES,
                 partial_rotary=True,
                 tiny=dict(model_type="bamba", num_hidden_layers=4, attn_layer_indices=[1],
                           mamba_n_heads=12, mamba_d_head=16, mamba_expand=2, mamba_d_state=10,
                           mamba_n_groups=3, mamba_d_conv=3, mamba_chunk_size=8)),
    # FalconH1: attention and a Mamba2 mixer side by side in every layer, every multiplier away
    # from 1; the mixer's inner size (mamba_d_ssm) is not expand * hidden_size, and it has no
    # norm (its normed forms are variants in tests/models/test_parity.py).
    Architecture("FalconH1ForCausalLM", read_family=ssm.read_falcon_h1,
                 read_ssm=ssm.read_falcon_h1_ssm,
                 weight_names=ssm.FALCON_H1_WEIGHT_NAMES,
                 fold_weights=ssm.fold_falcon_h1,
                 tiny=dict(model_type="falcon_h1", num_hidden_layers=3, mamba_n_heads=10,
                           mamba_d_ssm=120, mamba_d_head="auto", mamba_d_state=10,
                           mamba_n_groups=5, mamba_d_conv=3, mamba_chunk_size=8,
                           embedding_multiplier=1.7, lm_head_multiplier=0.4, key_multiplier=0.7,
                           attention_in_multiplier=1.3, attention_out_multiplier=0.8,
                           ssm_in_multiplier=1.1, ssm_out_multiplier=0.6,
                           ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9],
                           mlp_multipliers=[1.4, 0.7])),
    # Nemotron-H: Mamba2 mixers, NoPE attention and MLPs alone (squared ReLU, no gate), one per
    # layer; odd sizes (12 mixer heads of 16, 3 groups of 10 states, 3 taps), the time step
    # clamped below.
    Architecture("NemotronHForCausalLM", prepare=ssm.prepare_nemotron_h,
                 read_family=ssm.read_nemotron_h, read_ssm=ssm.read_nemotron_h_ssm,
                 read_moe=ssm.read_nemotron_h_moe,
                 weight_names=ssm.NEMOTRON_H_WEIGHT_NAMES,
                 tiny=dict(model_type="nemotron_h",
                           layers_block_type=["linear_attention", "mlp", "full_attention",
                                              "linear_attention", "mlp"],
                           mamba_num_heads=12, mamba_head_dim=16, ssm_state_size=10, n_groups=3,
                           conv_kernel=3, chunk_size=8, head_dim=24, time_step_min=0.05)),
]}


def weight_names(c) -> tuple[tuple[str, str], ...]:
    """The renames from a checkpoint's tensor names to kvserve's for ModelConfig `c`."""
    names = ARCHITECTURES[c.architecture].weight_names
    return names(c) if callable(names) else names


def split_weights(c) -> tuple:
    """The fused tensors of ModelConfig `c`'s checkpoint read as parts (WeightIndex.split)."""
    split = ARCHITECTURES[c.architecture].split_weights
    return split(c) if split is not None else ()


def supported_architectures() -> list[str]:
    return list(ARCHITECTURES)
