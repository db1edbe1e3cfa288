"""Cross-layer KV sharing (CLA) in plain PyTorch on transformers' Llama: the reference for kvserve's
`kv_sharing` config extension, and the model scripts/train_tiny.py trains when asked to share.

A config.json with ``"kv_sharing": {"1": 0, "3": 2}`` describes a Llama whose layer 1 attends over
the keys and values of layer 0 (after RoPE) instead of projecting its own, and layer 3 over layer
2's: those layers have q_proj and o_proj but no k_proj / v_proj, and a serving engine caches KV
for layers 0 and 2 only (Brandon et al. 2024, "Reducing Transformer Key-Value Cache Size with
Cross-Layer Attention"; Character.AI shares KV between neighbouring layers the same way).
transformers has no plain text model that does this, so this module builds one from its Llama
layers: only the attention of the layers involved changes. Needs the ``test`` extra.
"""

from __future__ import annotations

from pathlib import Path

import torch


def kv_sharing_map(config) -> dict[int, int]:
    """{layer: source layer} from a config's kv_sharing (JSON keys are strings)."""
    return {int(layer): int(source) for layer, source in (getattr(config, "kv_sharing", None)
                                                          or {}).items()}


def _attention_class():
    from transformers.models.llama import modeling_llama as llama

    class CrossLayerAttention(llama.LlamaAttention):
        """LlamaAttention that leaves its K/V (after RoPE, after any cache update) in `stash` for
        the layers that share them, or, when `source` is set, reads the source layer's instead
        of projecting its own."""

        def __init__(self, config, layer_idx: int, source: int | None, stash: dict):
            super().__init__(config, layer_idx)
            self.source, self.stash = source, stash
            if source is not None:
                del self.k_proj, self.v_proj

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                    past_key_values=None, **kwargs):
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
            cos, sin = position_embeddings
            if self.source is None:
                key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
                value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
                query, key = llama.apply_rotary_pos_emb(query, key, cos, sin)
                if past_key_values is not None:
                    key, value = past_key_values.update(key, value, self.layer_idx)
                self.stash[self.layer_idx] = (key, value)
            else:
                query, _ = llama.apply_rotary_pos_emb(query, query, cos, sin)
                key, value = self.stash[self.source]
            attend = llama.ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, llama.eager_attention_forward)
            out, weights = attend(self, query, key, value, attention_mask,
                                  dropout=0.0 if not self.training else self.attention_dropout,
                                  scaling=self.scaling, **kwargs)
            return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights

    return CrossLayerAttention


def cla_llama(config):
    """A transformers LlamaForCausalLM (random weights) whose layers share KV as config.kv_sharing
    says. Raises ValueError on a map kvserve would reject."""
    from transformers import LlamaForCausalLM

    sharing = kv_sharing_map(config)
    for layer, source in sharing.items():
        if not 0 <= source < layer < config.num_hidden_layers or source in sharing:
            raise ValueError(f"kv_sharing {layer} -> {source}: a layer may share only the KV of "
                             "an earlier layer that owns its KV")
    model = LlamaForCausalLM(config)
    attention, stash = _attention_class(), {}
    for i, layer in enumerate(model.model.layers):
        shared = attention(config, i, sharing.get(i), stash).to(next(model.parameters()).dtype)
        if i not in sharing:
            shared.load_state_dict(layer.self_attn.state_dict())
        else:
            shared.q_proj.load_state_dict(layer.self_attn.q_proj.state_dict())
            shared.o_proj.load_state_dict(layer.self_attn.o_proj.state_dict())
        layer.self_attn = shared
    return model


def load_cla_llama(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """The model of a kv_sharing checkpoint directory (config.json + safetensors), in eval mode."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    model = cla_llama(config)
    state = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise ValueError(f"{model_dir}: missing {sorted(set(missing) - allowed)}, unexpected "
                         f"{sorted(unexpected)}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


def make_cla_checkpoint(out_dir: str | Path, kv_sharing: dict[int, int],
                        dtype: torch.dtype = torch.float32, seed: int = 0,
                        **config_overrides) -> Path:
    """A tiny random Llama checkpoint (kvserve.testing.checkpoints' shapes) whose layers share KV
    as `kv_sharing` says, with a tokenizer."""
    from kvserve.testing.checkpoints import build_tokenizer, make_config, perturb_norms_and_biases

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = make_config("LlamaForCausalLM", **config_overrides)
    config.kv_sharing = {str(layer): source for layer, source in kv_sharing.items()}
    torch.manual_seed(seed)
    model = cla_llama(config)
    perturb_norms_and_biases(model)
    model.to(dtype).save_pretrained(out_dir)
    build_tokenizer(min(config.vocab_size, 320)).save(str(out_dir / "tokenizer.json"))
    return out_dir
