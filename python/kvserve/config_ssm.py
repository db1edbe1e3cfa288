"""The config.json fields of the state-space and hybrid families: Mamba2's and Mamba's mixers in
every layer (Mamba2, Mamba, FalconMamba), and the hybrids that mix them with attention and MLPs
(Granite 4, Bamba, Nemotron-H, FalconH1 with Mamba2's; Jamba with Mamba's); their tensor names in
kvserve's layout.

`f` is config.py's typed reader of the file (its errors name the file and the field).
"""

from __future__ import annotations

import math

import torch

from kvserve import _C
from kvserve.config_families import finish_moe, granite_multipliers, require_silu, scale_rows


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


def read_mamba_ssm(c: _C.ModelConfig, f) -> None:
    """Mamba's mixer (S6) in every layer (transformers' MambaConfig; Mamba has no attention and
    no MLP: Mamba2's placeholders, prepare_mamba2)."""
    s = _mamba_mixer_fields(c, f, _MAMBA_KEYS)
    s.layers = [1] * c.num_layers
    s.mlp = False
    c.ssm = s


def read_falcon_mamba_ssm(c: _C.ModelConfig, f) -> None:
    """FalconMamba: Mamba's mixer with its time step, B and C RMS-normed without weights
    (mixer_rms_eps) before use."""
    s = _mamba_mixer_fields(c, f, _MAMBA_KEYS)
    s.dt_bc_norm = "plain"
    s.dt_bc_norm_eps = f.number("mixer_rms_eps", 1e-6)
    s.layers = [1] * c.num_layers
    s.mlp = False
    c.ssm = s


# Where each family's config.json keeps a Mamba mixer's sizes: inner size (None: expand *
# hidden_size alone), expansion, states, convolution taps, time step rank, conv bias, projection
# bias.
_MAMBA_KEYS = ("intermediate_size", "expand", "state_size", "conv_kernel", "time_step_rank",
               "use_conv_bias", "use_bias")
_JAMBA_KEYS = (None, "mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank",
               "mamba_conv_bias", "mamba_proj_bias")


def _mamba_mixer_fields(c: _C.ModelConfig, f, keys: tuple[str, ...]) -> _C.SSMConfig:
    """A Mamba mixer's sizes under the family's keys, checked: a head a channel of its inner
    size (expand * hidden_size where the file names none), one group, the gate alone after the
    scan; a time step rank of "auto" is ceil(hidden_size / 16) (transformers' rule)."""
    inner_key, expand_key, state, kernel, rank, conv_bias, proj_bias = keys
    s = _C.SSMConfig()
    s.kind = "mamba"
    if inner_key is not None and f.values.get(inner_key) is not None:
        s.num_heads = f.integer(inner_key)
    else:
        s.num_heads = round(f.number(expand_key, 2) * c.hidden_size)
    s.head_dim = s.n_groups = s.norm_groups = 1
    s.state_size = f.integer(state)
    s.conv_kernel = f.integer(kernel, 4)
    if not 2 <= s.conv_kernel <= 16:
        raise f.error(kernel, f"is {s.conv_kernel}; kvserve runs kernels of 2 to 16 taps")
    if f.values.get(rank, "auto") == "auto":
        s.time_step_rank = math.ceil(c.hidden_size / 16)
    else:
        s.time_step_rank = f.integer(rank)
    s.norm = "gate_only"
    s.conv_bias = f.flag(conv_bias, True)
    s.proj_bias = s.out_proj_bias = f.flag(proj_bias, False)
    s.dt_min, s.dt_max = _time_step_limit(f)
    return s


# Jamba's tensor names in kvserve's layout: its mixer (mamba), its MLP or mixture of experts
# (feed_forward, the router as the gate), the norm before it and the final one.
JAMBA_WEIGHT_NAMES = (
    (r"^model\.layers\.(\d+)\.mamba\.", r"model.layers.\1.mixer."),
    (r"^model\.layers\.(\d+)\.feed_forward\.router\.", r"model.layers.\1.mlp.gate."),
    (r"^model\.layers\.(\d+)\.feed_forward\.", r"model.layers.\1.mlp."),
    (r"^model\.layers\.(\d+)\.pre_ff_layernorm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^model\.final_layernorm\.", "model.norm."),
)


def read_jamba(c: _C.ModelConfig, f, hf: dict) -> dict:
    """Jamba: attention without positions (no RoPE), SiLU MLPs and experts."""
    require_silu(f, hf)
    c.no_rope = True
    return hf


def read_jamba_ssm(c: _C.ModelConfig, f) -> None:
    """Mamba mixers (dt, B and C RMS-normed with weights, at rms_norm_eps) in every layer but
    those at attn_layer_offset of each attn_layer_period, each followed by an MLP or experts."""
    period = f.integer("attn_layer_period", 8)
    offset = f.integer("attn_layer_offset", 4, minimum=0)
    if offset >= period:
        raise f.error("attn_layer_offset", f"({offset}) must be less than attn_layer_period "
                                           f"({period})")
    s = _mamba_mixer_fields(c, f, _JAMBA_KEYS)
    s.dt_bc_norm = "weighted"
    s.dt_bc_norm_eps = c.rms_norm_eps
    s.layers = [0 if i % period == offset else 1 for i in range(c.num_layers)]
    s.mlp = True
    c.ssm = s


def read_jamba_moe(c: _C.ModelConfig, f) -> None:
    """Jamba's experts (num_experts of intermediate_size) in the layers at expert_layer_offset of
    each expert_layer_period: softmax over the router's logits, the top-k weights not
    renormalized. One expert (or none) is a dense MLP everywhere."""
    m = _C.MoEConfig()
    m.num_experts = f.integer("num_experts", 16, minimum=0)
    if m.num_experts <= 1:
        return
    period = f.integer("expert_layer_period", 2)
    offset = f.integer("expert_layer_offset", 1, minimum=0)
    if offset >= period:
        raise f.error("expert_layer_offset", f"({offset}) must be less than "
                                             f"expert_layer_period ({period})")
    m.moe_intermediate_size = c.intermediate_size
    m.norm_topk_prob = False
    finish_moe(c, f, m, [int(i % period == offset) for i in range(c.num_layers)])


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


def read_granite_hybrid(c: _C.ModelConfig, f, hf: dict) -> dict:
    """Granite 4 (GraniteMoeHybrid): the shared MLP's size, the multipliers, NoPE or RoPE."""
    c.intermediate_size = f.integer("shared_intermediate_size")
    require_silu(f, hf)
    granite_multipliers(c, f)
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
    finish_moe(c, f, m, [1] * c.num_layers)


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


def read_bamba(c: _C.ModelConfig, f, hf: dict) -> dict:
    """Bamba rotates half of each attention head whatever its file says (transformers' BambaConfig
    sets partial_rotary_factor 0.5 for every checkpoint)."""
    rope = {key: {k: v for k, v in value.items() if k != "partial_rotary_factor"}
            for key in ("rope_parameters", "rope_scaling")
            if isinstance(value := hf.get(key), dict)}
    require_silu(f, hf)
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
    finish_moe(c, f, m, [int(k in _NEMOTRON_H_MOE) for k in kinds])


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
    require_silu(f, hf)
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
        scale_rows(w, p + "self_attn.qkv_proj",
               rows((q_rows, attn_in), (kv_rows, attn_in * key), (kv_rows, attn_in)),
               rows((q_rows, 1.0), (kv_rows, key), (kv_rows, 1.0)))
        out = torch.tensor([m["attention_out_multiplier"]])
        scale_rows(w, p + "self_attn.o_proj", out, out)
        mup_rows = rows((z_x, mup[0]), (z_x, mup[1]), (bc, mup[2]), (bc, mup[3]),
                        (s.num_heads, mup[4]))
        scale_rows(w, p + "mixer.in_proj", mup_rows * m["ssm_in_multiplier"], mup_rows)
        out = torch.tensor([m["ssm_out_multiplier"]])
        scale_rows(w, p + "mixer.out_proj", out, out)
        gate_up = rows((c.intermediate_size, gate), (c.intermediate_size, 1.0))
        scale_rows(w, p + "mlp.gate_up_proj", gate_up, gate_up)
        scale_rows(w, p + "mlp.down_proj", torch.tensor([down]), torch.tensor([down]))
