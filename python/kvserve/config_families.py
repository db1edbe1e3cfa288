"""The config.json fields of the families beyond the Llama layer structure: DeepSeek's multi-head
latent attention, the mixture-of-experts layers of DeepSeek, Mixtral and Qwen3-MoE, Gemma 2/3's
norms, activations, soft-caps and local/global layers; and kvserve's own `kv_sharing` extension
(cross-layer KV sharing). The state-space families are in config_ssm.py.

`f` is config.py's typed reader of the file (its errors name the file and the field).
"""

from __future__ import annotations

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
    finish_moe(c, f, m, layers)


def read_mixtral_moe(c: _C.ModelConfig, f) -> None:
    """Mixtral: every layer's MLP is num_local_experts experts of intermediate_size."""
    m = _C.MoEConfig()
    m.num_experts = f.integer("num_local_experts", 0, minimum=0)
    if m.num_experts == 0:
        return
    m.moe_intermediate_size = c.intermediate_size
    m.norm_topk_prob = True
    finish_moe(c, f, m, [1] * c.num_layers)


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
    finish_moe(c, f, m, layers)


def finish_moe(c: _C.ModelConfig, f, m: _C.MoEConfig, layers: list[int]) -> None:
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


def read_granite(c: _C.ModelConfig, f, hf: dict) -> dict:
    """Granite (3.x, dense): Llama's layers with Granite's multipliers."""
    require_silu(f, hf)
    granite_multipliers(c, f)
    return hf


def granite_multipliers(c: _C.ModelConfig, f) -> None:
    """The embeddings, every layer's outputs into the residual and the logits scaled, and the
    attention scores' scale set, by Granite's multipliers (transformers' defaults: 1)."""
    c.embedding_multiplier = f.number("embedding_multiplier", 1.0)
    c.residual_multiplier = f.number("residual_multiplier", 1.0)
    c.logits_scaling = f.number("logits_scaling", 1.0)
    # The scores' scale is attention_multiplier itself, not head_dim^-0.5.
    c.query_pre_attn_scalar = f.number("attention_multiplier", 1.0) ** -2


def require_silu(f, hf: dict) -> None:
    """The hybrids' hidden_act is both the MLP's and the mixer's convolution's: SiLU only."""
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise f.error("hidden_act", f"is {act!r}; only silu is supported")


def scale_rows(w: dict, module: str, weight_rows: torch.Tensor,
               bias_rows: torch.Tensor) -> None:
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
            scale_rows(w, part, part_rows, torch.ones(1))
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
    require_silu(f, hf)
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
    require_silu(f, hf)
    c.post_norms = True
    c.qk_norm_full_width = True
    return hf


def read_glm4_moe(c: _C.ModelConfig, f, hf: dict) -> dict:
    """GLM-4.5 (MoE): per-head q/k RMSNorms when use_qk_norm; half of each head rotated unless
    the file says otherwise (transformers' default partial_rotary_factor is 0.5)."""
    require_silu(f, hf)
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
    require_silu(f, hf)
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
    require_silu(f, hf)
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
    require_silu(f, hf)
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
    finish_moe(c, f, m, [1] * c.num_layers)


# gpt-oss's tensor names in kvserve's layout: the router as the MoE's gate, the stacked experts'
# tensors (no .weight suffix, biases beside them; MXFP4 blocks and scales in released
# checkpoints) as stacked weights and biases.
GPT_OSS_WEIGHT_NAMES = (
    (r"^(model\.layers\.\d+\.mlp\.)router\.", r"\1gate."),
    (r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$", r"\1\2.weight"),
    (r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)_(bias|blocks|scales)$",
     r"\1\2.\3"),
)
