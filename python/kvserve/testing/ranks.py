"""Runs a function on several ranks, each in its own process, bounded in time: for tests of
collectives and of sharded models on one machine (Gloo, one thread per rank).

    results = run_ranks(fn, world_size=2, args=(x,))  # fn(groups, *args) on every rank

Each rank joins the set with kvserve.distributed.init_parallel_groups over a free loopback port,
calls fn(groups, *args) and sends back what it returns (it must pickle). A rank that raises, dies
or overruns `timeout_s` makes run_ranks raise RuntimeError naming it, after the others are
stopped: a test never hangs on a stuck collective.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import time
import traceback
from typing import Any, Callable


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, args: tuple,
               results: mp.Queue, timeout_s: float) -> None:
    import torch

    from kvserve.distributed import destroy_parallel_groups, init_parallel_groups

    torch.set_num_threads(1)
    try:
        groups = init_parallel_groups(world_size, rank, f"tcp://127.0.0.1:{port}",
                                      timeout_s=timeout_s)
        # Pickled here, by value: the queue's own pickler would send tensors as shared-memory
        # handles, which the parent can only open while this process lives (it may have exited).
        value = pickle.dumps(fn(groups, *args))
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_parallel_groups()


def run_ranks(fn: Callable, world_size: int = 2, args: tuple = (),
              timeout_s: float = 120.0) -> list[Any]:
    """fn(groups, *args) on `world_size` ranks (fn a module-level function); the values they
    return, by rank."""
    from kvserve.distributed import free_port

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(fn, r, world_size, port, args, results, timeout_s))
                 for r in range(world_size)]
    for p in processes:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if not p.is_alive() and r not in values]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died (exit code "
                                       f"{processes[dead[0]].exitcode}) without a result")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(values))} "
                                       f"gave no result within {timeout_s:.0f} s")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world_size)]
