"""The sampling ops on the CPU against transformers' logits warpers, on the same logits.

    python benchmarks/bench_sampling.py [--vocab 32000 151936] [--rows 1 16 64] [--repeats 7]

Per vocabulary, batch (rows) and setting, the time to turn one step's fp32 logits into tokens:
  kvserve        sampling_filter_logits (temperature, top-k, top-p, min-p in one op) then
                 sampling_from_logits (argmax, or inverse CDF from one uniform per row);
  transformers   the warpers `generate` chains (TemperatureLogitsWarper, TopKLogitsWarper,
                 TopPLogitsWarper, MinPLogitsWarper), then softmax + torch.multinomial, or argmax.
Settings: greedy; temperature 0.8; top-k 50 + top-p 0.9; top-p 0.9 alone (no top-k: every
token takes part); min-p 0.05. kvserve's filter works in place, on a copy of the logits in a
buffer it keeps; the warpers return new tensors. The two alternate call by call; medians of --repeats timings of
--calls calls each. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing.bench import machine_info, markdown_table, median, write_json

HERE = Path(__file__).resolve().parent
ops = torch.ops.kvserve

# name: (temperature, top_k, top_p, min_p); top_k -1 and top_p 1 are off.
SETTINGS = {
    "greedy": (0.0, -1, 1.0, 0.0),
    "temperature 0.8": (0.8, -1, 1.0, 0.0),
    "top-k 50 + top-p 0.9": (0.8, 50, 0.9, 0.0),
    "top-p 0.9": (0.8, -1, 0.9, 0.0),
    "min-p 0.05": (0.8, -1, 1.0, 0.05),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--out", type=Path, default=HERE / "results" / "sampling.json")
    return p.parse_args()


def kvserve_sampler(rows: int, setting: tuple):
    temperature, top_k, top_p, min_p = setting
    params = (torch.full((rows,), temperature), torch.full((rows,), top_k, dtype=torch.long),
              torch.full((rows,), top_p), torch.full((rows,), min_p))
    uniform = torch.rand(rows)
    scratch = {}

    def sample(logits: torch.Tensor) -> torch.Tensor:
        if temperature > 0:  # the filter works in place: on a copy in a buffer kept between calls
            work = scratch.setdefault("logits", torch.empty_like(logits)).copy_(logits)
            ops.sampling_filter_logits(work, *params)
            logits = work
        return ops.sampling_from_logits(logits, params[0], uniform)

    return sample


def transformers_sampler(setting: tuple):
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    temperature, top_k, top_p, min_p = setting
    warpers = LogitsProcessorList()
    if temperature > 0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))

    def sample(logits: torch.Tensor) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax(dim=-1)
        scores = warpers(None, logits)
        return torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)

    return sample


def main() -> None:
    args = parse_args()
    gen = torch.Generator().manual_seed(0)
    results, table = [], []
    for vocab in args.vocab:
        for rows in args.rows:
            # Logits of a trained model's shape: a few likely tokens over a long tail.
            logits = torch.randn(rows, vocab, generator=gen) * 2.5
            for name, setting in SETTINGS.items():
                engines = {"kvserve": kvserve_sampler(rows, setting),
                           "transformers": transformers_sampler(setting)}
                times = {engine: [] for engine in engines}
                for fn in engines.values():
                    fn(logits)  # warm-up
                for _ in range(args.repeats):
                    for engine, fn in engines.items():
                        start = time.perf_counter()
                        for _ in range(args.calls):
                            fn(logits)
                        times[engine].append((time.perf_counter() - start) / args.calls)
                ours, theirs = median(times["kvserve"]), median(times["transformers"])
                results.append(dict(vocab=vocab, rows=rows, setting=name, kvserve_ms=ours * 1e3,
                                    transformers_ms=theirs * 1e3, speedup=theirs / ours))
                table.append([f"{vocab:,}", rows, name, f"{ours * 1e3:.3f}",
                              f"{theirs * 1e3:.3f}", f"{theirs / ours:.1f}x"])
                print(table[-1], flush=True)
    print(markdown_table(["vocab", "rows", "setting", "kvserve ms", "transformers ms",
                          "speed-up"], table))
    write_json(args.out, dict(machine=machine_info(), args={k: str(v) for k, v in
                                                             vars(args).items()},
                              results=results))


if __name__ == "__main__":
    main()
