"""Host time of an engine step: a 1-layer model with hidden size 64 keeps the forward small, so a
step's time is mostly bookkeeping, the sampler and the Python <-> C++ crossings (pybind11
conversions of every step's outputs). Two paths, 64 requests each:

- `stream`: `LLMEngine.step()` with an output per running request every step (what the server's
  engine loop does), logprobs 5;
- `generate`: `LLM.generate` (finished-only steps).

Each path runs once per --modes entry, interleaved: `sync` (one step at a time) and `async`
(async_scheduling: each step launched before the last one's samples are taken; on the CPU the
forward runs on the host's own cores, so this measures what the pipelining itself costs there).
Prints the median milliseconds per step over --repeats runs. Compare builds (e.g. the bindings'
optimization level) by running it once per build, interleaved:

    python benchmarks/bench_host_step.py [--repeats 5] [--modes sync async] [--label NAME]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvserve import LLM, LLMEngine, SamplingParams
from kvserve.testing.bench import cached_checkpoint, machine_info

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
NUM_REQUESTS = 64
MAX_TOKENS = 128


def prompts() -> list[list[int]]:
    return [[1, 2 + i % 500, 3, 4, 5, 6, 7, 8] for i in range(NUM_REQUESTS)]


def stream(path: Path, mode: str) -> float:
    """Milliseconds per step of LLMEngine.step() over 64 streaming requests with logprobs."""
    engine = LLMEngine(path, dtype="float32", max_num_seqs=NUM_REQUESTS, log_memory_plan=False,
                       async_scheduling=mode == "async")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=0, logprobs=5,
                            ignore_eos=True)
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, params, output_kind="delta")
    engine.step()  # the prefill
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) * 1e3 / steps


def generate(path: Path, mode: str) -> float:
    """Milliseconds per decode step of LLM.generate over 64 requests (finished-only steps)."""
    llm = LLM(path, dtype="float32", max_num_seqs=NUM_REQUESTS, log_memory_plan=False,
              async_scheduling=mode == "async")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts(), params, use_tqdm=False)
    return (time.perf_counter() - start) * 1e3 / MAX_TOKENS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["sync", "async"],
                        choices=("sync", "async"))
    parser.add_argument("--label", default="")
    parser.add_argument("--json", type=Path, help="append this run's figures to this file")
    parser.add_argument("--cache-dir", default="build/bench-models")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = cached_checkpoint(Path(args.cache_dir), "tiny-1-layer", "LlamaForCausalLM", TINY,
                             "float32")
    times = {f"{path_}_{mode}": [] for mode in args.modes for path_ in ("stream", "generate")}
    for _ in range(args.repeats):
        for mode in args.modes:
            times[f"stream_{mode}"].append(stream(path, mode))
            times[f"generate_{mode}"].append(generate(path, mode))
    result = {"label": args.label, "machine": machine_info(),
              **{k: statistics.median(v) for k, v in times.items()}}
    for mode in args.modes:
        print(f"{args.label or 'this build'}, {mode}: stream {result[f'stream_{mode}']:.3f} "
              f"ms/step, generate {result[f'generate_{mode}']:.3f} ms/step "
              f"(median of {args.repeats})")
    if args.json:
        runs = json.loads(args.json.read_text()) if args.json.exists() else []
        args.json.write_text(json.dumps(runs + [result], indent=1))


if __name__ == "__main__":
    main()
