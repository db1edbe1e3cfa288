"""Replicas and prefill/decode disaggregation on this machine, one core per worker.

    python benchmarks/bench_disaggregation.py [--requests 16] [--rate 0.5]

One mix of requests, sent by streaming clients: half bring long prompts and few tokens out, half
short prompts and many. It is sent once with Poisson arrivals (latencies) and once all at once
(throughput), against three setups, each started with `kvserve launch` (vllm-router in front,
--threads-per-worker 1):
- one worker (one core);
- two replicas (two cores, round robin);
- one prefill worker and one decode worker (two cores, the router's PD mode).
Per setup: TTFT and TPOT p50/p99 as the clients see them, requests and tokens per second, and
for the disaggregated one the mean KV transfer time per request (the consumer's /metrics). The
results go to benchmarks/results/disaggregation.json, in the shape report.py publishes."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvserve.launch import wait_healthy
from kvserve.server.serve import free_port
from kvserve.testing.bench import cached_checkpoint, machine_info, write_json

ROOT = Path(__file__).resolve().parent.parent
# A random Llama of ~57M parameters (226 MB in fp32): on one core a decode step reads its
# weights in ~25 ms and a 768-token prompt takes ~1-2 s, so a prefill visibly stalls the decodes
# that share its engine.
SHAPE = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048, vocab_size=2048, max_position_embeddings=2048)
LONG, SHORT = (768, 16), (64, 128)  # (prompt tokens, tokens out)


def workload(count: int, rate: float | None, seed: int) -> list[tuple[float, dict]]:
    """(arrival second, completion body): long prompts with few tokens out and short prompts
    with many, alternating, greedy, as token ids. rate None: all at once."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(count):
        if rate is not None:
            t += rng.expovariate(rate)
        length, max_tokens = LONG if i % 2 == 0 else SHORT
        prompt = [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(length)]
        out.append((t, {"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                        "temperature": 0.0, "ignore_eos": True, "stream": True}))
    return out


async def one(http, url: str, at: float, start: float, body: dict) -> tuple[float, float, int]:
    """(TTFT, TPOT, tokens) of one streamed request sent at start + at."""
    await asyncio.sleep(max(0.0, start + at - time.monotonic()))
    sent = time.monotonic()
    first, tokens = None, 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                tokens += 1
                first = first or time.monotonic()
    done = time.monotonic()
    return first - sent, (done - first) / max(1, tokens - 1), tokens


def run_workload(url: str, requests: list[tuple[float, dict]]) -> tuple[list, float]:
    async def go():
        async with httpx.AsyncClient(timeout=600) as http:
            start = time.monotonic()
            results = await asyncio.gather(*(one(http, url, at, start, b) for at, b in requests))
            return results, time.monotonic() - start
    return asyncio.run(go())


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def launch(model: Path, setup: list[str], port: int, worker_port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvserve", "launch", *setup, "--port", str(port),
           "--worker-port", str(worker_port), "--router-policy", "round_robin",
           "--threads-per-worker", "1", "--", "--model", str(model), "--dtype", "float32",
           "--served-model-name", "m", "--max-model-len", "1024", "--log-level", "warning",
           "--max-num-batched-tokens", "512"]
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.DEVNULL)


def summary(results: list, seconds: float) -> dict:
    ttft = [r[0] for r in results]
    tpot = [r[1] for r in results if r[2] > 1]
    return {"ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "tpot_p50": percentile(tpot, 0.5), "tpot_p99": percentile(tpot, 0.99),
            "requests_per_s": len(results) / seconds,
            "tokens_per_s": sum(r[2] for r in results) / seconds}


def measure(model: Path, name: str, setup: list[str], latency, burst, warmup) -> dict:
    """The setup under the Poisson workload (latencies) and under the burst (throughput)."""
    port, worker_port = free_port(), 20000 + random.randrange(20000)
    process = launch(model, setup, port, worker_port)
    url = f"http://127.0.0.1:{port}"
    # The decode worker follows the prefill worker; its pulls are the transfers.
    decode_url = f"http://127.0.0.1:{worker_port + 1}"
    names = ("kv_transfer_seconds", "kv_transfers_loaded")
    disaggregated = "--decode" in setup
    try:
        wait_healthy(url, process, 300)
        run_workload(url, warmup)
        before = [metric(decode_url, f"kvserve:{m}_total") if disaggregated else 0.0
                  for m in names]
        out = {"setup": name, "latency": summary(*run_workload(url, latency))}
        after = [metric(decode_url, f"kvserve:{m}_total") if disaggregated else 0.0
                 for m in names]
        out["throughput"] = summary(*run_workload(url, burst))
    finally:
        process.terminate()
        process.wait(timeout=60)
    transfers = after[1] - before[1]
    out["transfer_ms"] = (after[0] - before[0]) / transfers * 1e3 if transfers else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0.5, help="arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = cached_checkpoint(ROOT / "benchmarks" / ".cache", "disaggregation",
                              "LlamaForCausalLM", SHAPE, "float32")
    latency = workload(args.requests, args.rate, args.seed)
    burst = workload(args.requests, None, args.seed + 2)
    warmup = workload(4, None, args.seed + 1)
    setups = [("1 worker", ["--replicas", "1"]), ("2 replicas", ["--replicas", "2"]),
              ("1 prefill + 1 decode", ["--prefill", "1", "--decode", "1"])]
    latency_rows, throughput_rows = [], []
    for name, setup in setups:
        r = measure(model, name, setup, latency, burst, warmup)
        print(json.dumps(r), flush=True)
        lat, thr = r["latency"], r["throughput"]
        latency_rows.append([
            name, f"{lat['ttft_p50'] * 1e3:.0f}", f"{lat['ttft_p99'] * 1e3:.0f}",
            f"{lat['tpot_p50'] * 1e3:.1f}", f"{lat['tpot_p99'] * 1e3:.1f}",
            "-" if r["transfer_ms"] is None else f"{r['transfer_ms']:.1f}"])
        throughput_rows.append([name, f"{thr['requests_per_s']:.2f}",
                                f"{thr['tokens_per_s']:.0f}", f"{thr['ttft_p50'] * 1e3:.0f}",
                                f"{thr['tpot_p50'] * 1e3:.1f}"])
    command = (f"python benchmarks/bench_disaggregation.py --requests {args.requests} "
               f"--rate {args.rate}")
    write_json(ROOT / "benchmarks" / "results" / "disaggregation.json", {
        "title": "Replicas and prefill/decode disaggregation",
        "command": command, "machine": machine_info(),
        "description": (
            f"{args.requests} streamed completions alternating long prompts ({LONG[0]} "
            f"tokens, {LONG[1]} out) and short ones ({SHORT[0]} tokens, {SHORT[1]} out), "
            "greedy, on a random Llama of 57M parameters in fp32 (hidden 768, 8 layers, 12 "
            "heads, 4 KV heads). Each setup is started by `kvserve launch` behind vllm-router "
            "(round robin), one core per worker, prefill chunks of 512 tokens; the latencies "
            "are the clients'."),
        "tables": [
            {"title": "Latency", "columns": ["setup", "TTFT p50 ms", "TTFT p99 ms",
                                             "TPOT p50 ms", "TPOT p99 ms",
                                             "KV transfer ms/request"],
             "description": f"Poisson arrivals at {args.rate}/s. The transfer time runs from "
                            "the start of the consumer's pull to its last page.",
             "rows": latency_rows},
            {"title": "Throughput", "columns": ["setup", "requests/s", "tokens/s",
                                                "TTFT p50 ms", "TPOT p50 ms"],
             "description": "The same number of requests, all sent at once.",
             "rows": throughput_rows}]})


if __name__ == "__main__":
    main()
