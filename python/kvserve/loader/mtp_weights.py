"""The multi-token-prediction (MTP) modules that DeepSeek-V3 and GLM-4.5 checkpoints store after
their decoder layers (``num_nextn_predict_layers`` of them, as ``model.layers.<N + d>.*`` for N
decoder layers): each is one decoder layer of the model's own kind (its MLP a mixture of experts,
as transformers' ``get_mtp_config`` makes every MTP layer), plus ``enorm`` and ``hnorm`` (the
RMSNorms of the next token's embedding and of the previous hidden state), ``eh_proj`` (their
concatenation, embedding first, back to the hidden size) and ``shared_head.norm`` (the output
norm before the shared LM head). ``embed_tokens`` and ``shared_head.head`` copies, where a
checkpoint has them, are not read: the target's own are used.

Each module's decoder layer loads as a one-layer model of the target's family (``load_weights``
with a view of the checkpoint whose ``model.layers.0`` is the module and whose final norm is its
``shared_head.norm``). With tensor parallelism each rank reads its shard of those layers, split
as the target's are, and the whole ``enorm``, ``hnorm`` and ``eh_proj``; the modules then run on
every rank beside the target's shard (kvserve/head_proposer.h)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve import _C
from kvserve.architectures import weight_names
from kvserve.config import _model_config
from kvserve.loader.safetensors_loader import _TensorReader, load_weights
from kvserve.loader.sharding import Shard, shard_config
from kvserve.loader.weight_index import WeightIndex
from kvserve.quantization.formats import parse_quantization_config

# The architectures whose checkpoints keep MTP modules in this layout.
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
# A module's own tensors besides its decoder layer (read apart), and the copies of the target's
# embedding and LM head some checkpoints carry in each module (not read).
_MODULE_TENSORS = ("enorm.", "hnorm.", "eh_proj.")
_TARGET_COPIES = ("embed_tokens.", "shared_head.head.")


@dataclass
class MtpWeights:
    """What load_mtp_weights read: the configs and each module's tensors."""

    block_config: _C.ModelConfig  # one module's decoder layer as a one-layer model (a rank's)
    head_config: _C.ModelConfig   # every module's, one layer each (their KV layout; a rank's)
    blocks: list[dict[str, torch.Tensor]]  # per module, load_weights' names (layers.0.*, norm)
    head: dict[str, torch.Tensor]  # layers.<d>.enorm.weight, .hnorm.weight, .eh_proj.weight


def num_mtp_modules(hf: dict) -> int:
    """How many MTP modules config.json declares (num_nextn_predict_layers; 0: none)."""
    value = hf.get("num_nextn_predict_layers") or 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def mtp_configs(model_dir: Path, hf: dict, target: _C.ModelConfig
                ) -> tuple[_C.ModelConfig, _C.ModelConfig]:
    """(one module's config, all modules' config): config.json read with num_hidden_layers of
    1 (of every module) and every layer's MLP a mixture of experts. Raises ValueError when the
    checkpoint has no MTP modules kvserve reads."""
    path = Path(model_dir) / "config.json"
    if target.architecture not in MTP_ARCHITECTURES:
        raise ValueError(f'speculative_method="mtp" drafts with the multi-token-prediction '
                         f"modules of {', '.join(MTP_ARCHITECTURES)} checkpoints; "
                         f"{path} is a {target.architecture}")
    count = num_mtp_modules(hf)
    if count < 1:
        raise ValueError(f'speculative_method="mtp": {path} declares no multi-token-prediction '
                         "modules (num_nextn_predict_layers)")

    def config(layers: int) -> _C.ModelConfig:
        c = _model_config({**hf, "num_hidden_layers": layers, "first_k_dense_replace": 0}, path)
        c.quantization = target.quantization  # with the activation choice the target's has
        return c

    return config(1), config(count)


def _module_view(index: WeightIndex, first: int, module: int) -> WeightIndex:
    """The tensors of MTP module `module` (stored as layer first + module), as a one-layer
    model's: its decoder layer as model.layers.0, its shared_head.norm as the final norm."""
    prefix = f"model.layers.{first + module}."
    tensors = {}
    for name, info in index.tensors.items():
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        if rest.startswith(_MODULE_TENSORS + _TARGET_COPIES):
            continue
        if rest.startswith("shared_head.norm."):
            tensors["model.norm." + rest.removeprefix("shared_head.norm.")] = info
        else:
            tensors["model.layers.0." + rest] = info
    if not tensors:
        raise ValueError(f"{index.source} holds no tensors of MTP module {module} ({prefix}*), "
                         "though config.json declares it (num_nextn_predict_layers)")
    return WeightIndex(tensors, index.files, index.source)


def load_mtp_weights(model_dir: str | Path, hf: dict, target: _C.ModelConfig,
                     dtype: torch.dtype, device: torch.device | str = "cpu",
                     shard: Shard | None = None) -> MtpWeights:
    """Reads and checks every MTP module of the checkpoint (target: its decoder's whole config;
    shard: this tensor-parallel rank's part of their decoder layers, the configs the rank's).
    Raises ValueError (a missing or misshapen tensor named) and FileNotFoundError."""
    model_dir = Path(model_dir)
    block_config, head_config = mtp_configs(model_dir, hf, target)
    first = target.num_layers
    blocks = [load_weights(model_dir, block_config, dtype, device, shard=shard,
                           layers_of=lambda index, d=d: _module_view(index, first, d))
              for d in range(head_config.num_layers)]
    if shard is not None:
        block_config, head_config = shard_config(block_config, shard), shard_config(head_config,
                                                                                    shard)
    index = WeightIndex.from_dir(model_dir).renamed(weight_names(target))
    read = _TensorReader(index, dtype, parse_quantization_config(hf))
    hidden = target.hidden_size
    head: dict[str, torch.Tensor] = {}
    for d in range(head_config.num_layers):
        p = f"model.layers.{first + d}."
        for norm in ("enorm", "hnorm"):
            name = p + norm + ".weight"
            if name not in index.tensors:
                raise ValueError(f"{index.source} has no tensor '{name}' of MTP module {d}")
            tensor = read(name)
            if tuple(tensor.shape) != (hidden,):
                raise ValueError(f"{index.source}: tensor '{name}' has shape "
                                 f"{list(tensor.shape)}, not [{hidden}] (hidden_size)")
            head[f"layers.{d}.{norm}.weight"] = tensor
        module = p + "eh_proj"
        if module + ".weight" not in index.tensors and not read.quantized(module):
            raise ValueError(f"{index.source} has no tensor '{module}.weight' of MTP module {d}")
        weight = read.weight(module, (hidden, 2 * hidden))
        if tuple(weight.shape) != (hidden, 2 * hidden):
            raise ValueError(f"{index.source}: tensor '{module}.weight' has shape "
                             f"{list(weight.shape)}, not [{hidden}, {2 * hidden}]")
        head[f"layers.{d}.eh_proj.weight"] = weight
    return MtpWeights(block_config, head_config, blocks,
                      {name: t.to(device).contiguous() for name, t in head.items()})


def mtp_head(weights: MtpWeights, target_model: _C.CausalLM, max_positions: int,
             communicator: _C.Communicator | None = None) -> _C.MtpHead:
    """The modules as one _C.MtpHead drafting for `target_model` (whose embedding and LM head it
    uses): each module's decoder layer a one-layer model whose own vocabulary is a single
    placeholder row, never read. communicator: the target's device group, when the weights are a
    tensor-parallel rank's."""
    config = _C.ModelConfig(weights.block_config)
    config.vocab_size, config.tie_word_embeddings = 1, True
    blocks = []
    for w in weights.blocks:
        norm = w["norm.weight"]
        w = {**w, "embed_tokens.weight": torch.zeros(1, config.hidden_size, dtype=norm.dtype,
                                                     device=norm.device)}
        blocks.append(_C.create_causal_lm(config, w, max_positions, communicator))
    return _C.MtpHead(weights.head_config, target_model, blocks, weights.head)
