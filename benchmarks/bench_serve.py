"""Load and fault test of the HTTP server: --requests concurrent streaming completions (all sent
at once from one asyncio client over loopback) against `python -m kvserve serve` in its own
process, a --cancel fraction of them dropped by the client at a random chunk.

Checks: no HTTP or stream errors; every stream that finishes has exactly the text and token
count LLM.generate gives the same request offline (greedy, ignore_eos: nothing lost or
duplicated); every cancelled stream's text is a prefix of it; at the end the server runs and
waits for nothing and its KV cache is empty. Figures: request throughput, output tokens/s, TTFT
and TPOT percentiles as the client sees them, against LLM.generate of the same requests in
this process (its TTFT / TPOT from the engine's request metrics).

    python benchmarks/bench_serve.py [--requests 1000] [--cancel 0.1] [--model DIR]
    python benchmarks/bench_serve.py --chaos [--requests 200]   # the hostile mixes (serve_chaos.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

import kvserve
from kvserve.server.serve import free_port
from kvserve.testing.bench import machine_info, markdown_table, write_json

HERE = Path(__file__).resolve().parent
MODEL = HERE.parent / "models" / "shakespeare-target"
OPENINGS = ["ROMEO:\n", "JULIET:\n", "KING RICHARD III:\n", "First Citizen:\n", "HAMLET:\n",
            "LADY MACBETH:\n", "MENENIUS:\nWhy, masters, my good friends,", "All:\nSpeak, speak."]



def shown(value) -> str:
    """An argument as results record it: a path inside the repository relative to it, so that
    the published JSON names no machine's directories."""
    if isinstance(value, Path) and value.resolve().is_relative_to(HERE.parent):
        return str(value.resolve().relative_to(HERE.parent))
    return str(value)

def workload(count: int, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs: distinct prompts (a shared opening and a varying tail)."""
    rng = random.Random(seed)
    return [(f"{rng.choice(OPENINGS)}{' ' * (i % 3)}{i}", rng.randrange(16, 65))
            for i in range(count)]


def percentiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return q[49], q[89], q[98]


async def stream_one(http: httpx.AsyncClient, name: str, prompt: str, max_tokens: int,
                     cancel_at: int | None) -> dict:
    body = dict(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                ignore_eos=True, stream=True, stream_options={"include_usage": True})
    started = time.perf_counter()
    text, stamps, usage, finish, done = "", [], None, None, False
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return dict(error=f"HTTP {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text += choice["text"]
                stamps.append(time.perf_counter())
                finish = choice["finish_reason"] or finish
            if cancel_at is not None and len(stamps) >= cancel_at:
                return dict(text=text, cancelled=True)
    if not done or finish is None or usage is None:
        return dict(error=f"stream ended early (done {done}, finish {finish}, usage {usage})")
    tokens = usage["completion_tokens"]
    return dict(text=text, tokens=tokens, finish=finish, ttft=stamps[0] - started,
                tpot=(stamps[-1] - stamps[0]) / max(1, tokens - 1), end=stamps[-1])


async def load(url: str, name: str, requests: list[tuple[str, int]], cancel: dict[int, int]):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        started = time.perf_counter()
        results = await asyncio.gather(*(stream_one(http, name, p, n, cancel.get(i))
                                         for i, (p, n) in enumerate(requests)))
        return results, started


def start_server(model: Path, port: int, args, extra: list[str] = (),
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvserve", "serve", "--model", str(model), "--port", str(port),
           "--served-model-name", "bench", "--dtype", args.dtype, "--max-num-seqs",
           str(args.max_num_seqs), "--log-level", "warning", *extra]
    if args.server_threads:
        cmd += ["--threads", str(args.server_threads)]
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not come up")
        time.sleep(0.2)


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default) so far."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--cancel", type=float, default=0.1, help="fraction of streams dropped")
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--server-threads", type=int, default=None,
                   help="the server's compute threads (serve --threads; default: all cores)")
    p.add_argument("--chaos", action="store_true",
                   help="run the hostile mixes of serve_chaos.py beside the clean load")
    args = p.parse_args()
    requests = workload(args.requests)
    rng = random.Random(1)
    cancel = {i: rng.randrange(1, 8) for i in rng.sample(range(args.requests),
                                                         int(args.cancel * args.requests))}

    llm = kvserve.LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    params = [kvserve.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for _, n in requests]
    started = time.perf_counter()
    offline = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    offline_seconds = time.perf_counter() - started
    del llm
    if args.chaos:
        return chaos(args, requests, [o.outputs[0].text for o in offline])

    port = free_port()
    server = start_server(args.model, port, args)
    url = f"http://127.0.0.1:{port}"
    try:
        client_cpu, server_cpu = cpu_seconds(), cpu_seconds(server.pid)
        results, started = asyncio.run(load(url, "bench", requests, cancel))
        client_cpu, server_cpu = cpu_seconds() - client_cpu, cpu_seconds(server.pid) - server_cpu
        running = metric(url, "kvserve:num_requests_running")
        waiting = metric(url, "kvserve:num_requests_waiting")
        deadline = time.monotonic() + 30  # cancelled requests are aborted at the next step
        while metric(url, "kvserve:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        usage = metric(url, "kvserve:kv_cache_usage_perc")
    finally:
        server.terminate()
        server.wait()

    errors = [(i, r["error"]) for i, r in enumerate(results) if "error" in r]
    finished = [(i, r) for i, r in enumerate(results) if "error" not in r and "cancelled" not in r]
    wrong = [i for i, r in finished
             if (r["text"], r["tokens"], r["finish"]) != (offline[i].outputs[0].text,
                                                          requests[i][1], "length")]
    bad_prefix = [i for i, r in enumerate(results) if r.get("cancelled")
                  and not offline[i].outputs[0].text.startswith(r["text"])]
    served_seconds = max(r["end"] for _, r in finished) - started
    served_tokens = sum(r["tokens"] for _, r in finished)
    offline_tokens = sum(len(o.outputs[0].token_ids) for o in offline)
    ttft = percentiles([r["ttft"] for _, r in finished])
    tpot = percentiles([r["tpot"] for _, r in finished])
    off_ttft = percentiles([o.metrics.time_to_first_token for o in offline])
    off_tpot = percentiles([o.metrics.time_per_output_token for o in offline])
    rows = [
        ["HTTP, streamed", len(finished), f"{len(finished) / served_seconds:.1f}",
         f"{served_tokens / served_seconds:.0f}", *(f"{x * 1e3:.0f}" for x in ttft),
         *(f"{x * 1e3:.1f}" for x in tpot)],
        ["LLM.generate", len(offline), f"{len(offline) / offline_seconds:.1f}",
         f"{offline_tokens / offline_seconds:.0f}", *(f"{x * 1e3:.0f}" for x in off_ttft),
         *(f"{x * 1e3:.1f}" for x in off_tpot)],
    ]
    print(f"\n{args.requests} concurrent streaming requests ({len(cancel)} cancelled by the "
          f"client), {args.model.name}, {args.dtype}:")
    print(markdown_table(["run", "requests done", "requests/s", "output tokens/s", "TTFT p50 ms",
                          "p90", "p99", "TPOT p50 ms", "p90", "p99"], rows))
    print(f"CPU seconds over the {served_seconds:.1f} s of the load: server {server_cpu:.1f}, "
          f"client {client_cpu:.1f} (2 cores: {2 * served_seconds:.1f}); offline "
          f"{offline_seconds:.1f} s")
    checks = dict(errors=len(errors), wrong_text=len(wrong), bad_cancelled_prefix=len(bad_prefix),
                  running_after=running, waiting_after=waiting, kv_cache_usage_after=usage)
    print("checks:", checks)
    path = write_json(HERE / "results" / "serve.json",
                      dict(args={k: shown(v) for k, v in vars(args).items()}, machine=machine_info(),
                           rows=rows, checks=checks, errors=errors[:10],
                           cpu=dict(server=server_cpu, client=client_cpu,
                                    served_seconds=served_seconds)))
    print(f"wrote {path}")
    if errors or wrong or bad_prefix or running or waiting or usage:
        sys.exit(1)


def wait_idle(url: str, timeout: float = 60.0) -> bool:
    """Until the server runs and waits for nothing, holds no KV block and is healthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(url, "kvserve:num_requests_running") == 0
                and metric(url, "kvserve:num_requests_waiting") == 0
                and metric(url, "kvserve:kv_cache_usage_perc") == 0
                and httpx.get(url + "/health").status_code == 200):
            return True
        time.sleep(0.1)
    return False


def chaos(args, requests, offline_texts: list[str]) -> None:
    from serve_chaos import HEADERS, MIXES, PeakRSS, run_mix, summarize

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The clean load and a mix's own streams fit the waiting bound; the flood does not. Stalled
    # readers are aborted after 2 s.
    server = start_server(args.model, port, args, ["--max-waiting-requests",
                                                   str(2 * args.requests),
                                                   "--max-stream-lag", "2"],
                          env={"KVSERVE_FAULT_INJECTION": "1"})
    rows, checks, rng = [], {}, random.Random(2)
    try:
        for mix in MIXES:
            with PeakRSS(server.pid) as rss:
                result = asyncio.run(run_mix(mix, url, port, "bench", requests, rng))
            row, check = summarize(mix, result, offline_texts, rss.peak)
            check["idle_and_healthy_after"] = wait_idle(url)
            rows.append(row)
            checks[mix] = check
            print(mix, check, flush=True)
        lag_aborts = metric(url, "kvserve:stream_lag_aborts_total")
        failed_steps = metric(url, "kvserve:failed_steps_total")
    finally:
        server.terminate()
        server.wait()
    print(f"\n{args.requests} clean streaming requests beside each mix, {args.model.name}, "
          f"{args.dtype} (server: --max-waiting-requests {2 * args.requests}, "
          f"--max-stream-lag 2, --threads {args.server_threads or 'all'}):")
    print(markdown_table(HEADERS, rows))
    print(f"stalled readers aborted for lag: {lag_aborts:.0f}; failed steps: {failed_steps:.0f}")
    path = write_json(HERE / "results" / "serve_chaos.json",
                      dict(args={k: shown(v) for k, v in vars(args).items()}, machine=machine_info(),
                           headers=HEADERS, rows=rows, checks=checks,
                           lag_aborts=lag_aborts, failed_steps=failed_steps))
    print(f"wrote {path}")
    bad = {mix: c for mix, c in checks.items()
           if c["wrong_text"] or c["clean_not_200"] or c["hostile_5xx"] or c["clean_failed"]
           or not c["idle_and_healthy_after"]}
    if bad:
        print("FAILED checks:", bad)
        sys.exit(1)


if __name__ == "__main__":
    main()
