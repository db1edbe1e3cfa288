"""Malformed checkpoints of the state-space families (test_malformed_checkpoint.py's corpus,
their config fields and weights): each must raise a clear ValueError naming the file and the
field or tensor at fault."""

from __future__ import annotations

import pytest

from tests.models.test_malformed_checkpoint import DELETE, expect_family_error
from tests.models.test_malformed_checkpoint import no_hang  # noqa: F401  (autouse)

# The mixers' fields, which layers have them, and the hybrids' own fields (the tiny configs:
# Mamba2 20 heads of 12 in 5 groups, expand 2 of hidden 120, 3 layers; Mamba and FalconMamba 88
# channels of 10 states, a time step of rank 5, 3 taps, hidden 48; Granite 4 and Bamba 12 heads
# of 16 in 3 groups, expand 2 of hidden 96, 4 layers).
CASES = [
    ("Mamba2ForCausalLM", {"n_groups": 3}, "'n_groups' (3) must divide num_heads (20)"),
    ("Mamba2ForCausalLM", {"conv_kernel": 1}, "'conv_kernel' is 1; kvserve runs kernels of 2"),
    ("Mamba2ForCausalLM", {"conv_kernel": 64}, "'conv_kernel' is 64; kvserve runs kernels of 2"),
    ("Mamba2ForCausalLM", {"head_dim": 7}, "'head_dim' * num_heads (140) must equal expand"),
    ("Mamba2ForCausalLM", {"state_size": 0}, "'state_size' must be a positive integer"),
    ("Mamba2ForCausalLM", {"state_size": 1 << 30}, "'state_size' is 1073741824, more than"),
    ("Mamba2ForCausalLM", {"num_heads": "20"}, "'num_heads' must be a positive integer"),
    ("Mamba2ForCausalLM", {"time_step_limit": [1.0, 0.5]}, "'time_step_limit' must be [min, max]"),
    ("Mamba2ForCausalLM", {"time_step_limit": [0.0, float("nan")]},
     "'time_step_limit' must be [min, max]"),
    ("Mamba2ForCausalLM", {"time_step_limit": "none"}, "'time_step_limit' must be [min, max]"),
    ("Mamba2ForCausalLM", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ("GraniteMoeHybridForCausalLM", {"layer_types": ["mamba"] * 3},
     "'layer_types' must list 'mamba' or 'attention' for each of the 4 layers"),
    ("GraniteMoeHybridForCausalLM", {"layer_types": ["mamba", "attention", "conv", "mamba"]},
     "'layer_types' must list 'mamba' or 'attention'"),
    ("GraniteMoeHybridForCausalLM", {"position_embedding_type": "alibi"},
     "'position_embedding_type' is 'alibi'; expected rope or none"),
    ("GraniteMoeHybridForCausalLM", {"mamba_d_head": 10}, "'mamba_d_head' * mamba_n_heads (120)"),
    ("GraniteMoeHybridForCausalLM", {"shared_intermediate_size": DELETE},
     "missing required field 'shared_intermediate_size'"),
    ("GraniteMoeHybridForCausalLM", {"num_experts_per_tok": 5},
     "'num_experts_per_tok' (5) exceeds the number of experts (4)"),
    # Experts that config.json announces and the weights lack, or leaves out of config.json.
    ("GraniteMoeHybridForCausalLM", {"num_local_experts": 6},
     "model.layers.0.mlp.experts.gate_up_proj.weight"),
    ("GraniteMoeHybridForCausalLM", {"num_local_experts": 0}, "block_sparse_moe"),
    ("BambaForCausalLM", {"attn_layer_indices": [4]},
     "'attn_layer_indices' must list layer indices in [0, 4)"),
    ("BambaForCausalLM", {"attn_layer_indices": "1"}, "'attn_layer_indices' must list"),
    ("BambaForCausalLM", {"attn_layer_indices": [True]}, "'attn_layer_indices' must list"),
    ("BambaForCausalLM", {"mamba_n_groups": 5}, "'mamba_n_groups' (5) must divide mamba_n_heads"),
    ("BambaForCausalLM", {"hidden_act": "relu"}, "'hidden_act' is 'relu'; only silu"),
    # Bamba rotates half of each head: heads of 6 would leave 3 dims, an odd number.
    ("BambaForCausalLM", {"num_attention_heads": 16, "head_dim": 6},
     "'partial_rotary_factor' is 0.5: head_dim (6) times it must be a positive even number"),
    ("FalconH1ForCausalLM", {"mamba_d_ssm": 100}, "'mamba_d_head' * mamba_n_heads (120) must "
                                                  "equal mamba_d_ssm (100)"),
    ("FalconH1ForCausalLM", {"key_multiplier": 0}, "'key_multiplier' must be a finite number > 0"),
    ("FalconH1ForCausalLM", {"lm_head_multiplier": "2"}, "'lm_head_multiplier' must be a finite"),
    ("FalconH1ForCausalLM", {"ssm_multipliers": [1.0, 1.0]},
     "'ssm_multipliers' must list 5 finite numbers > 0"),
    ("FalconH1ForCausalLM", {"mlp_multipliers": [1.0, float("inf")]},
     "'mlp_multipliers' must list 2 finite numbers > 0"),
    ("FalconH1ForCausalLM", {"mamba_rms_norm": "yes"}, "'mamba_rms_norm' must be true or false"),
    # A norm that config.json announces and the weights lack.
    ("FalconH1ForCausalLM", {"mamba_rms_norm": True}, "model.layers.0.mixer.norm.weight"),
    ("FalconH1ForCausalLM", {"projectors_bias": True}, "model.layers.0.mixer.out_proj.bias"),
    # Nemotron-H (tiny: mixer, MLP, attention, mixer, MLP; 12 mixer heads of 16 in 3 groups).
    ("NemotronHForCausalLM", {"layers_block_type": ["linear_attention", "moe", "full_attention",
                                                    "linear_attention", "mlp"],
                              "n_routed_experts": 0},
     "'n_routed_experts' must be a positive integer"),
    ("NemotronHForCausalLM", {"layers_block_type": ["linear_attention", "moe", "full_attention",
                                                    "linear_attention", "mlp"],
                              "moe_latent_size": 0},
     "'moe_latent_size' must be a positive integer"),
    # An MoE layer in the config where the weights have an MLP: its router is missing.
    ("NemotronHForCausalLM", {"layers_block_type": ["linear_attention", "moe", "full_attention",
                                                    "linear_attention", "mlp"]},
     "model.layers.1.mlp.gate.weight"),
    ("NemotronHForCausalLM", {"layers_block_type": ["linear_attention", "conv", "full_attention",
                                                    "linear_attention", "mlp"]},
     "'layers_block_type' names unknown layer kinds ['conv']"),
    ("NemotronHForCausalLM", {"layers_block_type": None, "hybrid_override_pattern": "M-*MX"},
     "'hybrid_override_pattern' names unknown layer kinds ['X']"),
    ("NemotronHForCausalLM", {"layers_block_type": None, "hybrid_override_pattern": 5},
     "missing required field 'num_hidden_layers'"),
    ("NemotronHForCausalLM", {"mlp_hidden_act": "silu"}, "'mlp_hidden_act' is 'silu'; only relu2"),
    ("NemotronHForCausalLM", {"mamba_hidden_act": "gelu"},
     "'mamba_hidden_act' is 'gelu'; only silu"),
    ("NemotronHForCausalLM", {"n_groups": 5}, "'n_groups' (5) must divide mamba_num_heads (12)"),
    ("NemotronHForCausalLM", {"mamba_head_dim": 0}, "'mamba_head_dim' must be a positive integer"),
    # An MLP layer's weights as another kind's: the mixer's tensors are missing.
    ("NemotronHForCausalLM", {"layers_block_type": ["linear_attention", "linear_attention",
                                                    "full_attention", "linear_attention", "mlp"]},
     "model.layers.1.mixer.in_proj.weight"),
    ("MambaForCausalLM", {"conv_kernel": 1}, "'conv_kernel' is 1; kvserve runs kernels of 2"),
    ("MambaForCausalLM", {"time_step_rank": 0}, "'time_step_rank' must be a positive integer"),
    ("MambaForCausalLM", {"time_step_rank": 1 << 20}, "'time_step_rank' is 1048576, more than"),
    ("MambaForCausalLM", {"state_size": "10"}, "'state_size' must be a positive integer"),
    ("MambaForCausalLM", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    # Sizes that config.json states and the weights do not have: "auto" is ceil(48 / 16) = 3.
    ("MambaForCausalLM", {"time_step_rank": "auto"}, "model.layers.0.mixer.x_proj.weight"),
    ("MambaForCausalLM", {"intermediate_size": 90}, "model.layers.0.mixer."),
    ("MambaForCausalLM", {"state_size": 12}, "model.layers.0.mixer."),
    ("MambaForCausalLM", {"use_bias": True}, "model.layers.0.mixer.in_proj.bias"),
    ("FalconMambaForCausalLM", {"mixer_rms_eps": 0}, "'mixer_rms_eps' must be a finite number"),
    # Jamba (tiny: mixers in layers 0 and 2, attention in 1 and 3 with 8 experts after them).
    ("JambaForCausalLM", {"attn_layer_offset": 2}, "'attn_layer_offset' (2) must be less than "
                                                   "attn_layer_period (2)"),
    ("JambaForCausalLM", {"expert_layer_period": 0}, "'expert_layer_period' must be a positive"),
    ("JambaForCausalLM", {"num_experts_per_tok": 9}, "'num_experts_per_tok' (9) exceeds the "
                                                     "number of experts (8)"),
    ("JambaForCausalLM", {"mamba_dt_rank": "5"}, "'mamba_dt_rank' must be a positive integer"),
    ("JambaForCausalLM", {"hidden_act": "gelu"}, "'hidden_act' is 'gelu'; only silu"),
    # Layers the config moves: experts, attention and mixers where the weights have others.
    ("JambaForCausalLM", {"expert_layer_offset": 0}, "model.layers.0.mlp.gate.weight"),
    ("JambaForCausalLM", {"attn_layer_offset": 0}, "model.layers.0.self_attn.q_proj.weight"),
    ("JambaForCausalLM", {"num_experts": 1}, "mlp.experts"),
]


@pytest.mark.parametrize("architecture, changes, fragment", CASES)
def test_bad_state_model_config_field(checkpoint_factory, tmp_path, architecture, changes,
                                      fragment):
    expect_family_error(checkpoint_factory(architecture), tmp_path, changes, fragment)
