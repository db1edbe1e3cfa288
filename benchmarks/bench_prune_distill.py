"""Prune a trained model to about a half and a quarter of its parameters, distil, and compare.

    python benchmarks/bench_prune_distill.py [--teacher models/shakespeare-target] [--steps 600]

For each size: `kvserve prune` (Minitron's activation scores on calibration windows of the
training split) -> `kvserve distill` from the teacher (forward KL on kvserve's logits), against
(a) the pruned model before distillation and (b) a model of the same shape trained from scratch
(scripts/train_tiny.py, next-token loss) on the same number of training tokens. Validation
perplexity is kvserve's (strided windows of 512, stride 256, the model cards' method) over the
corpus's last tenth, which neither training saw (train perplexity: a slice of the training
split of the same size). Decode speed: batch-1 greedy decoding with
kvserve, median of --repeats, models interleaved; KV cache bytes per token in fp32. Draft
acceptance: the teacher decoding greedily with each small model as its speculative draft, over
prompts from the validation text, against the shipped draft.

Prints a markdown table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import torch

import kvserve
from kvserve import training
from kvserve.distill import DistillConfig, distill
from kvserve.perplexity import evaluate_perplexity
from kvserve.prune import prune_checkpoint

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVSERVE_SHARED_DATA") or REPO.parent / "shared" / "data")

# Targets for the 6.8M-parameter Shakespeare model (hidden 320, 8 heads of 40 in 2 KV groups, MLP
# 864, 6 layers): width pruning, which Minitron found to distil better than depth pruning.
SIZES = {
    "half": dict(hidden=224, intermediate=576),
    "quarter": dict(hidden=160, intermediate=384, heads=4),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", type=Path, default=REPO / "models" / "shakespeare-target")
    p.add_argument("--draft", type=Path, default=REPO / "models" / "shakespeare-draft",
                   help="the shipped draft to compare acceptance with")
    p.add_argument("--corpus", type=Path, default=SHARED / "tinyshakespeare" / "input.txt")
    p.add_argument("--work", type=Path, default=Path("/tmp/kvserve-prune-distill"),
                   help="where the pruned, distilled and scratch checkpoints go")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--steps", type=int, default=600, help="distillation = scratch training steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--calibration-tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=16, help="speculative-decoding prompts")
    p.add_argument("--reuse", action="store_true", help="keep checkpoints already in --work")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" /
                   "prune_distill.json")
    return p.parse_args()


def parameters(model_dir: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(model_dir / "model.safetensors").values())


def kv_bytes_per_token(model_dir: Path) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4


def perplexity(model_dir: Path, val_text: str) -> float:
    llm = kvserve.LLM(model_dir, dtype=torch.float32, max_model_len=513, log_memory_plan=False)
    ids = llm.tokenizer.encode(val_text)
    return evaluate_perplexity(llm, ids, 512, 256).perplexity


def train_scratch(pruned: Path, out: Path, args, tokens: int) -> None:
    """A model of the pruned one's shape, from random weights, on `tokens` training tokens."""
    c = json.loads((pruned / "config.json").read_text())
    steps = max(1, tokens // (args.batch_size * args.seq_len))
    cmd = [sys.executable, str(REPO / "scripts" / "train_tiny.py"), "--out", str(out),
           "--corpus", str(args.corpus), "--tokenizer", str(args.teacher),
           "--hidden-size", str(c["hidden_size"]),
           "--num-hidden-layers", str(c["num_hidden_layers"]),
           "--num-attention-heads", str(c["num_attention_heads"]),
           "--num-key-value-heads", str(c["num_key_value_heads"]),
           "--intermediate-size", str(c["intermediate_size"]), "--head-dim", str(c["head_dim"]),
           "--steps", str(steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--lr", "1.5e-3", "--warmup-steps", "30",
           "--dropout", "0", "--eval-every", "50", "--eval-batches", "8",
           "--precision", "fp32"]
    subprocess.run(cmd, check=True)


def decode_speed(models: dict[str, Path], args, prompt: str) -> dict[str, float]:
    """Batch-1 greedy tokens per second, median of repeats, models interleaved."""
    llms = {name: kvserve.LLM(path, dtype=torch.float32, max_model_len=512)
            for name, path in models.items()}
    params = kvserve.SamplingParams(temperature=0.0, max_tokens=args.decode_tokens,
                                    ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in models}
    for llm in llms.values():
        llm.generate([prompt], params, use_tqdm=False)  # warm
    for _ in range(args.repeats):
        for name, llm in llms.items():
            started = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times[name].append(time.perf_counter() - started)
    return {name: args.decode_tokens / median(t) for name, t in times.items()}


def acceptance(teacher: Path, draft: Path, prompts: list[str], args) -> dict:
    llm = kvserve.LLM(teacher, dtype=torch.float32, max_model_len=512, speculative_model=draft,
                      num_speculative_tokens=4, speculative_max_verify_tokens=0)
    params = kvserve.SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    before = llm.llm_engine.get_stats()
    llm.generate(prompts, params, use_tqdm=False)
    after = llm.llm_engine.get_stats()
    c = {f: getattr(after, f) - getattr(before, f)
         for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return dict(acceptance_rate=c["num_accepted_tokens"] / c["num_draft_tokens"],
                mean_acceptance_length=1 + c["num_accepted_tokens"] / c["num_drafts"])


def main() -> None:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    train_text, val_text = training.read_split(args.corpus)
    config = DistillConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
    models: dict[str, Path] = {"teacher": args.teacher}
    facts: dict[str, dict] = {}
    for size in args.sizes:
        pruned, distilled = args.work / f"pruned-{size}", args.work / f"distilled-{size}"
        scratch = args.work / f"scratch-{size}"
        if not (args.reuse and (pruned / "config.json").is_file()):
            prune_checkpoint(args.teacher, train_text, pruned,
                             max_tokens=args.calibration_tokens, **SIZES[size])
        if not (args.reuse and (distilled / "distill.json").is_file()):
            distill(args.teacher, pruned, args.corpus, distilled, config)
        summary = json.loads((distilled / "distill.json").read_text())
        if not (args.reuse and (scratch / "training.json").is_file()):
            train_scratch(pruned, scratch, args, summary["tokens_seen"])
        models.update({f"pruned {size}": pruned, f"distilled {size}": distilled,
                       f"scratch {size}": scratch})
        facts[size] = dict(distill_steps=summary["steps_run"],
                           tokens_seen=summary["tokens_seen"],
                           distill_seconds=summary["wall_time_s"],
                           scratch_seconds=json.loads(
                               (scratch / "training.json").read_text())["wall_time_s"])
    rows = []
    for name, path in models.items():
        rows.append(dict(model=name, parameters=parameters(path),
                         kv_bytes_per_token=kv_bytes_per_token(path),
                         perplexity=perplexity(path, val_text),
                         train_perplexity=perplexity(path, train_text[-len(val_text):])))
        print(f"{name}: {rows[-1]['parameters']:,} parameters, perplexity "
              f"{rows[-1]['perplexity']:.2f}", flush=True)
    prompt = val_text[:200]
    speed = decode_speed({r["model"]: models[r["model"]] for r in rows
                          if not r["model"].startswith(("pruned", "scratch"))}, args, prompt)
    for r in rows:
        r["decode_tokens_per_s"] = speed.get(r["model"])
    lines = [line for line in val_text.splitlines() if len(line) > 30]
    step = max(1, len(lines) // args.prompts)
    prompts = [lines[i] for i in range(0, step * args.prompts, step)][:args.prompts]
    drafts = {"shipped draft": args.draft}
    drafts.update({f"distilled {s}": args.work / f"distilled-{s}" for s in args.sizes})
    spec = {name: acceptance(args.teacher, path, prompts, args) for name, path in drafts.items()}
    spec_parameters = {name: parameters(path) for name, path in drafts.items()}
    result = dict(rows=rows, training=facts, speculative=spec,
                  speculative_parameters=spec_parameters, steps=args.steps,
                  cpu=kvserve._C.cpu_capability(), threads=torch.get_num_threads())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    teacher_ppl = rows[0]["perplexity"]
    print("\n| model | parameters | val. perplexity | vs teacher | train perplexity "
          "| decode tok/s (batch 1) | KV bytes/token |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        tps = f"{r['decode_tokens_per_s']:.0f}" if r["decode_tokens_per_s"] else "-"
        print(f"| {r['model']} | {r['parameters'] / 1e6:.2f}M | {r['perplexity']:.2f} | "
              f"{r['perplexity'] / teacher_ppl:.2f}x | {r['train_perplexity']:.2f} | {tps} | "
              f"{r['kv_bytes_per_token']:,} |")
    print("\n| draft for the teacher | parameters | acceptance (k=4) | mean accepted length |")
    print("|---|---|---|---|")
    for name, s in spec.items():
        print(f"| {name} | {spec_parameters[name] / 1e6:.2f}M | {s['acceptance_rate']:.2f} | "
              f"{s['mean_acceptance_length']:.2f} |")


if __name__ == "__main__":
    main()
