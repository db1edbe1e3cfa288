"""`kvserve launch`: several `kvserve serve` workers and a router in front of them, on one machine.

The router is vLLM's (`pip install vllm-router`, a Rust load balancer on PyPI), not one of ours:
it health-checks the workers on /health, spreads requests by its policy (cache_aware,
round_robin, power_of_two, ...) and, in its `--vllm-pd-disaggregation` mode, drives vLLM's
`kv_transfer_params` handshake between a prefill worker (`--kv-role producer`) and a decode
worker (`--kv-role consumer`). docs/serving.md says why this router and how to list workers on
several machines instead.

    kvserve launch --replicas 2 --port 8000 -- --model models/shakespeare-target
    kvserve launch --prefill 1 --decode 1 --port 8000 -- --model models/shakespeare-target

The workers listen on the ports after --port (or from --worker-port); everything after `--` is
passed to every `kvserve serve`. The launcher waits until every worker is healthy, starts the
router, and stops them all when any of them exits or it is interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

ROUTER_MODULE = "vllm_router.launch_router"


@dataclass(frozen=True)
class Worker:
    """One `kvserve serve` process: its port and, when disaggregated, its KV role."""

    port: int
    kv_role: str | None = None  # "producer" (prefill) or "consumer" (decode)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def plan_workers(replicas: int = 0, prefill: int = 0, decode: int = 0,
                 first_port: int = 8001) -> list[Worker]:
    """The workers to start: `replicas` colocated ones, or `prefill` producers and `decode`
    consumers. Raises ValueError for a mix of both or for none."""
    if replicas < 0 or prefill < 0 or decode < 0:
        raise ValueError("--replicas, --prefill and --decode count workers: none may be negative")
    if replicas and (prefill or decode):
        raise ValueError("--replicas starts colocated workers; --prefill/--decode disaggregated "
                         "ones: pick one")
    if not replicas and not (prefill and decode):
        raise ValueError("give --replicas N, or both --prefill N and --decode M")
    roles = [None] * replicas + ["producer"] * prefill + ["consumer"] * decode
    return [Worker(first_port + i, role) for i, role in enumerate(roles)]


def worker_command(worker: Worker, serve_args: list[str], threads: int | None) -> list[str]:
    """The `kvserve serve` command line of one worker."""
    cmd = [sys.executable, "-m", "kvserve", "serve", *serve_args, "--port", str(worker.port)]
    if threads is not None and "--threads" not in serve_args:
        cmd += ["--threads", str(threads)]
    if worker.kv_role is not None:
        cmd += ["--kv-role", worker.kv_role]
    return cmd


def router_command(workers: list[Worker], host: str, port: int, policy: str,
                   router_args: list[str] = ()) -> list[str]:
    """vllm-router's command line: every worker listed, in its PD mode when they have roles."""
    cmd = [sys.executable, "-m", ROUTER_MODULE, "--host", host, "--port", str(port),
           "--policy", policy]
    if workers[0].kv_role is None:
        cmd += ["--worker-urls", *[w.url for w in workers]]
    else:
        cmd.append("--vllm-pd-disaggregation")
        for w in workers:
            cmd += ["--prefill", w.url] if w.kv_role == "producer" else ["--decode", w.url]
    return cmd + list(router_args)


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Waits until GET url/health answers 200; RuntimeError if the process exits or the time
    runs out first."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} was not healthy after {timeout:.0f} s")
        time.sleep(0.2)


def router_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm_router") is not None


def launch(workers: list[Worker], serve_args: list[str], host: str = "127.0.0.1",
           port: int = 8000, policy: str = "cache_aware", threads: int | None = None,
           startup_timeout: float = 600.0, router_args: list[str] = ()) -> int:
    """Starts the workers, waits for them, starts the router; returns the exit code of the first
    process to exit (0 on an interrupt) after stopping the others."""
    if not router_available():
        raise ValueError("kvserve launch needs vLLM's router: pip install vllm-router")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // len(workers))
    processes: list[subprocess.Popen] = []
    # A terminated launcher stops its workers and router too (through the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for w in workers:
            processes.append(subprocess.Popen(worker_command(w, serve_args, threads)))
        for w, p in zip(workers, processes):
            wait_healthy(w.url, p, startup_timeout)
        processes.append(subprocess.Popen(router_command(workers, host, port, policy,
                                                         router_args)))
        print(f"kvserve launch: router on http://{host}:{port} over "
              f"{', '.join(w.url for w in workers)}", file=sys.stderr, flush=True)
        while True:
            for p in processes:
                if p.poll() is not None:
                    return p.returncode
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    finally:
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in processes:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
