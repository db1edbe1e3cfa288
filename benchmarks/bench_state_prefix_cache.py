"""Prefix caching of state-space models: time to first token of a prompt whose long prefix an
earlier request computed, with states saved at block boundaries (num_state_snapshots) against
prefix caching off, on bench_state_models.py's random Mamba2 (16 layers) and Granite hybrid (8
Mamba2 mixers, 2 attention layers).

Each repeat draws a new prefix of --prefixes tokens (a system prompt), and three requests that
each add 16 tokens of their own run one after another to their first token. A computes the prefix;
B finds A's blocks but no state where its prompt parts from A's, so it ends a prefill chunk there
and saves the state (as A did at its own last boundary, its prefill's last tokens one step later);
C resumes from that state (and, in the hybrid, that prefix's KV) and prefills only its own tokens.
Without snapshots, each prefills everything. The two engines alternate at every repeat; medians.

    python benchmarks/bench_state_prefix_cache.py [--prefixes 1000,3000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import kvserve
from bench_state_models import MODELS, checkpoint
from kvserve.testing.bench import machine_info, markdown_table, write_json

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
NAMES = ["Mamba2 (16 layers)", "Granite hybrid (10 layers, 2 attention)"]
SNAPSHOTS = 8


def first_token_seconds(e: kvserve.LLMEngine, request_id: str, prompt: list[int]) -> float:
    params = kvserve.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    e.add_request(request_id, prompt, params)
    started = time.perf_counter()
    while not any(out.outputs[0].token_ids for out in e.step() if out.request_id == request_id):
        pass
    seconds = time.perf_counter() - started
    while e.has_unfinished_requests():
        e.step()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prefixes", default="1000,3000")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    prefixes = [int(n) for n in args.prefixes.split(",")]
    rng = random.Random(0)
    rows, raw = [], {}
    for name in NAMES:
        path = checkpoint(name)
        engines = {
            snapshots: kvserve.LLMEngine(path, dtype="float32", max_num_seqs=2,
                                         max_model_len=max(prefixes) + 64,
                                         max_num_batched_tokens=2048,
                                         num_state_snapshots=snapshots, log_memory_plan=False)
            for snapshots in (0, SNAPSHOTS)}
        for prefix_len in prefixes:
            times = {s: {"A": [], "B": [], "C": []} for s in engines}
            for r in range(args.repeats):
                for snapshots, e in engines.items():  # alternated at every repeat
                    prefix = [1] + [rng.randrange(3, 8000) for _ in range(prefix_len - 1)]
                    for request in "ABC":
                        own = [rng.randrange(3, 8000) for _ in range(16)]
                        times[snapshots][request].append(
                            first_token_seconds(e, f"{request}{r}", prefix + own))
            med = {s: {k: statistics.median(v) for k, v in t.items()} for s, t in times.items()}
            raw[f"{name} {prefix_len}"] = med
            off, on = med[0], med[SNAPSHOTS]
            rows.append([name, f"{prefix_len:,}", f"{off['C'] * 1e3:.0f}", f"{on['C'] * 1e3:.0f}",
                         f"{off['C'] / on['C']:.1f}x", f"{on['A'] / off['A']:.2f}x",
                         f"{on['B'] / off['B']:.2f}x"])
            print(rows[-1], flush=True)
    columns = ["model", "shared prefix tokens", "C's TTFT ms, caching off",
               f"C's TTFT ms, {SNAPSHOTS} snapshots", "speedup", "A's TTFT, snapshots / off",
               "B's TTFT, snapshots / off"]
    print(markdown_table(columns, rows))
    info = machine_info()
    write_json(RESULTS / "state_prefix_cache_raw.json",
               dict(args=vars(args), machine=info, results=raw))
    section = dict(
        title="State-space models: prefix caching through saved states",
        command=f"python benchmarks/bench_state_prefix_cache.py --prefixes {args.prefixes} "
                f"--repeats {args.repeats}",
        machine=(f"{info['cpu']} {info['logical_cpus']}-vCPU VM "
                 f"({info['kvserve_cpu_capability']}); torch {info['torch']}"),
        date=time.strftime("%Y-%m-%d"),
        description=(
            "Three requests share a prefix (a system prompt) and add 16 tokens each, one after "
            f"another: time to first token with {SNAPSHOTS} state snapshots (states saved at "
            "block boundaries, [models.md](models.md#state-space-models-mamba-mamba2-and-hybrids))"
            " and with prefix caching off. A computes the prefix; B finds A's blocks but no state "
            "where its prompt parts from A's, and saves one there; C resumes from it. A's and B's "
            "ratios are what the saving costs (a prefill chunk ends at a boundary: one more step "
            "for its last tokens). Random fp32 checkpoints of bench_state_models.py; medians of "
            f"{args.repeats} repeats, the two engines alternated."),
        tables=[dict(title="Time to first token with a cached prefix", columns=columns,
                     rows=rows, description="C's prompt: the shared prefix and 16 tokens of "
                     "its own.")])
    path = write_json(RESULTS / "state_prefix_cache.json", section)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
