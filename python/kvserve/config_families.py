"""The config.json fields of the families beyond the Llama layer structure: DeepSeek's multi-head
latent attention, the mixture-of-experts layers of DeepSeek, Mixtral and Qwen3-MoE, Gemma 2/3's
norms, activations, soft-caps and local/global layers, Mamba2's state-space mixers; and kvserve's
own `kv_sharing` extension (cross-layer KV sharing).

`f` is config.py's typed reader of the file (its errors name the file and the field).
"""

from __future__ import annotations

import math
import os

import torch

from kvserve import _C

# Which form MLA attends in (auto: per sequence by cost); tests and benchmarks force one.
MLA_ATTENTION_ENV = "KVSERVE_MLA_ATTENTION"


def read_mla(c: _C.ModelConfig, f) -> None:
    """DeepSeek's multi-head latent attention; head_dim becomes the RoPE size, as in
    transformers."""
    m = _C.MLAConfig()
    m.q_lora_rank = f.integer("q_lora_rank", 0, minimum=0)
    m.kv_lora_rank = f.integer("kv_lora_rank")
    m.qk_nope_head_dim = f.integer("qk_nope_head_dim")
    m.qk_rope_head_dim = f.integer("qk_rope_head_dim")
    m.v_head_dim = f.integer("v_head_dim")
    if m.qk_rope_head_dim % 2:
        raise f.error("qk_rope_head_dim", f"is {m.qk_rope_head_dim}; rotary embeddings need it even")
    # V2 always rotates DeepSeek's interleaved pairs; V3 says so in rope_interleave.
    m.rope_interleave = (c.architecture == "DeepseekV2ForCausalLM"
                         or f.flag("rope_interleave", True))
    path = os.environ.get(MLA_ATTENTION_ENV, "auto")
    if path not in ("auto", "absorbed", "expanded"):
        raise ValueError(f"{MLA_ATTENTION_ENV} must be auto, absorbed or expanded, got {path!r}")
    m.attention_path = path
    c.mla = m
    c.head_dim = m.qk_rope_head_dim


def read_deepseek_moe(c: _C.ModelConfig, f) -> None:
    """DeepSeekMoE: routed experts from first_k_dense_replace on, shared experts, fp32 router;
    V3 (and GLM-4.5, which routes as V3 does) scores by sigmoid within groups. A model whose dense layers are all of them has no MoE
    (its expert fields, num_experts_per_tok null included, are not read)."""
    m = _C.MoEConfig()
    m.num_experts = f.integer("n_routed_experts", 0, minimum=0)
    first_dense = f.integer("first_k_dense_replace", 0, minimum=0)
    if m.num_experts == 0 or first_dense >= c.num_layers:
        return
    if f.integer("moe_layer_freq", 1) != 1:  # every released checkpoint has 1
        raise f.error("moe_layer_freq", "must be 1: transformers (the reference) puts an MoE "
                                        "in every layer from first_k_dense_replace on")
    layers = [int(i >= first_dense) for i in range(c.num_layers)]
    m.shared_intermediate_size = (f.integer("n_shared_experts", 0, minimum=0)
                                  * f.integer("moe_intermediate_size"))
    m.routed_scaling_factor = f.number("routed_scaling_factor", 1.0)
    m.fp32_router = True
    if c.architecture in ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"):
        m.scoring_func = "sigmoid"
        m.norm_topk_prob = f.flag("norm_topk_prob", True)
        m.n_group = f.integer("n_group", 1)
        m.topk_group = f.integer("topk_group", 1)
    else:  # transformers' V2 neither renormalises nor reads norm_topk_prob
        method = f.values.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise f.error("topk_method", f"is {method!r}; DeepSeek-V2 routes by "
                                         "'greedy' or 'group_limited_greedy'")
        if method == "group_limited_greedy":
            m.n_group = f.integer("n_group")
            m.topk_group = f.integer("topk_group")
    _finish_moe(c, f, m, layers)


def read_mixtral_moe(c: _C.ModelConfig, f) -> None:
    """Mixtral: every layer's MLP is num_local_experts experts of intermediate_size."""
    m = _C.MoEConfig()
    m.num_experts = f.integer("num_local_experts", 0, minimum=0)
    if m.num_experts == 0:
        return
    m.moe_intermediate_size = c.intermediate_size
    m.norm_topk_prob = True
    _finish_moe(c, f, m, [1] * c.num_layers)


def read_qwen3_moe(c: _C.ModelConfig, f) -> None:
    """Qwen3-MoE: experts every decoder_sparse_step layers, except mlp_only_layers."""
    m = _C.MoEConfig()
    # Hub checkpoints say num_experts; transformers >= 5 writes num_local_experts.
    key = "num_experts" if f.values.get("num_experts") is not None else "num_local_experts"
    m.num_experts = f.integer(key, 0, minimum=0)
    if m.num_experts == 0:
        return
    step = f.integer("decoder_sparse_step", 1)
    dense = f.values.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(not isinstance(i, int) for i in dense):
        raise f.error("mlp_only_layers", f"must be a list of layer indices, got {dense!r}")
    layers = [int(i not in dense and (i + 1) % step == 0) for i in range(c.num_layers)]
    m.norm_topk_prob = f.flag("norm_topk_prob", False)
    _finish_moe(c, f, m, layers)


def _finish_moe(c: _C.ModelConfig, f, m: _C.MoEConfig, layers: list[int]) -> None:
    """The fields every MoE family shares, checked, then c.moe."""
    if m.moe_intermediate_size == 0:
        m.moe_intermediate_size = f.integer("moe_intermediate_size")
    m.num_experts_per_tok = f.integer("num_experts_per_tok")
    if m.num_experts_per_tok > m.num_experts:
        raise f.error("num_experts_per_tok", f"({m.num_experts_per_tok}) exceeds the number of "
                                             f"experts ({m.num_experts})")
    if m.num_experts % m.n_group or m.topk_group > m.n_group:
        raise f.error("n_group", f"({m.n_group}) must divide the {m.num_experts} experts and be "
                                 f">= topk_group ({m.topk_group})")
    per_group = m.num_experts // m.n_group
    if m.num_experts_per_tok > m.topk_group * per_group:
        raise f.error("topk_group", f"({m.topk_group}) groups of {per_group} experts leave fewer "
                                    f"than num_experts_per_tok ({m.num_experts_per_tok}) to choose")
    if m.scoring_func == "sigmoid" and m.n_group > 1 and per_group < 2:
        raise f.error("n_group", f"({m.n_group}) leaves one expert per group; DeepSeek-V3 ranks a "
                                 "group by its best two")
    m.layers = layers
    c.moe = m


# transformers' defaults for the Gemma fields a config.json may leave out.
_GEMMA_DEFAULTS = {
    "Gemma2ForCausalLM": dict(head_dim=256, sliding_window=4096, query_pre_attn_scalar=256,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              rope_theta=10000.0, pattern=2),
    "Gemma3ForCausalLM": dict(head_dim=256, sliding_window=4096, query_pre_attn_scalar=256,
                              attn_logit_softcapping=None, final_logit_softcapping=None,
                              rope_theta=1_000_000.0, pattern=6),
}


def read_gemma(c: _C.ModelConfig, f, hf: dict) -> dict:
    """Gemma 2 / Gemma 3 (text): GeGLU, (1 + w) RMSNorms in fp32, sandwich norms, embeddings
    scaled by sqrt(hidden_size), query_pre_attn_scalar, attention and final logit soft-caps, and
    local layers (every other one in Gemma 2; five of six in Gemma 3) with a sliding window and,
    in Gemma 3, their own RoPE base. Returns the config with transformers' defaults filled in and
    Gemma 3's per-layer-type rope_parameters reduced to the global layers' (the local base goes to
    c.rope_local_theta)."""
    defaults = _GEMMA_DEFAULTS[c.architecture]
    act = f.values.get("hidden_activation") or f.values.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        key = "hidden_activation" if "hidden_activation" in f.values else "hidden_act"
        raise f.error(key, f"is {act!r}; Gemma 2/3 use 'gelu_pytorch_tanh'")
    if f.flag("use_bidirectional_attention", False):
        raise f.error("use_bidirectional_attention", "is set: that is an encoder, not a causal LM")
    hf = dict(hf)
    for key in ("sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping"):
        if key not in hf:
            hf[key] = defaults[key]
    hf.setdefault("head_dim", defaults["head_dim"])
    hf.setdefault("tie_word_embeddings", True)
    if hf.get("layer_types") is None:
        pattern = f.integer("sliding_window_pattern", defaults["pattern"])
        hf["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                             for i in range(c.num_layers)]
    c.hidden_act = "gelu_pytorch_tanh"
    c.norm_weight_offset = 1.0
    c.embedding_multiplier = c.hidden_size ** 0.5
    c.sandwich_norms = True
    c.query_pre_attn_scalar = _optional_number(f, hf, "query_pre_attn_scalar")
    c.attn_logit_softcap = _optional_number(f, hf, "attn_logit_softcapping")
    c.final_logit_softcap = _optional_number(f, hf, "final_logit_softcapping")
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:  # transformers >= 5: per layer type
        local = rope.get("sliding_attention") or {}
        if (local.get("rope_type") or "default") != "default":
            raise f.error("rope_parameters", "scales the sliding_attention layers' RoPE; only "
                                             "the full_attention layers' may be scaled")
        hf["rope_parameters"] = rope["full_attention"] or {}
        local_theta = local.get("rope_theta", 10000.0)
    else:
        local_theta = hf.get("rope_local_base_freq", 10000.0)
    if "rope_theta" not in hf and "rope_theta" not in (hf.get("rope_parameters") or {}):
        hf["rope_theta"] = defaults["rope_theta"]
    if c.architecture == "Gemma3ForCausalLM":
        c.rope_local_theta = _optional_number(f, {"rope_local_base_freq": local_theta},
                                              "rope_local_base_freq")
    return hf


def _optional_number(f, values: dict, key: str) -> float:
    """A positive number, or 0.0 where the field is null (absent values are defaulted before)."""
    value = values.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise f.error(key, f"must be a positive number or null, got {value!r}")
    return float(value)


def read_kv_sharing(c: _C.ModelConfig, f) -> None:
    """Cross-layer KV sharing (CLA), a kvserve config.json extension: ``"kv_sharing": {"1": 0,
    "3": 2}`` makes layer 1 attend over layer 0's cached keys and values (and layer 3 over layer
    2's) instead of projecting and caching its own; such a layer has q_proj and o_proj but no
    k_proj / v_proj. Sources are earlier layers that own their KV, with the same window.
    (transformers has no plain text model that shares KV; kvserve.testing.cla is the reference.)"""
    sharing = f.values.get("kv_sharing")
    if sharing is None:
        return
    if not isinstance(sharing, dict):
        raise f.error("kv_sharing", f"must map layer -> earlier source layer, got {sharing!r}")
    if c.use_mla():
        raise f.error("kv_sharing", "is not supported with multi-head latent attention")
    sources = list(range(c.num_layers))
    for key, source in sharing.items():
        layer = int(key) if isinstance(key, str) and key.isdigit() else -1
        if not 0 <= layer < c.num_layers:
            raise f.error("kv_sharing", f"names layer {key!r}; layers are 0..{c.num_layers - 1}")
        if isinstance(source, bool) or not isinstance(source, int) or not 0 <= source < layer:
            raise f.error("kv_sharing", f"maps layer {layer} to {source!r}; a source must be an "
                                        "earlier layer")
        sources[layer] = source
    for layer, source in enumerate(sources):
        if sources[source] != source:
            raise f.error("kv_sharing", f"maps layer {layer} to layer {source}, which shares "
                                        "another layer's KV itself")
        if c.sliding_windows[source] != c.sliding_windows[layer]:
            raise f.error("kv_sharing", f"maps layer {layer} to layer {source}, whose sliding "
                                        "window differs")
    c.kv_sources = sources


# Mamba2's tensor names in kvserve's layout: its blocks' one norm is the input norm, its mixer the
# layer's state-space mixer.
MAMBA2_WEIGHT_NAMES = (
    (r"^backbone\.embeddings\.", "model.embed_tokens."),
    (r"^backbone\.norm_f\.", "model.norm."),
    (r"^backbone\.layers\.(\d+)\.norm\.", r"model.layers.\1.input_layernorm."),
    (r"^backbone\.layers\.(\d+)\.mixer\.", r"model.layers.\1.mixer."),
)

# A Mamba2 config names no position limit (the model has none); kvserve takes this one, and the
# engine's default max_model_len for a model without attention layers is 32,768 below it.
MAMBA2_MAX_POSITIONS = 1 << 20


def prepare_mamba2(hf: dict) -> dict:
    """Mamba2 has no attention and no MLP: placeholders for the attention fields the common
    reader checks (one head of 2, no layer reads them), its norm epsilon as rms_norm_eps."""
    return {**hf, "intermediate_size": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
            "head_dim": 2, "rms_norm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "max_position_embeddings": hf.get("max_position_embeddings") or MAMBA2_MAX_POSITIONS}


def read_mamba2_ssm(c: _C.ModelConfig, f) -> None:
    """Mamba2's mixer in every layer (transformers' Mamba2Config); its hidden_act (the
    convolution's) is checked by the common reader: SiLU only."""
    s = _mixer_fields(c, f, _MAMBA2_KEYS)
    s.layers = [1] * c.num_layers
    s.mlp = False
    c.ssm = s


# Where each family's config.json keeps the mixer's sizes: heads, head size, states, groups,
# convolution taps, expansion, conv bias, projection bias.
_MAMBA2_KEYS = ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "expand",
                "use_conv_bias", "use_bias")
_GRANITE_KEYS = ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups",
                 "mamba_d_conv", "mamba_expand", "mamba_conv_bias", "mamba_proj_bias")


def _mixer_fields(c: _C.ModelConfig, f, keys: tuple[str, ...],
                  inner_key: str | None = None) -> _C.SSMConfig:
    """A Mamba2 mixer's sizes under the family's keys, checked. Its inner size is expand *
    hidden_size, or the inner_key field where the family has one and the file sets it
    (FalconH1's mamba_d_ssm), or heads * head size where expand_key is None (Nemotron-H); a head
    size of "auto" is that size / heads (transformers' rule)."""
    heads, head_dim, state, groups, kernel, expand_key, conv_bias, proj_bias = keys
    s = _C.SSMConfig()
    s.num_heads = f.integer(heads)
    s.state_size = f.integer(state)
    s.n_groups = f.integer(groups, 1)
    s.conv_kernel = f.integer(kernel, 4)
    if inner_key is not None and f.values.get(inner_key) is not None:
        inner, inner_source = f.integer(inner_key), inner_key
    elif expand_key is None:
        inner = s.num_heads * f.integer(head_dim)
        inner_source = f"{heads} * {head_dim}"
    else:
        expand = f.number(expand_key, 2)
        inner, inner_source = round(expand * c.hidden_size), f"{expand_key} * hidden_size"
    if f.values.get(head_dim) == "auto":
        s.head_dim = inner // s.num_heads
    else:
        s.head_dim = f.integer(head_dim)
    if s.num_heads % s.n_groups:
        raise f.error(groups, f"({s.n_groups}) must divide {heads} ({s.num_heads})")
    if not 2 <= s.conv_kernel <= 16:
        raise f.error(kernel, f"is {s.conv_kernel}; kvserve runs kernels of 2 to 16 taps")
    if s.num_heads * s.head_dim != inner:
        raise f.error(head_dim, f"* {heads} ({s.num_heads * s.head_dim}) must equal "
                                f"{inner_source} ({inner})")
    s.norm_groups = s.n_groups  # the gated RMSNorm's groups of intermediate_size / n_groups
    s.conv_bias = f.flag(conv_bias, True)
    s.proj_bias = s.out_proj_bias = f.flag(proj_bias, False)
    s.dt_min, s.dt_max = _time_step_limit(f)
    return s


def _time_step_limit(f) -> tuple[float, float]:
    """time_step_limit [min, max] (transformers' default (0, inf): none); inf as 1e30."""
    limit = f.values.get("time_step_limit")
    if limit is None:
        return 0.0, 1e30
    if isinstance(limit, (list, tuple)):  # transformers 5 writes inf as {"__float__": "Infinity"}
        limit = [float(v["__float__"]) if isinstance(v, dict) and v.get("__float__") in
                 ("Infinity", "-Infinity", "NaN") else v for v in limit]
    ok = (isinstance(limit, (list, tuple)) and len(limit) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
                  for v in limit) and 0 <= limit[0] < limit[1])
    if not ok:
        raise f.error("time_step_limit", f"must be [min, max] with 0 <= min < max, got {limit!r}")
    return float(limit[0]), min(float(limit[1]), 1e30)


def granite_weight_names(c: _C.ModelConfig) -> tuple[tuple[str, str], ...]:
    """Granite 4 hybrids' tensor names in kvserve's layout: the mixer; the shared MLP, whose gate
    and up projections are one tensor (Architecture.fused_mlp), as the layer's MLP or, beside
    routed experts, as their shared expert; the router and the experts' stacked [experts, ...]
    tensors (Architecture.stacked_experts)."""
    mlp = r"model.layers.\1.mlp."
    shared = mlp + "shared_experts." if c.moe.num_experts else mlp
    layer = r"^model\.layers\.(\d+)\."
    return (
        (layer + r"mamba\.", r"model.layers.\1.mixer."),
        (layer + r"shared_mlp\.input_linear\.", shared + "gate_up_proj."),
        (layer + r"shared_mlp\.output_linear\.", shared + "down_proj."),
        (layer + r"block_sparse_moe\.router\.layer\.", mlp + "gate."),
        (layer + r"block_sparse_moe\.input_linear\.", mlp + "experts.gate_up_proj."),
        (layer + r"block_sparse_moe\.output_linear\.", mlp + "experts.down_proj."),
    )


def read_granite(c: _C.ModelConfig, f, hf: dict) -> dict:
    """Granite (3.x, dense): Llama's layers with Granite's multipliers."""
    _require_silu(f, hf)
    _granite_multipliers(c, f)
    return hf


def _granite_multipliers(c: _C.ModelConfig, f) -> None:
    """The embeddings, every layer's outputs into the residual and the logits scaled, and the
    attention scores' scale set, by Granite's multipliers (transformers' defaults: 1)."""
    c.embedding_multiplier = f.number("embedding_multiplier", 1.0)
    c.residual_multiplier = f.number("residual_multiplier", 1.0)
    c.logits_scaling = f.number("logits_scaling", 1.0)
    # The scores' scale is attention_multiplier itself, not head_dim^-0.5.
    c.query_pre_attn_scalar = f.number("attention_multiplier", 1.0) ** -2


def read_granite_hybrid(c: _C.ModelConfig, f, hf: dict) -> dict:
    """Granite 4 (GraniteMoeHybrid): the shared MLP's size, the multipliers, NoPE or RoPE."""
    c.intermediate_size = f.integer("shared_intermediate_size")
    _require_silu(f, hf)
    _granite_multipliers(c, f)
    position = hf.get("position_embedding_type")
    if position not in (None, "rope", "nope"):
        raise f.error("position_embedding_type", f"is {position!r}; expected rope or none")
    c.no_rope = position != "rope"
    # Its layer_types name mixers (read_granite_ssm), not attention windows.
    return {key: value for key, value in hf.items() if key != "layer_types"}


def read_granite_moe(c: _C.ModelConfig, f) -> None:
    """Granite 4's routed experts (num_local_experts > 0) in every layer: softmax over the top-k
    router logits, intermediate_size each; the shared MLP beside them is their shared expert."""
    m = _C.MoEConfig()
    m.num_experts = f.integer("num_local_experts", 0, minimum=0)
    if m.num_experts == 0:
        return
    m.moe_intermediate_size = f.integer("intermediate_size")
    m.shared_intermediate_size = c.intermediate_size  # read_granite_hybrid: the shared MLP's
    m.norm_topk_prob = True
    _finish_moe(c, f, m, [1] * c.num_layers)


def read_granite_ssm(c: _C.ModelConfig, f) -> None:
    """Which layers are Mamba2 mixers (layer_types) and their mamba_* fields."""
    # Checkpoints name the kinds mamba / attention; transformers 5 writes linear_attention /
    # full_attention.
    types = f.values.get("layer_types")
    kinds = {"mamba": 1, "linear_attention": 1, "attention": 0, "full_attention": 0}
    if (not isinstance(types, list) or len(types) != c.num_layers
            or any(t not in kinds for t in types)):
        raise f.error("layer_types", f"must list 'mamba' or 'attention' for each of the "
                                     f"{c.num_layers} layers, got {types!r}")
    s = _mixer_fields(c, f, _GRANITE_KEYS)
    s.layers = [kinds[t] for t in types]
    s.mlp = True
    c.ssm = s


# Bamba's tensor names in kvserve's layout: its mixer, its MLP (feed_forward), the norm before it
# and the final one.
BAMBA_WEIGHT_NAMES = (
    (r"^model\.layers\.(\d+)\.mamba\.", r"model.layers.\1.mixer."),
    (r"^model\.layers\.(\d+)\.feed_forward\.", r"model.layers.\1.mlp."),
    (r"^model\.layers\.(\d+)\.pre_ff_layernorm\.",
     r"model.layers.\1.post_attention_layernorm."),
    (r"^model\.final_layernorm\.", "model.norm."),
)


def _require_silu(f, hf: dict) -> None:
    """The hybrids' hidden_act is both the MLP's and the mixer's convolution's: SiLU only."""
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise f.error("hidden_act", f"is {act!r}; only silu is supported")


def read_bamba(c: _C.ModelConfig, f, hf: dict) -> dict:
    """Bamba rotates half of each attention head whatever its file says (transformers' BambaConfig
    sets partial_rotary_factor 0.5 for every checkpoint)."""
    rope = {key: {k: v for k, v in value.items() if k != "partial_rotary_factor"}
            for key in ("rope_parameters", "rope_scaling")
            if isinstance(value := hf.get(key), dict)}
    _require_silu(f, hf)
    return {**hf, **rope, "partial_rotary_factor": 0.5}


def read_bamba_ssm(c: _C.ModelConfig, f) -> None:
    """Mamba2 mixers in every layer but those of attn_layer_indices, each with an MLP."""
    indices = f.values.get("attn_layer_indices") or []
    if (not isinstance(indices, list)
            or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < c.num_layers
                   for i in indices)):
        raise f.error("attn_layer_indices", f"must list layer indices in [0, {c.num_layers}), "
                                            f"got {indices!r}")
    s = _mixer_fields(c, f, _GRANITE_KEYS)
    s.layers = [0 if i in indices else 1 for i in range(c.num_layers)]
    s.mlp = True
    c.ssm = s


# Nemotron-H: every layer one block after its norm, by kind (transformers 5's layers_block_type;
# checkpoints' hybrid_override_pattern, one letter a layer): a Mamba2 mixer, NoPE attention, an
# MLP alone (up, squared ReLU, down), or a mixture of experts alone (E: experts of that MLP's
# form, DeepSeek-V3's router, a shared expert; read_nemotron_h_moe).
_NEMOTRON_H_KINDS = {"linear_attention": 1, "mamba": 1, "M": 1, "full_attention": 0,
                     "attention": 0, "*": 0, "mlp": 3, "-": 3, "moe": 3, "E": 3}
_NEMOTRON_H_MOE = ("moe", "E")
_NEMOTRON_H_KEYS = ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                    "conv_kernel", None, "use_conv_bias", "use_bias")


def nemotron_h_layer_kinds(hf: dict) -> object:
    """Its layers' kinds as written: layers_block_type (or layer_types), else the letters of
    hybrid_override_pattern; None when neither is there."""
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    pattern = hf.get("hybrid_override_pattern")
    if kinds is None and isinstance(pattern, str):
        kinds = list(pattern)
    return kinds


def prepare_nemotron_h(hf: dict) -> dict:
    """The fields the common reader reads where Nemotron-H names them otherwise: the layer count
    from its kinds (transformers 5 writes no num_hidden_layers), the norms' epsilon; its
    layer_types are kinds of blocks, not attention windows."""
    kinds = nemotron_h_layer_kinds(hf)
    out = {key: value for key, value in hf.items() if key != "layer_types"}
    out["rms_norm_eps"] = hf.get("layer_norm_epsilon", 1e-5)
    if isinstance(kinds, list):
        out["num_hidden_layers"] = len(kinds)
    return out


def read_nemotron_h(c: _C.ModelConfig, f, hf: dict) -> dict:
    """Nemotron-H's MLP has no gate and squares its ReLU (mlp_hidden_act relu2); its attention
    rotates nothing and has no biases, and its LM head is its own (transformers' code, whatever
    attention_bias and tie_word_embeddings say)."""
    act = hf.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise f.error("mlp_hidden_act", f"is {act!r}; only relu2 is supported")
    c.hidden_act, c.gated_mlp, c.no_rope = "relu2", False, True
    return {**hf, "attention_bias": False, "tie_word_embeddings": False}


def read_nemotron_h_ssm(c: _C.ModelConfig, f) -> None:
    """Its layers' kinds and the mixers' mamba_* fields: in_proj and out_proj biased by use_bias,
    the time step clamped below by time_step_min alone (transformers' mixer: (min, inf))."""
    kinds = nemotron_h_layer_kinds(f.values)
    key = "layers_block_type" if f.values.get("layers_block_type") else (
        "layer_types" if f.values.get("layer_types") else "hybrid_override_pattern")
    if not isinstance(kinds, list) or len(kinds) != c.num_layers:
        raise f.error(key, f"must name a kind for each of the {c.num_layers} layers, got "
                           f"{kinds!r}")
    unknown = sorted({str(k) for k in kinds if k not in _NEMOTRON_H_KINDS})
    if unknown:
        raise f.error(key, f"names unknown layer kinds {unknown}; expected "
                           "linear_attention / full_attention / mlp / moe (M / * / - / E)")
    act = f.values.get("mamba_hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise f.error("mamba_hidden_act", f"is {act!r}; only silu is supported")
    s = _mixer_fields(c, f, _NEMOTRON_H_KEYS)
    s.dt_min, s.dt_max = f.number("time_step_min", 0.001), 1e30
    s.layers = [_NEMOTRON_H_KINDS[k] for k in kinds]
    s.mlp = False
    c.ssm = s


def read_nemotron_h_moe(c: _C.ModelConfig, f) -> None:
    """Its mixture-of-experts layers (moe / E), when it has any: n_routed_experts experts of
    moe_intermediate_size without a gate (relu2, as its MLP), DeepSeek-V3's router (sigmoid
    scores with a correction bias, n_group groups ranked by their best two, norm_topk_prob,
    routed_scaling_factor; logits in fp32), one shared expert of
    moe_shared_expert_intermediate_size (transformers' model has it whatever n_shared_experts
    says), and, with moe_latent_size, the routed experts in that latent space."""
    kinds = nemotron_h_layer_kinds(f.values)
    if not isinstance(kinds, list) or not any(k in _NEMOTRON_H_MOE for k in kinds):
        return
    m = _C.MoEConfig()
    m.num_experts = f.integer("n_routed_experts", minimum=1)
    m.shared_intermediate_size = f.integer("moe_shared_expert_intermediate_size", minimum=1)
    m.scoring_func, m.fp32_router, m.activation = "sigmoid", True, "relu2"
    m.norm_topk_prob = f.flag("norm_topk_prob", True)
    m.routed_scaling_factor = f.number("routed_scaling_factor", 1.0)
    m.n_group = f.integer("n_group", 1)
    m.topk_group = f.integer("topk_group", 1)
    if f.values.get("moe_latent_size") is not None:
        m.latent_size = f.integer("moe_latent_size", minimum=1)
    _finish_moe(c, f, m, [int(k in _NEMOTRON_H_MOE) for k in kinds])


# Nemotron-H's tensor names in kvserve's layout: every layer's block is its "mixer"; attention's
# and the MLP's projections go where kvserve's layers read them. Checkpoints name the model
# backbone; transformers 5 (and so a PEFT adapter trained on it) model.
NEMOTRON_H_WEIGHT_NAMES = (
    (r"^(?:backbone|model)\.embeddings\.", "model.embed_tokens."),
    (r"^(?:backbone|model)\.norm_f\.", "model.norm."),
    (r"^(?:backbone|model)\.layers\.(\d+)\.norm\.", r"model.layers.\1.input_layernorm."),
    (r"^(?:backbone|model)\.layers\.(\d+)\.mixer\.([qkvo]_proj)\.",
     r"model.layers.\1.self_attn.\2."),
    (r"^(?:backbone|model)\.layers\.(\d+)\.mixer\.(up_proj|down_proj)\.",
     r"model.layers.\1.mlp.\2."),
    (r"^(?:backbone|model)\.layers\.(\d+)\.mixer\."
     r"(experts|gate|shared_experts|fc1_latent_proj|fc2_latent_proj)\.",
     r"model.layers.\1.mlp.\2."),
    (r"^(?:backbone|model)\.layers\.(\d+)\.mixer\.", r"model.layers.\1.mixer."),
)


# FalconH1's tensor names in kvserve's layout: its mixer, its MLP (feed_forward), the norm before
# the MLP and the final one; its attention keeps the Llama names.
FALCON_H1_WEIGHT_NAMES = BAMBA_WEIGHT_NAMES

# FalconH1's scalar multipliers (transformers' default: 1 each) and its lists: ssm_multipliers
# scale the mixer's projected z, x, B, C and dt; mlp_multipliers the MLP's gate and its output.
_FALCON_H1_SCALARS = ("attention_in_multiplier", "key_multiplier", "attention_out_multiplier",
                      "ssm_in_multiplier", "ssm_out_multiplier")
_FALCON_H1_LISTS = {"ssm_multipliers": 5, "mlp_multipliers": 2}


def falcon_h1_multipliers(hf: dict, f=None) -> dict:
    """FalconH1's multipliers from its config.json, transformers' defaults for the absent ones;
    with `f` (config.py's reader), each checked to be a finite number > 0."""
    out = {}
    for key in _FALCON_H1_SCALARS:
        out[key] = f.number(key, 1.0) if f is not None else float(hf.get(key) or 1.0)
    for key, n in _FALCON_H1_LISTS.items():
        value = hf.get(key)
        if value is None:
            value = [1.0] * n
        ok = (isinstance(value, list) and len(value) == n
              and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                      and math.isfinite(v) and v > 0 for v in value))
        if f is not None and not ok:
            raise f.error(key, f"must list {n} finite numbers > 0, got {value!r}")
        out[key] = [float(v) for v in value]
    return out


def read_falcon_h1(c: _C.ModelConfig, f, hf: dict) -> dict:
    """FalconH1: the embedding and LM-head multipliers (the others are folded into the weights at
    load, fold_falcon_h1), attention bias on q/k/v/o alike."""
    _require_silu(f, hf)
    falcon_h1_multipliers(hf, f)  # checked here, applied by fold_falcon_h1
    c.embedding_multiplier = f.number("embedding_multiplier", 1.0)
    c.logits_scaling = 1.0 / f.number("lm_head_multiplier", 1.0)
    # Its layer kinds are all "hybrid" (read_falcon_h1_ssm), not attention windows.
    return {key: value for key, value in hf.items() if key != "layer_types"}


def read_falcon_h1_ssm(c: _C.ModelConfig, f) -> None:
    """A Mamba2 mixer beside the attention in every layer (transformers' FalconH1 has no other
    kind); its inner size mamba_d_ssm, its optional RMSNorm (mamba_rms_norm) before or after
    the gate (mamba_norm_before_gate), out_proj's bias projectors_bias."""
    s = _mixer_fields(c, f, _GRANITE_KEYS, inner_key="mamba_d_ssm")
    s.out_proj_bias = f.flag("projectors_bias", False)
    if not f.flag("mamba_rms_norm", False):
        s.norm = "gate_only"
    elif f.flag("mamba_norm_before_gate", True):
        s.norm = "norm_then_gate"
    s.layers = [2] * c.num_layers
    s.mlp = True
    c.ssm = s


def fold_falcon_h1(c: _C.ModelConfig, hf: dict, w: dict) -> None:
    """FalconH1's multipliers folded into the weights they follow or precede (as llama.cpp's
    converter does): `w` holds the loader's kvserve-named tensors, plain (.weight) or quantized
    (.scales: one row per output row, so scaling a row's scales scales the row)."""
    m = falcon_h1_multipliers(hf)
    s = c.ssm
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    z_x, bc = s.inner_size, s.n_groups * s.state_size
    mup = m["ssm_multipliers"]
    gate, down = m["mlp_multipliers"]
    attn_in, key = m["attention_in_multiplier"], m["key_multiplier"]

    def rows(*sections: tuple[int, float]) -> torch.Tensor:
        return torch.cat([torch.full((n,), v) for n, v in sections])

    for i in range(c.num_layers):
        p = f"layers.{i}."
        # q, k and v see the input times attention_in; k's output is times key_multiplier.
        _scale(w, p + "self_attn.qkv_proj",
               rows((q_rows, attn_in), (kv_rows, attn_in * key), (kv_rows, attn_in)),
               rows((q_rows, 1.0), (kv_rows, key), (kv_rows, 1.0)))
        out = torch.tensor([m["attention_out_multiplier"]])
        _scale(w, p + "self_attn.o_proj", out, out)
        mup_rows = rows((z_x, mup[0]), (z_x, mup[1]), (bc, mup[2]), (bc, mup[3]),
                        (s.num_heads, mup[4]))
        _scale(w, p + "mixer.in_proj", mup_rows * m["ssm_in_multiplier"], mup_rows)
        out = torch.tensor([m["ssm_out_multiplier"]])
        _scale(w, p + "mixer.out_proj", out, out)
        gate_up = rows((c.intermediate_size, gate), (c.intermediate_size, 1.0))
        _scale(w, p + "mlp.gate_up_proj", gate_up, gate_up)
        _scale(w, p + "mlp.down_proj", torch.tensor([down]), torch.tensor([down]))


def _scale(w: dict, module: str, weight_rows: torch.Tensor, bias_rows: torch.Tensor) -> None:
    """The output rows of linear `module` times weight_rows, its bias times bias_rows ([rows] or
    [1] for all), each product rounded once to the tensor's dtype."""
    if torch.all(weight_rows == 1) and torch.all(bias_rows == 1):
        return
    parts = []  # a fused projection held in parts (QuantizedWeight.runs): each its rows
    while f"{module}.parts.{len(parts)}.qweight" in w:
        parts.append(f"{module}.parts.{len(parts)}")
    if parts:
        sizes = [w[part + ".qweight"].shape[0] for part in parts]
        if len(weight_rows) not in (1, sum(sizes)):
            raise ValueError(f"{module}: cannot fold {len(weight_rows)} multipliers into "
                             f"{sum(sizes)} rows")
        rows = [weight_rows] * len(parts) if len(weight_rows) == 1 else weight_rows.split(sizes)
        for part, part_rows in zip(parts, rows):
            _scale(w, part, part_rows, torch.ones(1))
        weight_rows = torch.ones(1)  # the bias, below, is the whole projection's
    # Two-level scales (int8 under per-super-block factors) take the rows' factors in those.
    two_level = module + ".super_scales" in w
    scaled_params = ((".super_scales", weight_rows), (".super_mins", weight_rows)) if two_level \
        else ((".scales", weight_rows),)
    for suffix, factors in ((".weight", weight_rows), *scaled_params, (".bias", bias_rows)):
        t = w.get(module + suffix)
        if t is None:
            continue
        if len(factors) not in (1, t.shape[0]):
            raise ValueError(f"{module}{suffix}: cannot fold {len(factors)} multipliers into "
                             f"{t.shape[0]} rows")
        shape = (-1,) + (1,) * (t.dim() - 1)
        scaled = t.float() * factors.view(shape)
        if suffix in (".super_scales", ".super_mins"):  # products kept in fp32, both alike
            w[module + suffix] = scaled
        elif suffix == ".scales":  # products of fp16 scales are kept in fp32, and the zeros too
            w[module + suffix] = scaled
            if module + ".zeros" in w:
                w[module + ".zeros"] = w[module + ".zeros"].float()
        else:
            w[module + suffix] = scaled.to(t.dtype)


def read_smollm3(c: _C.ModelConfig, f, hf: dict) -> dict:
    """SmolLM3: Llama's layers, some without RoPE (NoPE). transformers' no_rope_layers holds 1
    for a layer that rotates and 0 for one that does not; absent, every no_rope_layer_interval-th
    layer goes without (c.nope_layers: 1 for those)."""
    _require_silu(f, hf)
    uses = hf.get("no_rope_layers")
    if uses is None:
        interval = f.integer("no_rope_layer_interval", 4)
        uses = [int((i + 1) % interval != 0) for i in range(c.num_layers)]
    if (not isinstance(uses, list) or len(uses) != c.num_layers
            or any(u not in (0, 1) or isinstance(u, bool) for u in uses)):
        raise f.error("no_rope_layers", f"must list 1 (RoPE) or 0 (none) for each of the "
                                        f"{c.num_layers} layers, got {uses!r}")
    c.nope_layers = [1 - u for u in uses]
    return hf


def read_olmo2(c: _C.ModelConfig, f, hf: dict) -> dict:
    """OLMo 2: RMSNorms on the attention and MLP outputs only (none before them), and q/k
    RMSNorms over all heads' projections at once."""
    _require_silu(f, hf)
    c.post_norms = True
    c.qk_norm_full_width = True
    return hf


def read_glm4_moe(c: _C.ModelConfig, f, hf: dict) -> dict:
    """GLM-4.5 (MoE): per-head q/k RMSNorms when use_qk_norm; half of each head rotated unless
    the file says otherwise (transformers' default partial_rotary_factor is 0.5)."""
    _require_silu(f, hf)
    c.qk_norm = f.flag("use_qk_norm", False)
    given = [hf] + [v for key in ("rope_parameters", "rope_scaling")
                    if isinstance(v := hf.get(key), dict)]
    if all(d.get("partial_rotary_factor") is None for d in given):
        return {**hf, "partial_rotary_factor": 0.5}
    return hf


def read_cohere2(c: _C.ModelConfig, f, hf: dict) -> dict:
    """Cohere2 (Command R7B, Command A): one LayerNorm without a bias before attention and MLP,
    which run side by side; sliding-window layers rotate interleaved pairs (x0, x1), ..., and the
    full-attention layers have no positional encoding; logits times logit_scale. Fills in
    transformers' defaults (every fourth layer full, a window of 4096, tied embeddings), and as
    transformers does, takes head_dim as hidden_size / num_attention_heads whatever the file
    says."""
    _require_silu(f, hf)
    if c.hidden_size % c.num_heads:
        raise f.error("hidden_size", f"({c.hidden_size}) must be a multiple of "
                                     f"num_attention_heads ({c.num_heads})")
    c.norm_type = "layer_norm"
    c.parallel_block = True
    c.rope_interleave = True
    c.logits_scaling = 1.0 / f.number("logit_scale", 0.0625)
    hf = {**hf, "head_dim": c.hidden_size // c.num_heads,
          "rms_norm_eps": f.number("layer_norm_eps", 1e-5)}
    hf.setdefault("tie_word_embeddings", True)
    hf.setdefault("sliding_window", 4096)
    if hf.get("layer_types") is None:
        pattern = f.integer("sliding_window_pattern", 4)
        hf["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                             for i in range(c.num_layers)]
    types = hf["layer_types"]
    if isinstance(types, list) and len(types) == c.num_layers:  # else the common reader refuses
        c.nope_layers = [int(t != "sliding_attention") for t in types]
    return hf


def read_phi3(c: _C.ModelConfig, f, hf: dict) -> dict:
    """Phi-3 / Phi-4-mini: Llama's layers (q/k/v and gate/up fused in the checkpoint:
    phi3_split_weights), LongRoPE scaling (config.py), optional partial rotary and windows."""
    _require_silu(f, hf)
    return hf


def phi3_split_weights(c: _C.ModelConfig) -> tuple:
    """Phi-3's fused projections as the parts kvserve reads (its q/k/v and gate/up rows)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return (("self_attn.qkv_proj", (("self_attn.q_proj", q), ("self_attn.k_proj", kv),
                                    ("self_attn.v_proj", kv))),
            ("mlp.gate_up_proj", (("mlp.gate_proj", c.intermediate_size),
                                  ("mlp.up_proj", c.intermediate_size))))


def read_gpt_oss(c: _C.ModelConfig, f, hf: dict) -> dict:
    """gpt-oss: attention sinks in every layer (a learned logit per head), sliding-window and
    full layers alternating (layer_types, or every second layer full as transformers fills it in)
    and YaRN RoPE; its experts in read_gpt_oss_moe."""
    _require_silu(f, hf)
    c.attention_sinks = True
    if hf.get("layer_types") is None:
        hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                    for i in range(c.num_layers)]}
    hf.setdefault("sliding_window", 128)
    return hf


def read_gpt_oss_moe(c: _C.ModelConfig, f) -> None:
    """gpt-oss's experts in every layer: a router with a bias whose top-k logits are
    softmax-weighted, experts with biases whose gate is the clamped SwiGLU (swiglu_alpha,
    swiglu_limit), each of intermediate_size."""
    m = _C.MoEConfig()
    m.num_experts = f.integer("num_local_experts")
    m.moe_intermediate_size = c.intermediate_size
    m.norm_topk_prob = True  # softmax over all, renormalized over the top k: over the top k
    m.router_bias = m.expert_bias = True
    m.activation = "clamped_swiglu"
    m.swiglu_alpha = f.number("swiglu_alpha", 1.702)
    m.swiglu_limit = f.number("swiglu_limit", 7.0)
    _finish_moe(c, f, m, [1] * c.num_layers)


# gpt-oss's tensor names in kvserve's layout: the router as the MoE's gate, the stacked experts'
# tensors (no .weight suffix, biases beside them; MXFP4 blocks and scales in released
# checkpoints) as stacked weights and biases.
GPT_OSS_WEIGHT_NAMES = (
    (r"^(model\.layers\.\d+\.mlp\.)router\.", r"\1gate."),
    (r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$", r"\1\2.weight"),
    (r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)_(bias|blocks|scales)$",
     r"\1\2.\3"),
)
