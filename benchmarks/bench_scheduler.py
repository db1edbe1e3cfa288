"""Engine bookkeeping cost against queue length: adding, aborting and stepping with thousands of
waiting requests, and get_stats() after thousands of finished ones. Each cost should stay flat as
the queue grows (no linear scan of the waiting or running lists per operation).

A tiny random model (2 layers, hidden 64) keeps the forward small, so the step's time is mostly
bookkeeping. Run it with another interpreter (e.g. a venv holding an older kvserve build) to
compare versions on the same machine:

    python benchmarks/bench_scheduler.py [--sizes 100 1000 10000] [--label NAME]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvserve import LLMEngine, SamplingParams
from kvserve.testing.bench import cached_checkpoint, machine_info, markdown_table, write_json

RESULTS = Path(__file__).resolve().parent / "results"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)


def engine(path: Path) -> LLMEngine:
    return LLMEngine(path, dtype="float32", max_num_seqs=4, num_blocks=2048,
                     log_memory_plan=False)


def measure(path: Path, size: int) -> dict:
    """Microseconds per add, per abort of a waiting request, per step (4 running, `size` waiting),
    and per get_stats() after `size` finished requests."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    e = engine(path)
    prompts = [[1, 2 + i % 500, 3, 4, 5, 6, 7, 8] for i in range(size)]
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        e.add_request(str(i), prompt, params)
    add = (time.perf_counter() - t0) / size
    steps = []
    for _ in range(30):
        t0 = time.perf_counter()
        e.step()
        steps.append(time.perf_counter() - t0)
    victims = [str(i) for i in range(size - 1, max(size - 201, 0), -1)]  # the back of the queue
    t0 = time.perf_counter()
    for request_id in victims:
        e.abort_request(request_id)
    abort = (time.perf_counter() - t0) / len(victims)

    done = engine(path)  # `size` requests finished, one token each
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        done.add_request(str(i), prompt, one)
    while done.has_unfinished_requests():
        done.step()
    stats = []
    for _ in range(20):
        t0 = time.perf_counter()
        done.get_stats()
        stats.append(time.perf_counter() - t0)
    return {"waiting": size, "add_us": add * 1e6, "abort_waiting_us": abort * 1e6,
            "step_us": statistics.median(steps) * 1e6, "get_stats_us": min(stats) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--label", default="kvserve")
    parser.add_argument("--cache-dir", default="build/bench-models")
    args = parser.parse_args()
    torch.manual_seed(0)
    path = cached_checkpoint(Path(args.cache_dir), "tiny", "LlamaForCausalLM", TINY, "float32")
    rows = [measure(path, size) for size in args.sizes]
    print(f"{args.label}: cost per operation (microseconds) against queue length")
    print(markdown_table(["requests waiting / finished", "add", "abort (waiting)",
                          "step (4 running)", "get_stats"],
                         [[r["waiting"], f"{r['add_us']:.1f}", f"{r['abort_waiting_us']:.1f}",
                           f"{r['step_us']:.0f}", f"{r['get_stats_us']:.1f}"] for r in rows]))
    write_json(RESULTS / f"scheduler-{args.label}.json",
               {"label": args.label, "machine": machine_info(), "rows": rows})


if __name__ == "__main__":
    main()
