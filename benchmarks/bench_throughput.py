"""Offline throughput: kvserve's continuous batching vs transformers' static batches.

128 requests (by default) with prompt and output lengths drawn uniformly (32-512 in, 32-256 out),
ignore_eos, so both engines produce exactly the requested tokens. kvserve runs them all through
LLM.generate (continuous batching, chunked prefill, paged KV). transformers runs `generate` over
static batches of --hf-batch-size padded prompts (left padding), each batch decoding until its
longest request is done; only the requested tokens count as useful output. Same checkpoint,
dtype and machine, one run. With --repeats N the two engines alternate N times and the table
gives the medians (a virtual machine's speed drifts between minutes; alternating lets both see
the same drift).

    python benchmarks/bench_throughput.py [--models target llama-100m] [--requests 128]
    python benchmarks/bench_throughput.py --models target --repeats 5
    python benchmarks/bench_throughput.py --quick      # a small smoke run
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

import kvserve
from kvserve.testing.bench import (cached_checkpoint, machine_info, markdown_table, median,
                                   write_json)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LLAMA_100M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                  tie_word_embeddings=False, max_position_embeddings=4096)


def model_dir(name: str, dtype: str) -> Path:
    """The shipped target, the ~100M Llama, one of bench_decode.py's random models (e.g.
    deepseek-v2-lite-4l, the same checkpoint), or a directory."""
    from bench_decode import COMMON, MODELS

    if name == "target":
        return REPO / "models" / "shakespeare-target"
    if name == "llama-100m":
        return cached_checkpoint(HERE / ".cache", name, "LlamaForCausalLM", LLAMA_100M, dtype)
    if name in MODELS:
        arch, config = MODELS[name]
        return cached_checkpoint(HERE / ".cache", name, arch, {**COMMON, **config}, dtype)
    return Path(name)


def workload(n: int, vocab: int, prompt_range, output_range, seed: int):
    rng = random.Random(seed)
    return [([1] + [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range) - 1)],
             rng.randint(*output_range)) for _ in range(n)]


def run_kvserve(path: Path, dtype: str, requests, max_num_batched_tokens: int) -> dict:
    llm = kvserve.LLM(path, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens)
    params = [kvserve.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for _, n in requests]
    started = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    wall = time.perf_counter() - started
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in requests]
    return dict(wall_s=wall, preemptions=llm.llm_engine.get_stats().num_preemptions)


def run_hf(path: Path, dtype: str, requests, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    pad = 0
    started = time.perf_counter()
    generated = 0
    for b in range(0, len(requests), batch_size):
        batch = requests[b:b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(n for _, n in batch)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=pad)
        generated += (out.shape[1] - width) * len(batch)
    return dict(wall_s=time.perf_counter() - started, generated_tokens=generated)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["target", "llama-100m"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt-range", type=int, nargs=2, default=[32, 512])
    p.add_argument("--output-range", type=int, nargs=2, default=[32, 256])
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--repeats", type=int, default=1, help="alternating runs of both engines")
    p.add_argument("--quick", action="store_true", help="16 requests, short lengths, target only")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.models, args.requests = ["target"], 16
        args.prompt_range, args.output_range = [16, 64], [8, 32]

    rows, results = [], []
    for name in args.models:
        path = model_dir(name, args.dtype)
        vocab = kvserve.LLM(path, dtype=args.dtype, num_blocks=2).config.vocab_size
        requests = workload(args.requests, vocab, args.prompt_range, args.output_range, args.seed)
        useful = sum(n for _, n in requests)
        prompt_tokens = sum(len(q) for q, _ in requests)
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(run_kvserve(path, args.dtype, requests, args.max_num_batched_tokens))
            if not args.skip_hf:
                theirs.append(run_hf(path, args.dtype, requests, args.hf_batch_size))
            print(f"{name}: kvserve {ours[-1]['wall_s']:.1f} s"
                  + (f", transformers {theirs[-1]['wall_s']:.1f} s" if theirs else ""), flush=True)
        ours_s = median([r["wall_s"] for r in ours])
        theirs_s = median([r["wall_s"] for r in theirs]) if theirs else float("nan")
        ratios = [h["wall_s"] / k["wall_s"] for k, h in zip(ours, theirs)]
        results.append(dict(model=name, requests=args.requests, prompt_tokens=prompt_tokens,
                            output_tokens=useful, kvserve=ours, hf=theirs, speedups=ratios))
        rows.append([name, args.dtype, f"{prompt_tokens:,} / {useful:,}", f"{useful / ours_s:.0f}",
                     f"{useful / theirs_s:.0f}" if theirs else "-",
                     f"{median(ratios):.1f}x" if theirs else "-",
                     " / ".join(f"{r:.1f}" for r in ratios) if theirs else "-",
                     max(r["preemptions"] for r in ours)])
    print(markdown_table(["model", "dtype", "prompt / output tokens", "kvserve output tok/s",
                          f"HF static batch {args.hf_batch_size} output tok/s", "speedup",
                          "speedup per repeat", "preemptions"], rows))
    path = write_json(HERE / "results" / "throughput.json",
                      dict(machine=machine_info(), args=vars(args), results=results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
