"""Runs a function on several ranks, each in its own process, bounded in time: for tests of
collectives and of sharded models on one machine (Gloo, one thread per rank).

    results = run_ranks(fn, world_size=2, args=(x,))  # fn(groups, *args) on every rank

Each rank joins the set with kvserve.distributed.init_parallel_groups over a free loopback port,
calls fn(groups, *args) and sends back what it returns (it must pickle). A rank that raises, dies
or overruns `timeout_s` makes run_ranks raise RuntimeError naming it, after the others are
stopped: a test never hangs on a stuck collective.

Many calls on one set of ranks (a test module's cases; starting a rank, which imports torch,
costs seconds) share a RankPool:

    with RankPool(2) as pool:
        results = pool.run(fn, args=(x,))

Its ranks stay up between calls; a call that fails as run_ranks would stops them, and the next
call starts a new set.
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


def _pool_rank_main(rank: int, world_size: int, port: int, tasks: mp.Queue,
                    results: mp.Queue, timeout_s: float) -> None:
    import torch

    from kvserve.distributed import destroy_parallel_groups, init_parallel_groups

    torch.set_num_threads(1)
    try:
        groups = init_parallel_groups(world_size, rank, f"tcp://127.0.0.1:{port}",
                                      timeout_s=timeout_s)
        while (task := tasks.get()) is not None:
            fn, args = task
            try:
                results.put((rank, True, pickle.dumps(fn(groups, *args))))
            except BaseException:  # noqa: BLE001 - everything goes back to the parent
                results.put((rank, False, traceback.format_exc()))
    except BaseException:  # noqa: BLE001 - the groups could not be set up
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_parallel_groups()


def _collect(processes: list, results: mp.Queue, timeout_s: float) -> list[Any]:
    """Each rank's value from `results`; RuntimeError naming the first rank that raised, died
    or gave nothing within timeout_s."""
    world_size = len(processes)
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
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
    return [values[r] for r in range(world_size)]


def _stop(processes: list) -> None:
    for p in processes:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()


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
    try:
        return _collect(processes, results, timeout_s)
    finally:
        _stop(processes)


class RankPool:
    """`world_size` ranks started on the first run() and kept for the next ones (close() or the
    with-block's end stops them). run(fn, args) is run_ranks(fn, world_size, args) on these
    ranks; after a call that fails (a rank raised, died or overran timeout_s: its collectives
    may be left half done) the ranks are stopped and the next call starts new ones."""

    def __init__(self, world_size: int = 2, timeout_s: float = 120.0):
        self.world_size, self.timeout_s = world_size, timeout_s
        self._processes: list = []
        self._tasks: list = []
        self._results = None

    def _start(self) -> None:
        from kvserve.distributed import free_port

        context = mp.get_context("spawn")
        self._results = context.Queue()
        port = free_port()
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        self._processes = [
            context.Process(target=_pool_rank_main, daemon=True,
                            args=(r, self.world_size, port, self._tasks[r], self._results,
                                  self.timeout_s))
            for r in range(self.world_size)]
        for p in self._processes:
            p.start()

    def run(self, fn: Callable, args: tuple = (), timeout_s: float | None = None) -> list[Any]:
        """fn(groups, *args) on every rank (fn a module-level function); their values, by
        rank. Raises RuntimeError as run_ranks does."""
        if not self._processes:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))
        try:
            return _collect(self._processes, self._results,
                            self.timeout_s if timeout_s is None else timeout_s)
        except BaseException:
            self.close(kill=True)
            raise

    def close(self, kill: bool = False) -> None:
        """Stops the ranks (at once with kill, else after their current call)."""
        for p, tasks in zip(self._processes, self._tasks):
            if kill:
                p.kill()
            else:
                tasks.put(None)
        _stop(self._processes)
        self._processes, self._tasks, self._results = [], [], None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
