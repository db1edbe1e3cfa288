"""config.json fields read the way transformers' own config classes read them: which layers slide
(Qwen's max_window_layers, Gemma's alternating and 5:1 patterns, use_sliding_window off), Gemma's
defaults and its per-layer-type RoPE, in the file formats of old and new transformers versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.config import _model_config

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=384, hidden_size=96, intermediate_size=160, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24,
            max_position_embeddings=256)


def read(architecture: str, **fields):
    return _model_config({"architectures": [architecture], **BASE, **fields}, Path("config.json"))


def hf_windows(model_type: str, **fields) -> list[int]:
    """Per layer: the window transformers' config gives the layer (0: full attention)."""
    config = transformers.AutoConfig.for_model(model_type, **BASE, **fields)
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * BASE[
        "num_hidden_layers"]  # Mistral: one window for every layer
    return [config.sliding_window if t == "sliding_attention" and config.sliding_window else 0
            for t in types]


@pytest.mark.parametrize("architecture, model_type, fields", [
    ("Qwen2ForCausalLM", "qwen2", dict(use_sliding_window=True, sliding_window=16,
                                       max_window_layers=2)),
    ("Qwen2ForCausalLM", "qwen2", dict(use_sliding_window=True, sliding_window=16)),  # 28 > 6
    ("Qwen2ForCausalLM", "qwen2", dict(use_sliding_window=False, sliding_window=16,
                                       max_window_layers=0)),
    ("Qwen3ForCausalLM", "qwen3", dict(use_sliding_window=True, sliding_window=8,
                                       max_window_layers=4)),
    ("MistralForCausalLM", "mistral", dict(sliding_window=8)),
    ("Gemma2ForCausalLM", "gemma2", dict(sliding_window=8)),
    ("Gemma3ForCausalLM", "gemma3_text", dict(sliding_window=8)),
    ("Gemma3ForCausalLM", "gemma3_text", dict(sliding_window=8, sliding_window_pattern=3)),
])
def test_sliding_layers_as_transformers_derives_them(architecture, model_type, fields):
    assert read(architecture, **fields).sliding_windows == hf_windows(model_type, **fields)


def test_use_sliding_window_off_overrides_layer_types():
    c = read("Qwen2ForCausalLM", use_sliding_window=False, sliding_window=16,
             layer_types=["sliding_attention"] * 6)
    assert c.sliding_windows == [0] * 6


def test_gemma2_defaults_are_transformers_defaults():
    hf = transformers.AutoConfig.for_model("gemma2", **BASE)
    c = read("Gemma2ForCausalLM")
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (hf.attn_logit_softcapping,
                                                              hf.final_logit_softcapping)
    assert c.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert c.tie_word_embeddings and c.sandwich_norms and c.norm_weight_offset == 1.0
    assert c.hidden_act == "gelu_pytorch_tanh" and c.embedding_multiplier == 96 ** 0.5
    assert c.rope_local_theta == 0.0 and c.rope_theta == 10000.0


@pytest.mark.parametrize("rope", [
    # transformers < 5: global rope_theta and rope_scaling, the local base apart
    dict(rope_theta=500000.0, rope_local_base_freq=20000.0,
         rope_scaling={"rope_type": "linear", "factor": 8.0}),
    # transformers >= 5: one entry per layer type
    dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                             "rope_theta": 500000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}),
])
def test_gemma3_rope_per_layer_type(rope):
    c = read("Gemma3ForCausalLM", **rope)
    assert c.rope_theta == 500000.0 and c.rope_local_theta == 20000.0
    assert c.rope_scaling.rope_type == "linear" and c.rope_scaling.factor == 8.0
    assert c.qk_norm and c.attn_logit_softcap == 0.0 and c.final_logit_softcap == 0.0


def test_gemma3_defaults():
    c = read("Gemma3ForCausalLM")
    assert (c.rope_theta, c.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert c.sliding_windows == [4096] * 5 + [0]


@pytest.mark.parametrize("architecture, fields, fragment", [
    ("Gemma2ForCausalLM", dict(hidden_activation="gelu"), "'hidden_activation' is 'gelu'"),
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True),
     "'use_bidirectional_attention' is set"),
    ("Gemma3ForCausalLM", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "scales the sliding_attention layers' RoPE"),
    ("Gemma2ForCausalLM", dict(attn_logit_softcapping=-1.0),
     "'attn_logit_softcapping' must be a positive number or null"),
    ("Gemma2ForCausalLM", dict(sliding_window_pattern=0), "'sliding_window_pattern'"),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=-1),
     "'max_window_layers' must be an integer >= 0"),
])
def test_bad_fields(architecture, fields, fragment):
    with pytest.raises(ValueError) as error:
        read(architecture, **fields)
    assert fragment in str(error.value)
