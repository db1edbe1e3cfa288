"""Process groups for running one model over several processes, made with torch.distributed and
used from C++.

kvserve brings no transport of its own: its ranks meet through torch.distributed (a c10d store:
`tcp://host:port` for ranks that kvserve starts itself, `env://` under torchrun), and the C++
runtime finds the groups made here by name (`_C.process_group_communicator`), behind its
`Communicator` interface (csrc/include/kvserve/communicator.h).

A set of ranks has two groups:

- the device group carries the forward's tensors (a row-parallel layer's all-reduce, the gathered
  logits): NCCL between GPUs, Gloo on CPUs;
- the control group, always Gloo on the CPU, carries small messages about what to run (rank 0's
  step header to the workers), so they never queue behind the device group's collectives.

One rank makes no group at all: its communicators are local (collectives return their input).

Collectives on tensors made under `torch.inference_mode` work (Gloo's worker threads write into
them from C++, where inference mode does not apply); `tests/distributed/test_communicator.py`
checks it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch

from kvserve import _C

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class ParallelGroups:
    """This process's place in a set of ranks, and the names of its groups in torch's registry
    ("" for a single rank)."""

    rank: int
    world_size: int
    backend: str  # of the device group
    device_group: str = ""
    control_group: str = ""

    def device_communicator(self) -> _C.Communicator:
        """Collectives over the device group (local for a single rank)."""
        return communicator(self.device_group)

    def control_communicator(self) -> _C.Communicator:
        """Collectives over the CPU control group (local for a single rank)."""
        return communicator(self.control_group)


def communicator(group_name: str = "") -> _C.Communicator:
    """The communicator over the process group registered under `group_name`, or the local one
    for "" (a single rank). ValueError for a name no group of this process has."""
    return _C.process_group_communicator(group_name) if group_name else _C.local_communicator()


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when torchrun (or another launcher of torch.distributed's env://
    convention) started this process as one of several ranks; None otherwise."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    try:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    except ValueError:
        return None
    return (rank, world_size) if world_size > 1 else None


def default_backend(device: str | torch.device) -> str:
    """NCCL between CUDA devices, Gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for the store of ranks started on this machine."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_parallel_groups(world_size: int, rank: int, init_method: str = "env://",
                         backend: str | None = None, device: str | torch.device = "cpu",
                         timeout_s: float = 300.0) -> ParallelGroups:
    """Joins the set of `world_size` ranks as `rank` and makes its device and control groups.

    init_method: where the ranks meet (torch.distributed's: "tcp://127.0.0.1:PORT", or
    "env://" with MASTER_ADDR, MASTER_PORT as torchrun sets them). backend: of the device group,
    "gloo" or "nccl" (default: default_backend(device)). timeout_s: how long a collective waits
    for the other ranks before it fails (instead of hanging). ValueError for a bad argument, and
    whatever torch.distributed raises when the ranks cannot meet."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    backend = backend or default_backend(device)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and torch.device(device).type != "cuda":
        raise ValueError("the nccl backend runs between CUDA devices; use gloo on the CPU")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if world_size == 1:
        return ParallelGroups(0, 1, backend)
    if not torch.distributed.is_available():
        raise ValueError("this torch has no torch.distributed: cannot run several ranks")
    dist = torch.distributed
    if dist.is_initialized():
        raise ValueError("torch.distributed is already initialized in this process")
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank,
                            timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    # Group creation is collective but not synchronizing: a rank that returns and exits at once
    # (its work failed, or there was none) would close the sockets another rank still needs to
    # finish making the control group. No rank leaves before every rank holds both groups.
    dist.barrier(group=control)
    return ParallelGroups(rank, world_size, backend, dist.group.WORLD.group_name,
                          control.group_name)


def destroy_parallel_groups() -> None:
    """Leaves the set of ranks (a no-op when this process joined none)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
