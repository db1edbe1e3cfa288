"""Small helpers shared by the scripts in ``benchmarks/``: the machine, its physical limits
(memory read bandwidth, practical matmul peak), medians, markdown tables and JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's marketing name, from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """What a result depends on: CPU, cores, threads, library versions, kernel ISA."""
    from kvserve import _C, __version__

    info = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kvserve": __version__,
        "kvserve_cpu_capability": _C.cpu_capability(),
        "kvserve_cpu_prefetch": _C.cpu_prefetch(),
        "python": platform.python_version(),
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def best_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """The fastest of `repeats` timed calls, in seconds (after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cuda_event_time(fn: Callable[[], object], repeats: int, calls: int = 1,
                    warmup: int = 2) -> float:
    """Median seconds of one fn() on the current CUDA device over `repeats` timings by CUDA
    events of `calls` calls back to back (after `warmup` calls): with several calls the GPU never
    waits for the host to launch the next kernel, so a short kernel's time is not its launch
    overhead."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return median(times)


def device_profile(run: Callable[[], object], steps: int, device: str = "cuda",
                   top: int = 12) -> dict:
    """What one of `steps` steps (all made by one run()) costs, from torch.profiler: wall ms per
    step; on CUDA the GPU's busy ms per step (the union of its kernels', copies' and memsets'
    intervals, graph replays' kernels included), their count per step and the `top` kernels by
    time ({name, ms, calls} per step), and the host's CUDA runtime calls by time (`runtime`:
    launches, graph replays, copies, synchronisations; the profiler inflates their times, not
    their counts). The gap between wall and busy is time the GPU waited for the host. On the CPU
    the same table lists the kvserve ops' own time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if device == "cuda":
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.name.startswith("kvserve::")]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy_us, reach = 0.0, float("-inf")
    for begin, end in intervals:  # the union's length
        busy_us += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
    runtime = [e for e in prof.events()
               if e.device_type == DeviceType.CPU and e.name.startswith("cuda")]

    def ranked(chosen) -> list[dict]:
        by_name: dict[str, list[float]] = {}
        for e in chosen:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
        best = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
        return [dict(name=name[:90], ms=sum(times) / 1e3 / steps, calls=len(times) / steps)
                for name, times in best]

    return dict(wall_ms=wall * 1e3 / steps, busy_ms=busy_us / 1e3 / steps,
                events=len(events) / steps, top=ranked(events), runtime=ranked(runtime))


def memory_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Memory read bandwidth in bytes/s: the best of `repeats` fp32 sums over a buffer much larger
    than the last-level cache, with torch's current thread count. Many short repeats, since on a
    shared machine only the best ones see it idle."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    return buf.nbytes / best_time(lambda: buf.sum(), repeats)


def matmul_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 20) -> float:
    """Practical peak FLOP/s: the best of `repeats` square `torch.mm` of size `n` in `dtype`."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b), repeats)


class CpuContention:
    """How busy *other* processes kept the CPUs between start() and stop(): (all CPUs' busy time
    - this process's CPU time) / (wall time * CPUs), from /proc/stat. 0 is an idle machine; on a
    shared machine, results taken above ~0.1 are unreliable (parallel kernels wait on a thread
    that another process preempted)."""

    def start(self) -> CpuContention:
        self._t0 = self._snapshot()
        return self

    def stop(self) -> float | None:
        t0, t1 = self._t0, self._snapshot()
        if t0 is None or t1 is None:
            return None
        busy = (t1[0] - t0[0]) - (t1[1] - t0[1])
        return max(0.0, busy / ((t1[2] - t0[2]) * (os.cpu_count() or 1)))

    @staticmethod
    def _snapshot():
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        # user..steal minus idle and iowait
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        t = os.times()
        return busy, t.user + t.system, time.monotonic()


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; floats are printed with 3 significant digits."""
    def fmt(v):
        if isinstance(v, float):
            return "-" if v != v else f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> Path:
    """Writes `data` as indented JSON, creating the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def cached_checkpoint(cache_dir: Path, name: str, arch: str, config: dict, dtype: str) -> Path:
    """A random checkpoint of this shape and dtype ("float32" | "bfloat16"), built on first use
    under cache_dir and reused by later runs."""
    import hashlib
    import shutil

    from kvserve.testing.checkpoints import make_checkpoint

    key = hashlib.sha1(json.dumps([arch, config, dtype], sort_keys=True).encode()).hexdigest()[:10]
    path = Path(cache_dir) / f"{name}-{dtype}-{key}"
    if not (path / "config.json").is_file():
        print(f"building {path.name} ...", flush=True)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_checkpoint(tmp, arch, dtype=getattr(torch, dtype), **config)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    return path
