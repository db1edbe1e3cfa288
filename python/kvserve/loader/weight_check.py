"""The tensors a config.json implies, and a check of a checkpoint's headers against them.

Runs on the headers alone, before any tensor data is read or memory allocated, so that a config
that disagrees with its weights (a wrong size, a missing layer, an absurd vocabulary) fails fast
with the file, the tensor and the config fields involved.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from kvserve import _C
from kvserve.architectures import ARCHITECTURES
from kvserve.loader.weight_index import WeightIndex
from kvserve.quantization.formats import CheckpointQuantization

Dim = tuple[str, int]  # (what config.json calls the size, the size)
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_MAX_PROBLEMS_SHOWN = 8


def expected_shapes(c: _C.ModelConfig) -> dict[str, tuple[Dim, ...]]:
    """Every tensor the model reads, by its Hugging Face name, with its shape's config fields."""
    vocab, hidden = ("vocab_size", c.vocab_size), ("hidden_size", c.hidden_size)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        if not c.post_norms:
            shapes[p + "input_layernorm.weight"] = (hidden,)
        if c.has_mixer(i):
            shapes.update(_mixer_shapes(c, p + "mixer."))
        if c.has_attention(i):
            shapes.update(_mla_shapes(c, p) if c.use_mla() else _attention_shapes(c, p, i))
        if c.mlp_only(i):  # Nemotron-H: the layer is its MLP (or MoE), after the input norm
            shapes.update(_moe_shapes(c, p) if c.is_moe_layer(i)
                          else _dense_mlp_shapes(c, p + "mlp."))
            continue
        if not c.ssm.mlp:
            continue
        if not c.parallel_block:  # Cohere: one norm before attention and MLP
            shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if c.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (hidden,)
        if c.sandwich_norms or c.post_norms:
            shapes[p + "post_feedforward_layernorm.weight"] = (hidden,)
        if c.is_moe_layer(i):
            shapes.update(_moe_shapes(c, p))
        elif ARCHITECTURES[c.architecture].fused_mlp:  # gate and up in one tensor
            shapes.update(_fused_mlp_shapes(p + "mlp.", ("intermediate_size",
                                                         c.intermediate_size), hidden, c.mlp_bias))
        else:
            shapes.update(_dense_mlp_shapes(c, p + "mlp."))
    return shapes


def _dense_mlp_shapes(c: _C.ModelConfig, p: str) -> dict[str, tuple[Dim, ...]]:
    """A dense MLP's tensors: gate, up and down, or up and down without a gate."""
    inter, hidden = ("intermediate_size", c.intermediate_size), ("hidden_size", c.hidden_size)
    if c.gated_mlp:
        return _mlp_shapes(p, inter, hidden, c.mlp_bias)
    shapes = {p + "up_proj.weight": (inter, hidden), p + "down_proj.weight": (hidden, inter)}
    if c.mlp_bias:
        shapes[p + "up_proj.bias"], shapes[p + "down_proj.bias"] = (inter,), (hidden,)
    return shapes


def _mixer_shapes(c: _C.ModelConfig, p: str) -> dict[str, tuple[Dim, ...]]:
    """A state-space mixer's tensors (Mamba2's, or Mamba's: _mamba_mixer_shapes)."""
    s = c.ssm
    if s.kind == "mamba":
        return _mamba_mixer_shapes(c, p)
    hidden = ("hidden_size", c.hidden_size)
    heads = ("num_heads", s.num_heads)
    inner = ("num_heads*head_dim", s.inner_size)
    conv = ("num_heads*head_dim+2*n_groups*state_size", s.conv_dim)
    projected = ("2*num_heads*head_dim+2*n_groups*state_size+num_heads",
                 s.inner_size + s.conv_dim + s.num_heads)
    shapes = {p + "in_proj.weight": (projected, hidden), p + "out_proj.weight": (hidden, inner),
              p + "conv1d.weight": (conv, ("1", 1), ("conv_kernel", s.conv_kernel)),
              p + "dt_bias": (heads,), p + "A_log": (heads,), p + "D": (heads,)}
    if s.norm != "gate_only":
        shapes[p + "norm.weight"] = (inner,)
    if s.conv_bias:
        shapes[p + "conv1d.bias"] = (conv,)
    if s.proj_bias:
        shapes[p + "in_proj.bias"] = (projected,)
    if s.out_proj_bias:
        shapes[p + "out_proj.bias"] = (hidden,)
    return shapes


def _mamba_mixer_shapes(c: _C.ModelConfig, p: str) -> dict[str, tuple[Dim, ...]]:
    """A Mamba mixer's tensors, as the checkpoint names them."""
    s = c.ssm
    hidden = ("hidden_size", c.hidden_size)
    inner, states = ("intermediate_size", s.inner_size), ("state_size", s.state_size)
    rank = ("time_step_rank", s.time_step_rank)
    shapes = {p + "in_proj.weight": (("2*intermediate_size", 2 * s.inner_size), hidden),
              p + "x_proj.weight": (("time_step_rank+2*state_size",
                                     s.time_step_rank + 2 * s.state_size), inner),
              p + "dt_proj.weight": (inner, rank), p + "dt_proj.bias": (inner,),
              p + "out_proj.weight": (hidden, inner),
              p + "conv1d.weight": (inner, ("1", 1), ("conv_kernel", s.conv_kernel)),
              p + "A_log": (inner, states), p + "D": (inner,)}
    if s.conv_bias:
        shapes[p + "conv1d.bias"] = (inner,)
    if s.proj_bias:
        shapes[p + "in_proj.bias"] = (("2*intermediate_size", 2 * s.inner_size),)
    if s.out_proj_bias:
        shapes[p + "out_proj.bias"] = (hidden,)
    if s.dt_bc_norm == "weighted":
        shapes.update({p + "dt_layernorm.weight": (rank,), p + "b_layernorm.weight": (states,),
                       p + "c_layernorm.weight": (states,)})
    return shapes


def _attention_shapes(c: _C.ModelConfig, p: str, layer: int) -> dict[str, tuple[Dim, ...]]:
    hidden, head = ("hidden_size", c.hidden_size), ("head_dim", c.head_dim)
    q = ("num_attention_heads*head_dim", c.num_heads * c.head_dim)
    kv = ("num_key_value_heads*head_dim", c.num_kv_heads * c.head_dim)
    shapes = {}
    shares = c.kv_source(layer) != layer  # CLA: queries only, the KV is an earlier layer's
    projections = [("q_proj", q)] if shares else [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
    for name, out in projections:
        shapes[f"{p}self_attn.{name}.weight"] = (out, hidden)
        if c.qkv_bias:
            shapes[f"{p}self_attn.{name}.bias"] = (out,)
    shapes[p + "self_attn.o_proj.weight"] = (hidden, q)
    if c.o_proj_bias:
        shapes[p + "self_attn.o_proj.bias"] = (hidden,)
    if c.attention_sinks:
        shapes[p + "self_attn.sinks"] = (("num_attention_heads", c.num_heads),)
    if c.qk_norm:  # per head, or over all heads at once (OLMo 2)
        shapes[p + "self_attn.q_norm.weight"] = (q if c.qk_norm_full_width else head,)
        if not shares:
            shapes[p + "self_attn.k_norm.weight"] = (kv if c.qk_norm_full_width else head,)
    return shapes


def _mla_shapes(c: _C.ModelConfig, p: str) -> dict[str, tuple[Dim, ...]]:
    m, a = c.mla, p + "self_attn."
    hidden = ("hidden_size", c.hidden_size)
    q = ("num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim)", c.num_heads * m.qk_head_dim)
    kv_a = ("kv_lora_rank+qk_rope_head_dim", m.kv_lora_rank + m.qk_rope_head_dim)
    latent = ("kv_lora_rank", m.kv_lora_rank)
    shapes = {}
    if m.q_lora_rank:
        q_lora = ("q_lora_rank", m.q_lora_rank)
        shapes[a + "q_a_proj.weight"] = (q_lora, hidden)
        if c.qkv_bias:
            shapes[a + "q_a_proj.bias"] = (q_lora,)
        shapes[a + "q_a_layernorm.weight"] = (q_lora,)
        shapes[a + "q_b_proj.weight"] = (q, q_lora)
    else:
        shapes[a + "q_proj.weight"] = (q, hidden)
    shapes[a + "kv_a_proj_with_mqa.weight"] = (kv_a, hidden)
    if c.qkv_bias:
        shapes[a + "kv_a_proj_with_mqa.bias"] = (kv_a,)
    shapes[a + "kv_a_layernorm.weight"] = (latent,)
    shapes[a + "kv_b_proj.weight"] = (
        ("num_attention_heads*(qk_nope_head_dim+v_head_dim)",
         c.num_heads * (m.qk_nope_head_dim + m.v_head_dim)), latent)
    shapes[a + "o_proj.weight"] = (hidden, ("num_attention_heads*v_head_dim",
                                            c.num_heads * m.v_head_dim))
    if c.o_proj_bias:
        shapes[a + "o_proj.bias"] = (hidden,)
    return shapes


def _mlp_shapes(p: str, inter: Dim, hidden: Dim, bias: bool,
                names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                ) -> dict[str, tuple[Dim, ...]]:
    shapes = {}
    for name, shape in zip(names, ((inter, hidden), (inter, hidden), (hidden, inter))):
        shapes[f"{p}{name}.weight"] = shape
        if bias:
            shapes[f"{p}{name}.bias"] = shape[:1]
    return shapes


def _fused_mlp_shapes(p: str, inter: Dim, hidden: Dim, bias: bool) -> dict[str, tuple[Dim, ...]]:
    """An MLP whose gate and up projections are one tensor."""
    both = ("2*" + inter[0], 2 * inter[1])
    shapes = {p + "gate_up_proj.weight": (both, hidden), p + "down_proj.weight": (hidden, inter)}
    if bias:
        shapes[p + "gate_up_proj.bias"] = (both,)
        shapes[p + "down_proj.bias"] = (hidden,)
    return shapes


def moe_names(c: _C.ModelConfig, p: str) -> tuple[str, tuple[str, str, str]]:
    """Where a layer's MoE weights live: its module prefix (Mixtral's block_sparse_moe or mlp)
    and the names of an expert's gate, up and down projections."""
    if c.architecture == "MixtralForCausalLM":
        return p + "block_sparse_moe.", ("w1", "w3", "w2")
    return p + "mlp.", ("gate_proj", "up_proj", "down_proj")


def _moe_shapes(c: _C.ModelConfig, p: str) -> dict[str, tuple[Dim, ...]]:
    m = c.moe
    hidden = ("hidden_size", c.hidden_size)
    experts = ("num_experts", m.num_experts)
    prefix, names = moe_names(c, p)
    shapes = {prefix + "gate.weight": (experts, hidden)}
    if m.router_bias:
        shapes[prefix + "gate.bias"] = (experts,)
    if m.scoring_func == "sigmoid":
        shapes[prefix + "gate.e_score_correction_bias"] = (experts,)
    inter = ("moe_intermediate_size", m.moe_intermediate_size)
    arch = ARCHITECTURES[c.architecture]
    if m.activation == "relu2":  # Nemotron-H: no gate, maybe a latent space
        return {**shapes, **_ungated_moe_shapes(c, prefix)}
    inter2 = ("2*moe_intermediate_size", 2 * m.moe_intermediate_size)
    if arch.stacked_experts == "columns":  # gpt-oss: transposed, with biases
        shapes[prefix + "experts.gate_up_proj.weight"] = (experts, hidden, inter2)
        shapes[prefix + "experts.down_proj.weight"] = (experts, inter, hidden)
    elif arch.stacked_experts:
        shapes[prefix + "experts.gate_up_proj.weight"] = (experts, inter2, hidden)
        shapes[prefix + "experts.down_proj.weight"] = (experts, hidden, inter)
    if arch.stacked_experts and m.expert_bias:
        shapes[prefix + "experts.gate_up_proj.bias"] = (experts, inter2)
        shapes[prefix + "experts.down_proj.bias"] = (experts, hidden)
    if not arch.stacked_experts:
        for e in range(m.num_experts):
            shapes.update(_mlp_shapes(f"{prefix}experts.{e}.", inter, hidden, False, names))
    if m.shared_intermediate_size:
        shared = ("n_shared_experts*moe_intermediate_size", m.shared_intermediate_size)
        if arch.fused_mlp:  # Granite's shared MLP
            shapes.update(_fused_mlp_shapes(prefix + "shared_experts.",
                                            ("shared_intermediate_size", shared[1]), hidden, False))
        else:
            shapes.update(_mlp_shapes(prefix + "shared_experts.", shared, hidden, False))
    return shapes


def _ungated_moe_shapes(c: _C.ModelConfig, prefix: str) -> dict[str, tuple[Dim, ...]]:
    """Experts without a gate (up, down) on the hidden state or its latent projection
    (fc1_latent_proj, fc2_latent_proj), and the shared expert of that form."""
    m, shapes = c.moe, {}
    hidden = ("hidden_size", c.hidden_size)
    width = ("moe_latent_size", m.latent_size) if m.latent_size else hidden
    inter = ("moe_intermediate_size", m.moe_intermediate_size)
    for e in range(m.num_experts):
        shapes[f"{prefix}experts.{e}.up_proj.weight"] = (inter, width)
        shapes[f"{prefix}experts.{e}.down_proj.weight"] = (width, inter)
    shared = ("moe_shared_expert_intermediate_size", m.shared_intermediate_size)
    for name, shape in (("shared_experts.up_proj", (shared, hidden)),
                        ("shared_experts.down_proj", (hidden, shared))):
        shapes[f"{prefix}{name}.weight"] = shape
        if c.mlp_bias:
            shapes[f"{prefix}{name}.bias"] = shape[:1]
    if m.latent_size:
        for name, shape in (("fc1_latent_proj", (width, hidden)),
                            ("fc2_latent_proj", (hidden, width))):
            shapes[f"{prefix}{name}.weight"] = shape
            if c.mlp_bias:
                shapes[f"{prefix}{name}.bias"] = shape[:1]
    return shapes


def _stored(name: str, info) -> str:
    """A tensor as its file names it, with kvserve's name when Architecture.weight_names
    renamed it."""
    return f"'{name}'" if info.name == name else f"'{info.name}' (kvserve's '{name}')"


def check_weights(index: WeightIndex, c: _C.ModelConfig, config_path: Path,
                  quant: CheckpointQuantization | None = None, mxfp4: bool = False,
                  vocab: bool = True) -> None:
    """Raises ValueError listing every tensor that is missing, unexpected, of another dtype or of
    another shape than config.json (and its quantization_config) implies. mxfp4: gpt-oss's
    stacked experts come as MXFP4 blocks and scales (kvserve.quantization.mxfp4). vocab false:
    the index holds no embedding or LM head (a multi-token-prediction module's layers)."""
    _check_num_layers(index, c, config_path)
    expected: dict[str, tuple[tuple[Dim, ...], tuple[str, ...]]] = {}
    optional: set[str] = set()
    for name, dims in expected_shapes(c).items():
        if not vocab and name in ("model.embed_tokens.weight", "lm_head.weight"):
            continue
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and len(dims) == 2
        if mxfp4 and ".mlp.experts." in name and name.endswith(".weight") and len(dims) == 3:
            experts, cols, rows = dims  # stored transposed: [experts, in, out]
            groups = (f"{cols[0]}/32", cols[1] // 32)
            expected[module + ".blocks"] = ((experts, rows, groups, ("16", 16)), ("U8",))
            expected[module + ".scales"] = ((experts, rows, groups), ("U8",))
        elif quant is not None and linear and quant.covers(module):
            layout = f"{quant.method} layout of [{dims[0][1]}, {dims[1][1]}]"
            for qname, (shape, dtypes) in quant.expected(module, dims[0][1], dims[1][1]).items():
                expected[qname] = (tuple((layout, size) for size in shape), dtypes)
            optional.update(quant.optional(module))
        else:
            expected[name] = (dims, FLOAT_DTYPES)
    problems = []
    for name, (dims, dtypes) in expected.items():
        info = index.tensors.get(name)
        if info is None:
            untied = name == "lm_head.weight"
            hint = " (config.json has tie_word_embeddings false)" if untied else ""
            problems.append(f"{index.source} has no tensor '{name}'{hint}")
        elif info.dtype not in dtypes:
            kind = "float weights" if dtypes == FLOAT_DTYPES else "here"
            problems.append(f"{info.file}: tensor {_stored(name, info)} has dtype {info.dtype}; "
                            f"kvserve loads "
                            f"{kind} ({', '.join(dtypes)})")
        elif info.shape != tuple(size for _, size in dims):
            implied = ", ".join(f"{field}={size}" for field, size in dims)
            problems.append(f"{info.file}: tensor {_stored(name, info)} has shape "
                            f"{list(info.shape)}, but "
                            f"{config_path.name} implies [{implied}]")
    for name, info in index.tensors.items():
        if name not in expected and name not in optional and not _ignored(name, c):
            problems.append(f"{info.file}: tensor {_stored(name, info)} is not part of the "
                            f"model that "
                            f"{config_path.name} describes (check num_hidden_layers, "
                            "attention_bias, mlp_bias)")
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        shown = problems[:_MAX_PROBLEMS_SHOWN]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more")
        raise ValueError(f"the weights do not match {config_path} ({len(problems)} problems):\n  "
                         + "\n  ".join(shown))


def _check_num_layers(index: WeightIndex, c: _C.ModelConfig, config_path: Path) -> None:
    """When the weights hold whole layers 0..n-1, a different num_hidden_layers reads better as
    one line than as a list of every tensor of the missing or surplus layers."""
    per_layer = Counter(int(m.group(1)) for name in index.tensors
                        if (m := re.match(r"model\.layers\.(\d+)\.", name)))
    n = len(per_layer)
    whole = set(per_layer) == set(range(n)) and len(set(per_layer.values())) == 1
    if n and whole and n != c.num_layers:
        raise ValueError(f"{config_path}: num_hidden_layers is {c.num_layers}, but "
                         f"{index.source} holds {n} layers")


def _ignored(name: str, c: _C.ModelConfig) -> bool:
    """Tensors some checkpoints carry that the model does not need: RoPE tables, a tied LM head,
    DeepSeek-V3's and GLM-4.5's multi-token-prediction layers (numbered after the last decoder
    layer)."""
    if name.endswith("rotary_emb.inv_freq") or (c.tie_word_embeddings and name == "lm_head.weight"):
        return True
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return (c.architecture in ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
            and layer is not None and int(layer.group(1)) >= c.num_layers)
