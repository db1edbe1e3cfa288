"""Tensor-parallel shards (Megatron-LM's split, Shoeybi et al., 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism"): which part of each weight a
rank holds, and the model config that rank's C++ model runs.

- Attention: each rank holds num_heads / size query heads and their key/value heads (q/k/v are
  column-parallel: rows by head); with fewer key/value heads than ranks, each key/value head is
  replicated on the size / num_kv_heads ranks whose query heads read it. o_proj is row-parallel:
  the columns of the rank's heads, the bias on rank 0 only, the ranks' outputs summed.
- MLP: gate/up column-parallel (rows of the rank's share of the intermediate size), down_proj
  row-parallel (those columns). Mixture of experts: every expert (and the shared expert) split
  the same way, the router replicated, the combined output summed once.
- Multi-head latent attention (DeepSeek-V2 / V3): by head too, the rows of q_b_proj (or
  q_proj) and kv_b_proj, o_proj's columns (row-parallel); the latent projections (kv_a, q_a),
  their norms and so the latent KV cache are replicated on every rank. q/k norms per head are
  replicated; OLMo 2's over all heads at once are split with the heads, each rank's sums of
  squares summed over the ranks (the C++ Attention).
- Mamba2 mixers (Mamba2 and the hybrids' state-space layers), by head as vLLM splits them: the
  rows of in_proj's gate z, x and dt and of the convolution's x channels, A, D and dt_bias, the
  gated norm's weight; B and C by group (a group replicated on the ranks whose heads read it,
  when there are fewer groups than ranks); out_proj row-parallel. A gated norm over groups the
  ranks divide stays per rank; one over all heads (a single group) sums each rank's sums of
  squares over the ranks. Each rank keeps its heads' conv and SSM states. Mamba (S6) mixers
  (Mamba, FalconMamba, Jamba) by inner channel: in_proj's x and gate rows, the convolution, A,
  D, dt_proj's rows and bias; x_proj (dt, B and C from every channel) and out_proj row-parallel,
  so every rank gets the whole dt, B and C before their norms.
- Embedding and LM head: vocabulary-parallel, ceil(vocab / size) rows a rank (the last rank's
  padded with zero rows); a tied head is the same rows. Norms are replicated.
- Quantized projections split along the same axis as plain ones, their scales and zeros with
  them (QuantizedWeight.narrow): a row-parallel int4 layer needs each rank's inputs to be whole
  groups (and chunks of 32), a clear error otherwise. LLM.int8() and W8A8 layers round their
  activations per token over the inputs each rank holds, so a row-parallel one differs from the
  unsplit layer by that rounding (weight-only int8 / int4 / fp8 give the same sums).

A rank's model is then the unsharded model class over a config whose num_heads, num_kv_heads and
intermediate_size are the rank's (shard_config), plus one all-reduce after each row-parallel
projection (the C++ Linear::load_row_parallel), one after the embedding lookup, and an
all-gather of the logits' columns (the C++ DecoderLM).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve import _C


@dataclass(frozen=True)
class Shard:
    """This process's rank among `size` ranks that split one model."""

    rank: int
    size: int

    def __post_init__(self):
        if not (isinstance(self.size, int) and self.size >= 1 and isinstance(self.rank, int)
                and 0 <= self.rank < self.size):
            raise ValueError(f"a shard needs 0 <= rank < size, got rank {self.rank!r} of "
                             f"{self.size!r}")


def check_shardable(config: _C.ModelConfig, size: int) -> None:
    """ValueError naming what keeps `config` from being split over `size` ranks."""
    if size == 1:
        return
    name = config.architecture or "this model"
    moe = config.moe
    if moe.num_experts and moe.activation == "relu2":
        raise ValueError(f"tensor parallelism is not supported for the ungated experts of {name} "
                         "yet")
    for label, size_of in (("expert intermediate size", moe.moe_intermediate_size),
                           ("shared experts' intermediate size", moe.shared_intermediate_size)):
        if moe.num_experts and size_of % size:
            raise ValueError(f"tensor_parallel_size {size} must divide the {label} {size_of} "
                             f"of {name}")
    if config.num_heads % size and _has_attention(config):
        raise ValueError(f"tensor_parallel_size {size} must divide the {config.num_heads} "
                         f"attention heads of {name}")
    kv = config.num_kv_heads
    if kv % size and size % kv and _has_attention(config):
        raise ValueError(f"tensor_parallel_size {size} and the {kv} key/value heads of {name} "
                         "must divide one another (each rank holds whole key/value heads)")
    if config.intermediate_size % size and _has_mlp(config):
        raise ValueError(f"tensor_parallel_size {size} must divide the intermediate size "
                         f"{config.intermediate_size} of {name}")
    if config.num_ssm_layers() > 0:
        _check_ssm_shardable(config.ssm, size, name)


def _has_attention(config: _C.ModelConfig) -> bool:
    return any(config.has_attention(i) for i in range(config.num_layers))


def _has_mlp(config: _C.ModelConfig) -> bool:
    return any(config.has_mlp(i) for i in range(config.num_layers))


def _check_ssm_shardable(s: _C.SSMConfig, size: int, name: str) -> None:
    if s.num_heads % size:  # a Mamba (S6) mixer's heads are its channels
        heads = "channels" if s.kind == "mamba" else "heads"
        raise ValueError(f"tensor_parallel_size {size} must divide the {s.num_heads} "
                         f"state-space {heads} of {name}")
    if s.kind == "mamba":
        return
    if s.n_groups % size and size % s.n_groups:
        raise ValueError(f"tensor_parallel_size {size} and the {s.n_groups} B/C groups of "
                         f"{name} must divide one another (each rank holds whole groups)")
    if s.norm != "gate_only" and s.norm_groups % size and s.norm_groups != 1:
        raise ValueError(f"tensor_parallel_size {size} must divide the {s.norm_groups} groups "
                         f"of {name}'s gated norm (or the norm be one group)")


def local_heads(config: _C.ModelConfig, shard: Shard) -> tuple[int, int, int, int]:
    """(first query head, query heads, first key/value head, key/value heads) of the rank."""
    q = config.num_heads // shard.size
    kv_total = config.num_kv_heads
    if kv_total >= shard.size:
        kv = kv_total // shard.size
        return shard.rank * q, q, shard.rank * kv, kv
    # Fewer key/value heads than ranks: the rank's query heads all read one of them.
    return shard.rank * q, q, shard.rank * kv_total // shard.size, 1


def local_ssm(config: _C.ModelConfig, shard: Shard) -> tuple[int, int, int, int]:
    """(first head, heads, first B/C group, groups) of the rank's part of a Mamba2 mixer."""
    s = config.ssm
    h = s.num_heads // shard.size
    if s.n_groups >= shard.size:
        g = s.n_groups // shard.size
        return shard.rank * h, h, shard.rank * g, g
    # Fewer groups than ranks: the rank's heads all read one group.
    return shard.rank * h, h, shard.rank * s.n_groups // shard.size, 1


def local_columns(size: int, shard: Shard) -> tuple[int, int]:
    """(first column, columns) of the rank's share of an intermediate size the ranks divide."""
    n = size // shard.size
    return shard.rank * n, n


def local_intermediate(config: _C.ModelConfig, shard: Shard) -> tuple[int, int]:
    """(first column, columns) of the rank's share of the MLP's intermediate size."""
    return local_columns(config.intermediate_size, shard)


def local_vocab(config: _C.ModelConfig, shard: Shard) -> tuple[int, int]:
    """(first id, rows) of the rank's share of the embedding and the LM head: ceil(vocab /
    size) rows, some past the vocabulary on the last rank when size does not divide it."""
    n = -(-config.vocab_size // shard.size)
    return shard.rank * n, n


def shard_config(config: _C.ModelConfig, shard: Shard) -> _C.ModelConfig:
    """The config of the rank's model: its heads and intermediate size, the rest unchanged."""
    check_shardable(config, shard.size)
    local = _C.ModelConfig(config)
    if shard.size > 1:
        if _has_attention(config):
            _, local.num_heads, _, local.num_kv_heads = local_heads(config, shard)
        if _has_mlp(config):
            _, local.intermediate_size = local_intermediate(config, shard)
        if config.moe.num_experts:
            moe = local.moe
            moe.moe_intermediate_size //= shard.size
            moe.shared_intermediate_size //= shard.size
            local.moe = moe
        if config.num_ssm_layers() > 0:
            ssm = local.ssm
            _, ssm.num_heads, _, ssm.n_groups = local_ssm(config, shard)
            if ssm.norm_groups % shard.size == 0:
                ssm.norm_groups //= shard.size
            else:  # one group over every rank's heads
                ssm.norm_spans_ranks = True
            local.ssm = ssm
    return local
