"""KV-cache waste: paged blocks vs per-request max-length pre-allocation.

Simulates serving a few hundred requests with a realistic length mix (log-normal prompt and output
lengths, roughly the ShareGPT shape the vLLM paper used, capped at the context) through
kvserve's real PagedBlockManager: up to --max-running requests decode together, one token each per
step, and a finished request's place goes to the next one. At every step it records

    waste = (reserved - used) / reserved

where `used` is the tokens held by running requests and `reserved` is the KV slots set aside for
them: whole blocks for the paged cache (the partly filled last block is the only waste), and
max_model_len slots per request for pre-allocation (what a static engine must reserve, since it
cannot know the output length). Reports the step-weighted mean and the value at peak usage.

    python benchmarks/bench_kv_waste.py [--requests 300] [--block-sizes 8 16 32]
"""

from __future__ import annotations

import argparse
import math
import random
from collections import deque
from pathlib import Path

import kvserve  # noqa: F401  (loads libtorch before the extension)
from kvserve._C import PagedBlockManager
from kvserve.testing.bench import markdown_table, write_json

RESULTS = Path(__file__).resolve().parent / "results"


def length_mix(n: int, max_model_len: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths: log-normal, medians ~ 100 and ~ 200 tokens, long tails."""
    rng = random.Random(seed)
    mix = []
    for _ in range(n):
        prompt = max(4, min(int(rng.lognormvariate(math.log(100), 0.9)), max_model_len // 2))
        output = max(1, min(int(rng.lognormvariate(math.log(200), 0.8)), max_model_len - prompt))
        mix.append((prompt, output))
    return mix


def simulate(mix, block_size: int, max_running: int, max_model_len: int) -> dict:
    usable = max_running * -(-max_model_len // block_size)  # never the bottleneck here
    manager = PagedBlockManager(usable + 1, block_size, enable_prefix_caching=False, watermark=0.0)
    waiting = deque(enumerate(mix))
    running: dict[int, int] = {}  # seq id -> tokens still to generate
    paged, prealloc = [], []
    peak = (0, 0.0, 0.0)
    rng = random.Random(0)
    while waiting or running:
        while waiting and len(running) < max_running:
            seq_id, (prompt, output) = waiting.popleft()
            manager.allocate(seq_id, [rng.randrange(32000) for _ in range(prompt)])
            manager.mark_computed(seq_id, prompt)
            running[seq_id] = output
        used = sum(manager.num_tokens(s) for s in running)
        reserved_paged = sum(len(manager.block_table(s)) for s in running) * block_size
        reserved_prealloc = len(running) * max_model_len
        paged.append((reserved_paged - used) / reserved_paged)
        prealloc.append((reserved_prealloc - used) / reserved_prealloc)
        if used > peak[0]:
            peak = (used, paged[-1], prealloc[-1])
        for seq_id in list(running):  # one decode step
            manager.append_slots(seq_id, [rng.randrange(32000)])
            manager.mark_computed(seq_id, manager.num_tokens(seq_id))
            running[seq_id] -= 1
            if running[seq_id] == 0:
                manager.free(seq_id)
                del running[seq_id]
    manager.check_invariants()
    assert manager.num_free_blocks() == manager.num_usable_blocks()
    return dict(block_size=block_size, steps=len(paged),
                paged_mean=sum(paged) / len(paged), prealloc_mean=sum(prealloc) / len(prealloc),
                peak_tokens=peak[0], paged_at_peak=peak[1], prealloc_at_peak=peak[2])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    mix = length_mix(args.requests, args.max_model_len, args.seed)
    prompts = sorted(m[0] for m in mix)
    outputs = sorted(m[1] for m in mix)
    print(f"{args.requests} requests, up to {args.max_running} running, max_model_len "
          f"{args.max_model_len}; prompt tokens median {prompts[len(mix) // 2]} / max "
          f"{prompts[-1]}, output tokens median {outputs[len(mix) // 2]} / max {outputs[-1]}")
    results = [simulate(mix, bs, args.max_running, args.max_model_len) for bs in args.block_sizes]
    rows = [[r["block_size"], f"{r['paged_mean'] * 100:.2f}%", f"{r['paged_at_peak'] * 100:.2f}%",
             f"{r['prealloc_mean'] * 100:.1f}%", f"{r['prealloc_at_peak'] * 100:.1f}%"]
            for r in results]
    print(markdown_table(["block size", "paged waste (mean)", "paged waste (at peak)",
                          "pre-allocated waste (mean)", "pre-allocated waste (at peak)"], rows))
    path = write_json(RESULTS / "kv_waste.json", dict(args=vars(args), results=results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
