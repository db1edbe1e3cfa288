"""Tensor parallelism on one machine: the engine's process is rank 0 and spawns ranks 1..N-1.

Each rank loads only its shard of the weights (kvserve.loader.sharding: Megatron-LM's split of
attention heads and MLP columns), and its model sums partial results over the device group
(Gloo on CPUs, NCCL between GPUs). Rank 0 runs the whole engine, scheduler and sampler included;
each step it sends the batch over the control group (Gloo) to the workers
(_C.TensorParallelWorker), which run the forward and nothing else (one scheduler, as vLLM and
SGLang have it). Every rank's KV pool has the same number of blocks: the fewest any rank can hold.

A worker exits when rank 0 stops it (the engine is closed or collected), when rank 0's process
dies (its control group fails), or when the group's timeout passes without a step. Under torchrun
(several machines, or one) the ranks exist already: rank 0 runs the command, the others
(kvserve.cli) run run_torchrun_worker with the same options, all meeting through env://.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve import _C
from kvserve.config import (load_checkpoint_info, resolve_dtype, resolve_kv_cache_dtype,
                            set_quantized_activation)
from kvserve.distributed import (ParallelGroups, destroy_parallel_groups, free_port,
                                 init_parallel_groups, torchrun_rank)
from kvserve.loader import load_weights
from kvserve.loader.mtp_weights import load_mtp_weights, mtp_configs, mtp_head
from kvserve.loader.sharding import Shard, check_shardable, shard_config



@dataclass
class RankModel:
    """One rank's shard of the model, and the engine config it resolved for its pool."""

    model: _C.CausalLM
    config: _C.ModelConfig  # the shard's (heads and columns of this rank)
    engine_config: _C.EngineConfig
    split_bytes: int = 0       # this rank's part of the projections, embedding and LM head
    replicated_bytes: int = 0  # what every rank holds whole (norms, routers, MLA's latent part)


def load_rank_model(args, groups: ParallelGroups, eos_token_ids: list[int],
                    draft_config=None) -> RankModel:
    """This rank's shard of args.model and its engine config, the pool agreed with the other
    ranks (the fewest blocks any of them can hold)."""
    info = load_checkpoint_info(args.model)
    set_quantized_activation(info.config, args.quantized_activation, args.device)
    dtype = resolve_dtype(args.dtype, info.checkpoint_dtype)
    kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    shard = Shard(groups.rank, groups.world_size)
    local = shard_config(info.config, shard)
    config = args.engine_config(local, dtype, kv_cache_dtype, eos_token_ids, draft_config)
    control = groups.control_communicator()
    blocks = control.all_gather(torch.tensor([config.num_blocks], dtype=torch.int64))
    agreed = int(blocks.min())
    if agreed != config.num_blocks:
        config = dataclasses.replace(args, num_blocks=agreed).engine_config(
            local, dtype, kv_cache_dtype, eos_token_ids, draft_config)
    weights = load_weights(Path(args.model), info.config, dtype, args.device, shard=shard)
    split = sum(t.numel() * t.element_size() for name, t in weights.items()
                if ("_proj" in name and not _replicated(name)) or ".mixer." in name
                or name.startswith(("embed_tokens.", "lm_head.")))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    model = _C.create_causal_lm(local, weights, config.max_model_len,
                                groups.device_communicator())
    return RankModel(model, local, config, split, total - split)


def load_rank_mtp_head(args, groups: ParallelGroups, info, model: _C.CausalLM,
                       max_positions: int) -> _C.MtpHead:
    """This rank's shard of the checkpoint's multi-token-prediction modules (speculative_method
    "mtp"), drafting over its shard of the target `model`: every rank runs each module's forward
    that rank 0's proposer runs (info: the checkpoint's load_checkpoint_info)."""
    dtype = resolve_dtype(args.dtype, info.checkpoint_dtype)
    weights = load_mtp_weights(args.model, info.hf_config, info.config, dtype, args.device,
                               Shard(groups.rank, groups.world_size))
    return mtp_head(weights, model, max_positions, groups.device_communicator())


def _replicated(name: str) -> bool:
    """Whether the projection `name` is every rank's whole: MLA's latent ones (kv_a, q_a)."""
    return "kv_a_proj" in name or "q_a_proj" in name


def _worker_main(rank: int, world_size: int, init_method: str, args, threads: int,
                 started=None) -> None:
    """A worker rank's process: its shard, then every step rank 0 sends, until it stops.
    started: an event set once the process runs this (its parent's module re-imported)."""
    if started is not None:
        started.set()
    torch.set_num_threads(threads)
    groups = init_parallel_groups(world_size, rank, init_method, "gloo", args.device,
                                  args.distributed_timeout)
    try:
        info = load_checkpoint_info(args.model)
        mtp = args.speculative_method == "mtp"  # the modules' memory counted as rank 0 counts it
        rank_model = load_rank_model(
            args, groups, info.eos_token_ids,
            mtp_configs(Path(args.model), info.hf_config, info.config)[1] if mtp else None)
        if args.enable_lora:  # rank 0 sends each adapter's shard (LoRAManager._shard)
            rank_model.model.enable_lora(args.max_loras, args.max_lora_rank)
        c = rank_model.engine_config
        # Rank 0's state pool: a slot a running sequence (and its backup, with speculation),
        # and the saved states.
        states = (c.max_num_seqs * (2 if c.speculative.enabled else 1) + c.num_state_snapshots
                  if rank_model.config.num_ssm_layers() > 0 else 0)
        head = (load_rank_mtp_head(args, groups, info, rank_model.model, c.max_model_len)
                if mtp else None)
        worker = _C.TensorParallelWorker(rank_model.model, groups.control_communicator(),
                                         c.num_blocks, c.block_size, c.kv_cache_dtype, states,
                                         c.ssm_state_dtype, head)
        worker.serve()
    finally:
        destroy_parallel_groups()


def run_torchrun_worker(args) -> int:
    """A rank > 0 that torchrun started (`torchrun --nproc-per-node N -m kvserve serve
    --tensor-parallel-size N ...`): serves rank 0's engine until it stops. Returns 0."""
    rank, world_size = torchrun_rank()
    if args.tensor_parallel_size != world_size:
        raise ValueError(f"torchrun started {world_size} ranks but --tensor-parallel-size is "
                         f"{args.tensor_parallel_size}")
    _worker_main(rank, world_size, "env://", args, torch.get_num_threads())
    return 0


class TensorParallelRanks:
    """Rank 0's view of the other ranks: their groups, the processes it started (none under
    torchrun, which started them), and shutdown."""

    def __init__(self, args):
        size = args.tensor_parallel_size
        info = load_checkpoint_info(args.model)
        check_shardable(info.config, size)
        self.closed = False
        launched = torchrun_rank()
        if launched is not None:
            rank, world_size = launched
            if rank != 0 or world_size != size:
                raise ValueError(f"torchrun started this process as rank {rank} of "
                                 f"{world_size}; the engine runs on rank 0 of "
                                 f"tensor_parallel_size ({size}) ranks")
            self.processes = []
            self.groups = init_parallel_groups(size, 0, "env://", "gloo", args.device,
                                               args.distributed_timeout)
            return
        port = free_port()
        init_method = f"tcp://127.0.0.1:{port}"
        threads = max(1, torch.get_num_threads() // size)
        context = mp.get_context("spawn")
        started = [context.Event() for _ in range(1, size)]
        self.processes = [context.Process(target=_worker_main, daemon=True,
                                          args=(rank, size, init_method, args, threads,
                                                started[rank - 1]),
                                          name=f"kvserve-tp-rank{rank}")
                          for rank in range(1, size)]
        for p in self.processes:
            p.start()
        try:
            self._wait_started(started, args.distributed_timeout)
            # Gloo for the device group too: the ranks share this machine's device.
            self.groups = init_parallel_groups(size, 0, init_method, "gloo", args.device,
                                               args.distributed_timeout)
        except BaseException:
            self._stop_processes()
            raise

    def _wait_started(self, started: list, timeout_s: float) -> None:
        """Waits until every worker runs _worker_main: a worker that dies first (most often in
        re-importing the script that made the engine) is an error now, not at the rendezvous's
        timeout."""
        deadline = time.monotonic() + timeout_s
        for rank, (p, event) in enumerate(zip(self.processes, started), start=1):
            while not event.wait(0.05):
                if not p.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited (code {p.exitcode}) before it "
                        "started: a worker re-imports the script that made the engine "
                        "(multiprocessing's spawn), so that script must start it under "
                        "`if __name__ == \"__main__\":`")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start within "
                                       f"{timeout_s:g} s (distributed_timeout)")

    def check_alive(self) -> None:
        """RuntimeError naming a worker rank whose process has exited."""
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {p.exitcode})")

    def close(self, timeout_s: float = 30.0) -> None:
        """After the engine is gone (its runner stopped the workers): waits for them, then
        leaves the groups."""
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        self._stop_processes()
        destroy_parallel_groups()

    def _stop_processes(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, 9)
