"""Tiny random Hugging Face checkpoints built with ``transformers`` (the reference
implementation), for tests, benchmarks and the demo. Needs the ``test`` extra.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvserve.architectures import ARCHITECTURES

# Enough text for a byte-level BPE of a few hundred tokens.
_TOKENIZER_TEXT = """\
Once upon a time there was a little engine that served tokens all day long.
It kept its keys and values in a cache, page by page, and never forgot a prefix.
The quick brown fox jumps over the lazy dog; the lazy dog sleeps in the sun.
To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer
the slings and arrows of outrageous fortune, or to take arms against a sea of troubles.
Attention is all you need, they said, and so the heads attended to every token before them.
""" * 4

# Small shapes per architecture (kvserve.architectures); initializer_range is large so that logits
# are far from ties.
TINY_CONFIGS = {name: a.tiny for name, a in ARCHITECTURES.items()}


def build_tokenizer(vocab_size: int = 320):
    """A byte-level BPE trained on a fixed text: ids 0/1/2 = <unk>/<s>/</s>, BOS prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_TOKENIZER_TEXT.splitlines(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def make_config(architecture: str = "LlamaForCausalLM", **overrides):
    """A transformers config of a tiny model of `architecture` (fp32, GQA 4:2, 2 layers)."""
    from transformers import AutoConfig

    spec = dict(TINY_CONFIGS[architecture])
    model_type = spec.pop("model_type")
    kwargs = dict(vocab_size=384, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.15, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    kwargs.update(spec)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    config.architectures = [architecture]
    return config


def perturb_norms_and_biases(model) -> None:
    """Norm weights start at one and biases at zero, attention sinks near zero; random ones make
    a missed norm, bias or sink show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith((".bias", "_proj_bias")):  # gpt-oss's experts: gate_up_proj_bias
                p.normal_(0, 0.5)
            elif name.endswith(".sinks"):  # gpt-oss: some heads mostly sink, some barely
                p.normal_(0, 2.0)
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias starts at zero
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)


def make_checkpoint(out_dir: str | Path, architecture: str = "LlamaForCausalLM",
                    dtype: torch.dtype = torch.float32, seed: int = 0,
                    max_shard_size: str | None = None, with_tokenizer: bool = True,
                    **config_overrides) -> Path:
    """Writes config.json, safetensors weights (sharded when max_shard_size is given) and a
    tokenizer.json for a randomly initialised model. Returns the directory."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = make_config(architecture, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_norms_and_biases(model)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    if with_tokenizer:
        build_tokenizer(min(config.vocab_size, 320)).save(str(out_dir / "tokenizer.json"))
    return out_dir


def add_mtp_modules(model_dir: str | Path, count: int = 1, seed: int = 0) -> Path:
    """Gives a DeepSeek-V3 or GLM-4.5 checkpoint that make_checkpoint wrote `count` random
    multi-token-prediction modules (transformers' MtpModel, its norms perturbed), stored as the
    released checkpoints store them: model.layers.<N + d>.{enorm, hnorm, eh_proj,
    shared_head.norm} and the module's decoder layer, experts one by one, in a second shard
    (the checkpoint's model.safetensors becomes the first, under an index); config.json's
    num_nextn_predict_layers becomes `count`."""
    import json
    import re

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["num_nextn_predict_layers"] = count
    config_path.write_text(json.dumps(config, indent=2))
    main = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    mtp = MtpModel(main, count)
    # Every module tensor drawn here: MtpModel leaves some (the experts, the router) as they
    # were allocated, which from_pretrained would fill but a model built directly does not.
    with torch.no_grad():
        for name, t in [*mtp.named_parameters(), *mtp.named_buffers()]:
            if not name.startswith("layers."):  # the target's embedding and LM head
                continue
            if "norm" in name:
                t.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                t.zero_()
            else:
                t.normal_(0.0, main.config.initializer_range)
    perturb_norms_and_biases(mtp)
    first = main.config.num_hidden_layers
    tensors = {}
    for name, t in mtp.state_dict().items():
        m = re.fullmatch(r"layers\.(\d+)\.(.*)", name)
        if m is None:  # the target's embedding and LM head
            continue
        prefix, rest = f"model.layers.{first + int(m.group(1))}.", m.group(2)
        rest = rest.removeprefix("mtp_block.")
        if rest.startswith("post_norm."):
            rest = "shared_head.norm." + rest.removeprefix("post_norm.")
        if rest == "mlp.experts.gate_up_proj":  # [experts, gate rows + up rows, hidden]
            for e, fused in enumerate(t):
                gate, up = fused.chunk(2)
                tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
                tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up.contiguous()
        elif rest == "mlp.experts.down_proj":
            for e, down in enumerate(t):
                tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] = down.contiguous()
        else:
            tensors[prefix + rest] = t.contiguous()
    # Two shards under an index (transformers reads a lone model.safetensors without one).
    main_file, mtp_file = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    (model_dir / "model.safetensors").rename(model_dir / main_file)
    save_file(tensors, model_dir / mtp_file, metadata={"format": "pt"})
    with safe_open(str(model_dir / main_file), framework="pt") as f:
        weight_map = {name: main_file for name in f.keys()}
    weight_map.update({name: mtp_file for name in tensors})
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return model_dir


def make_eagle3_head(out_dir: str | Path, target_dir: str | Path, draft_vocab_size: int,
                     aux_layers: list[int] | None = None, seed: int = 0, **overrides) -> Path:
    """Writes a random EAGLE-3 head for the Llama-family checkpoint at `target_dir`, in the
    published heads' layout (kvserve.loader.eagle3_weights): its config.json (the target's
    shapes unless `overrides` says otherwise; aux_layers as eagle_aux_hidden_state_layer_ids,
    None: the default) and model.safetensors with fc, midlayer.*, norm, lm_head over
    `draft_vocab_size` tokens, d2t (every other target id from 3 on, after ids 0-2) and t2d."""
    import json

    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = {k: target[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                     "num_key_value_heads", "max_position_embeddings",
                                     "rms_norm_eps", "rope_theta", "vocab_size")
              if k in target}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                  num_hidden_layers=1, draft_vocab_size=draft_vocab_size, hidden_act="silu",
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **overrides)
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    streams = len(aux_layers) if aux_layers is not None else 3

    def rand(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1.0 + rand(n, std=0.2)

    tensors = {
        "fc.weight": rand(hidden, streams * target["hidden_size"], std=0.08),
        "midlayer.input_layernorm.weight": norm(hidden),
        "midlayer.hidden_norm.weight": norm(hidden),
        "midlayer.post_attention_layernorm.weight": norm(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": norm(hidden),
        "lm_head.weight": rand(draft_vocab_size, hidden),
    }
    # The draft vocabulary: ids 0-2 (specials), then the odd ids from 3 on, then the even ones.
    vocab = config["vocab_size"]
    order = [0, 1, 2] + list(range(3, vocab, 2)) + list(range(4, vocab, 2))
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"a draft vocabulary of {draft_vocab_size} does not fit in {vocab} ids")
    target_ids = torch.tensor(sorted(order[:draft_vocab_size]))
    tensors["d2t"] = target_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[target_ids] = True
    tensors["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors",
              metadata={"format": "pt"})
    return out_dir
