"""The C++ Communicator over torch.distributed groups made in Python: every collective at world
size 2 (Gloo, one thread per rank) in several dtypes and awkward shapes against what torch's own
collectives give, the local communicator of a single rank, and the errors."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve import _C
from kvserve.distributed import ParallelGroups, communicator, init_parallel_groups
from kvserve.testing.ranks import RankPool, run_ranks

DTYPES = [torch.float32, torch.bfloat16, torch.int64]
SHAPES = [(3, 5), (7,), (1, 2, 3)]


def _value(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n) * (rank + 2) - rank).reshape(shape).to(dtype)


def _collectives(groups: ParallelGroups) -> dict:
    """Every collective on both groups, with torch.distributed's own result (over the default
    group: the same ranks) beside kvserve's."""
    dist = torch.distributed
    pg = dist.group.WORLD
    out = {"rank": groups.rank, "size": []}
    for name, comm in [("device", groups.device_communicator()),
                       ("control", groups.control_communicator())]:
        out["size"].append((comm.rank, comm.size, repr(comm)))
        for dtype in DTYPES:
            for shape in SHAPES:
                key = (name, str(dtype), shape)
                mine = _value(groups.rank, shape, dtype)
                summed = comm.all_reduce_(mine.clone())
                want = mine.clone()
                dist.all_reduce(want, group=pg)
                gathered = comm.all_gather(mine, dim=len(shape) - 1)
                parts = [torch.empty_like(mine) for _ in range(groups.world_size)]
                dist.all_gather(parts, mine, group=pg)
                at_root = comm.gather(mine, dim=0, root=1)
                broadcast = comm.broadcast_(mine.clone(), root=1)
                out[key] = dict(
                    all_reduce=torch.equal(summed, want),
                    all_gather=torch.equal(gathered, torch.cat(parts, dim=len(shape) - 1)),
                    gather=(torch.equal(at_root, torch.cat(parts, dim=0)) if groups.rank == 1
                            else at_root is None),
                    broadcast=torch.equal(broadcast, _value(1, shape, dtype)))
    with torch.inference_mode():  # Gloo's threads write into inference tensors from C++
        t = torch.ones(4)
        out["inference_mode"] = groups.device_communicator().all_reduce_(t).tolist()
    groups.device_communicator().barrier()
    try:
        groups.device_communicator().broadcast_(torch.ones(2), root=2)
    except ValueError as e:
        out["bad_root"] = str(e)
    try:
        groups.device_communicator().all_reduce_(torch.ones(4, 2).t())
    except ValueError as e:
        out["not_contiguous"] = str(e)
    return out


def test_collectives_over_two_ranks_equal_torch_distributed():
    results = run_ranks(_collectives, world_size=2)
    for rank, out in enumerate(results):
        assert out["rank"] == rank
        for comm_rank, size, text in out["size"]:
            assert (comm_rank, size) == (rank, 2)
            assert text.startswith("<Communicator gloo group '") and f"rank {rank} of 2" in text
        checks = {k: v for k, v in out.items() if isinstance(k, tuple)}
        assert len(checks) == 2 * len(DTYPES) * len(SHAPES)
        for key, ok in checks.items():
            assert all(ok.values()), (rank, key, ok)
        assert out["inference_mode"] == [2.0] * 4
        assert "root 2 is not a rank of 2" in out["bad_root"]
        assert "contiguous" in out["not_contiguous"]


def test_a_single_rank_is_local():
    groups = init_parallel_groups(1, 0)
    assert (groups.world_size, groups.device_group, groups.control_group) == (1, "", "")
    for comm in (groups.device_communicator(), groups.control_communicator(),
                 _C.local_communicator()):
        assert (comm.rank, comm.size) == (0, 1)
        x = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(comm.all_reduce_(x.clone()), x)
        assert torch.equal(comm.all_gather(x, 1), x)
        assert torch.equal(comm.gather(x, 0, 0), x)
        assert torch.equal(comm.broadcast_(x.clone(), 0), x)
        comm.barrier()
        with pytest.raises(ValueError, match="root 1 is not a rank of 1"):
            comm.gather(x, 0, 1)
        with pytest.raises(ValueError, match="contiguous"):
            comm.all_reduce_(x.t())
    assert "local" in repr(_C.local_communicator())


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0, rank=0), "world_size must be an integer >= 1"),
    (dict(world_size=2, rank=2), r"rank must be in \[0, 2\)"),
    (dict(world_size=2, rank=-1), r"rank must be in \[0, 2\)"),
    (dict(world_size=2, rank=0, backend="mpi"), "backend must be one of gloo, nccl"),
    (dict(world_size=2, rank=0, backend="nccl"), "nccl backend runs between CUDA devices"),
    (dict(world_size=2, rank=0, timeout_s=0), "timeout_s must be > 0"),
])
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        init_parallel_groups(**kwargs)


def test_an_unknown_group_is_a_clear_error():
    with pytest.raises(ValueError, match="no torch.distributed process group named 'nope'"):
        communicator("nope")


def _raise_on_rank_one(groups: ParallelGroups) -> int:
    if groups.rank == 1:
        raise RuntimeError("rank one gives up")
    return groups.rank


def test_a_failing_rank_is_reported_not_waited_for():
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*rank one gives up"):
        run_ranks(_raise_on_rank_one, world_size=2, timeout_s=60)


def _pid(groups: ParallelGroups) -> int:
    return os.getpid()


def test_a_rank_pool_keeps_its_ranks_until_a_call_fails():
    with RankPool(2, timeout_s=60) as pool:
        first = pool.run(_pid)
        assert pool.run(_pid) == first and len(set(first)) == 2
        with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*rank one gives up"):
            pool.run(_raise_on_rank_one)
        again = pool.run(_pid)  # new ranks, whose collectives work
        assert not set(again) & set(first)
        assert pool.run(_collectives)[1]["rank"] == 1
