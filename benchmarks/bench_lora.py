"""Throughput of LoRA adapters served per request, against the same batch on the base model.

    python benchmarks/bench_lora.py [--model llama-100m] [--requests 32] [--adapters 4]

One batch of --requests requests (prompts of --prompt-tokens, --output-tokens generated, greedy,
ignore_eos) runs through LLM.generate in each configuration:
  base          the base model, LoRA off;
  lora, none    enable_lora=True, no request names an adapter (the cost of the machinery);
  lora, 1       every request with one adapter;
  lora, N       the requests spread round-robin over --adapters adapters (all loaded at once);
  merged        the one adapter merged into the weights (kvserve merge-lora): the same outputs
                as "lora, 1" at the base model's cost.
Adapters are peft's, random, rank --rank on every linear of every layer. Configurations alternate
--repeats times; the table gives median output tokens/s and the ratio to the base model. Writes
JSON to --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import kvserve
from kvserve.testing.bench import machine_info, markdown_table, median, write_json

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-100m",
                   help="target, llama-100m (random, cached), or a checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results" / "lora.json")
    return p.parse_args()


def make_adapters(base: Path, n: int, rank: int) -> tuple[list[Path], Path]:
    """n random all-linear adapters of `base` (cached beside it) and the first one merged."""
    from tests.models.test_lora import make_adapter

    root = base.with_name(base.name + f"-lora-r{rank}")
    paths = [root / f"adapter-{i}" for i in range(n)]
    for i, path in enumerate(paths):
        if not (path / "adapter_model.safetensors").is_file():
            make_adapter(base, path, seed=i, r=rank, lora_alpha=2 * rank,
                         target_modules="all-linear")
    merged = root / "merged-0"
    if not (merged / "model.safetensors").is_file():
        kvserve.merge_lora(base, paths[0], merged)
    return paths, merged


def main() -> None:
    from bench_throughput import model_dir, workload

    args = parse_args()
    base = model_dir(args.model, args.dtype)
    adapters, merged = make_adapters(base, args.adapters, args.rank)
    llms = {
        "base": kvserve.LLM(base, dtype=args.dtype),
        "lora": kvserve.LLM(base, dtype=args.dtype, enable_lora=True, max_loras=args.adapters,
                            max_lora_rank=args.rank),
        "merged": kvserve.LLM(merged, dtype=args.dtype),
    }
    requests = workload(args.requests, llms["base"].config.vocab_size,
                        (args.prompt_tokens, args.prompt_tokens),
                        (args.output_tokens, args.output_tokens), seed=0)
    prompts = [p for p, _ in requests]
    params = kvserve.SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    refs = [kvserve.LoRARequest(f"adapter-{i}", path) for i, path in enumerate(adapters)]
    configs = {
        "base": ("base", None),
        "lora, none": ("lora", None),
        "lora, 1": ("lora", [refs[0]] * len(prompts)),
        f"lora, {args.adapters}": ("lora", [refs[i % len(refs)] for i in range(len(prompts))]),
        "merged": ("merged", None),
    }
    for name, (engine, lora) in configs.items():  # warm: load adapters, touch every path
        llms[engine].generate(prompts[:2], params, use_tqdm=False,
                              lora=lora[:2] if lora else None)
    times: dict[str, list[float]] = {name: [] for name in configs}
    outputs: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, (engine, lora) in configs.items():
            started = time.perf_counter()
            outs = llms[engine].generate(prompts, params, use_tqdm=False, lora=lora)
            times[name].append(time.perf_counter() - started)
            outputs[name] = [o.outputs[0].token_ids for o in outs]
    same = outputs["lora, 1"] == outputs["merged"]
    tokens = args.requests * args.output_tokens
    base_tps = tokens / median(times["base"])
    rows = [dict(config=name, tokens_per_s=tokens / median(t), seconds=median(t),
                 vs_base=tokens / median(t) / base_tps) for name, t in times.items()]
    print(markdown_table(["configuration", "output tok/s", "vs base"],
                         [[r["config"], f"{r['tokens_per_s']:.1f}", f"{r['vs_base']:.2f}x"]
                          for r in rows]))
    print(f"'lora, 1' tokens equal the merged model's: {same}")
    write_json(args.out, dict(rows=rows, lora_equals_merged=same, model=str(base),
                              rank=args.rank, adapters=args.adapters, requests=args.requests,
                              prompt_tokens=args.prompt_tokens,
                              output_tokens=args.output_tokens, dtype=args.dtype,
                              threads=torch.get_num_threads(), machine=machine_info()))


if __name__ == "__main__":
    main()
