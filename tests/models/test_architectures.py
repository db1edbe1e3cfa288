"""The architecture table is the one list: each entry's config parses to its family and flags,
every family it names has a C++ class, and anything else is refused by name."""

from __future__ import annotations

import json

import pytest

from kvserve import _C
from kvserve.architectures import ARCHITECTURES
from kvserve.config import load_checkpoint_info
from tests.conftest import ARCHITECTURES as TESTED


def test_every_entry_is_tested_and_has_a_cpp_family():
    assert TESTED == list(ARCHITECTURES)
    assert {a.family for a in ARCHITECTURES.values()} <= set(_C.model_families())


# Architectures whose mixtures of experts are layers of some configs only (Nemotron-H's E,
# which its tiny config has none of): the overrides that give one.
MOE_IN_SOME_CONFIGS = {"NemotronHForCausalLM": dict(
    layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=16)}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_a_checkpoint_parses_to_its_entry(checkpoint_factory, name):
    entry = ARCHITECTURES[name]
    path = checkpoint_factory(name)
    c = load_checkpoint_info(path).config
    assert (c.architecture, c.family, c.qk_norm) == (name, entry.family, entry.qk_norm)
    # attention_bias defaults to true in gpt-oss's config
    written = json.loads((path / "config.json").read_text()).get("attention_bias", False)
    assert c.qkv_bias == (entry.qkv_bias or written)
    assert c.use_mla() == (entry.read_attention is not None)
    if name in MOE_IN_SOME_CONFIGS:
        assert c.moe.num_experts == 0 and entry.read_moe is not None
        variant = checkpoint_factory(name, **MOE_IN_SOME_CONFIGS[name])
        assert load_checkpoint_info(variant).config.moe.num_experts > 0
        return
    assert (c.moe.num_experts > 0) == (entry.read_moe is not None)


def test_an_unknown_family_is_named_with_the_known_ones(checkpoint_factory):
    info = load_checkpoint_info(checkpoint_factory("LlamaForCausalLM"))
    info.config.family = "gpt2"
    with pytest.raises(ValueError, match="unknown model family 'gpt2'.*llama, deepseek_v2"):
        _C.create_causal_lm(info.config, {}, 32)


def test_glm4_moe_rotates_half_of_each_head_when_its_config_is_silent(checkpoint_factory,
                                                                      tmp_path):
    """transformers' Glm4MoeConfig defaults partial_rotary_factor to 0.5; a file without it
    means half."""
    import json
    import shutil

    path = shutil.copytree(checkpoint_factory("Glm4MoeForCausalLM"), tmp_path / "glm")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"].pop("partial_rotary_factor")
    config.pop("partial_rotary_factor", None)
    (path / "config.json").write_text(json.dumps(config))
    c = load_checkpoint_info(path).config
    assert c.rotary_dim == c.head_dim // 2
    config["rope_parameters"]["partial_rotary_factor"] = 1.0
    (path / "config.json").write_text(json.dumps(config))
    assert load_checkpoint_info(path).config.rotary_dim in (0, c.head_dim)
