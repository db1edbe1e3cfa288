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
    for label, size_of in (("expert intermediate size", moe.moe_intermediate_size),
                           ("shared experts' intermediate size", moe.shared_intermediate_size)):
        if moe.num_experts and size_of % size:
            raise ValueError(f"tensor_parallel_size {size} must divide the {label} {size_of} "
                             f"of {name}")
    if config.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the {config.num_heads} "
                         f"attention heads of {name}")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size {size} and the {kv} key/value heads of {name} "
                         "must divide one another (each rank holds whole key/value heads)")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the intermediate size "
                         f"{config.intermediate_size} of {name}")


def local_heads(config: _C.ModelConfig, shard: Shard) -> tuple[int, int, int, int]:
    """(first query head, query heads, first key/value head, key/value heads) of the rank."""
    q = config.num_heads // shard.size
    kv_total = config.num_kv_heads
    if kv_total >= shard.size:
        kv = kv_total // shard.size
        return shard.rank * q, q, shard.rank * kv, kv
    # Fewer key/value heads than ranks: the rank's query heads all read one of them.
    return shard.rank * q, q, shard.rank * kv_total // shard.size, 1


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
        _, local.num_heads, _, local.num_kv_heads = local_heads(config, shard)
        _, local.intermediate_size = local_intermediate(config, shard)
        if config.moe.num_experts:
            moe = local.moe
            moe.moe_intermediate_size //= shard.size
            moe.shared_intermediate_size //= shard.size
            local.moe = moe
    return local
