"""Speculative decoding: speed-up over the same engine without speculation, by batch size and
number of draft tokens k, with acceptance (overall and by draft position); the draft model and an
EAGLE-3 head (--eagle3, e.g. trained by `kvserve train-eagle`) on held-out text and n-gram prompt
lookup on an input-copying workload; transformers' assisted generation and prompt lookup as the
peer at batch 1, in the same run.

    python benchmarks/bench_speculative.py --target DIR --draft DIR   # e.g. the stdlib pair of
                                                                      # scripts/build_speculative_pair.sh
    python benchmarks/bench_speculative.py                            # the shipped Shakespeare pair
    python benchmarks/bench_speculative.py --eagle3 HEAD_DIR          # + an EAGLE-3 head
    python benchmarks/bench_speculative.py --quick                    # a small smoke run

Workloads (prompts from the validation split of the target's training corpus, which
training.json names; greedy, ignore_eos, --max-tokens new tokens each; batch 1 decodes
--batch1-prompts prompts one after another):
  text  windows of held-out text: the draft model's case.
  copy  a held-out window, a blank line, then the window's first tokens again: the continuation
        repeats text of the prompt (quoting, code edits), the n-gram case.
Every configuration runs once per repeat, interleaved (plain, then each k, then the next repeat),
and the table gives medians. Speed-up = the plain engine's time / the configuration's time for
the same prompts. The rule the engine's defaults follow is printed at the end: for each batch size
the fastest k, or none when no k beats plain decoding.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

import kvserve
from kvserve.tokenizer import Tokenizer
from kvserve.testing.bench import machine_info, markdown_table, median, write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", type=Path, default=REPO / "models" / "shakespeare-target")
    p.add_argument("--draft", type=Path, default=REPO / "models" / "shakespeare-draft")
    p.add_argument("--eagle3", type=Path, default=None,
                   help="an EAGLE-3 head for the target: its rows beside the draft model's")
    p.add_argument("--speculative-quantization", default=None, choices=["int8", "int4"],
                   help="the draft model and the head with int8 or int4 projections (EngineArgs')")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8],
                   help="draft tokens per step for the draft model")
    p.add_argument("--ngram-ks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--workloads", nargs="+", default=["text", "copy"], choices=["text", "copy"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--batch1-prompts", type=int, default=4,
                   help="batch 1 decodes this many prompts, one after another")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-peer", action="store_true", help="skip transformers")
    p.add_argument("--defaults-only", action="store_true",
                   help="only plain and the engine's default speculation (its k and batch rule)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path, default=HERE / "results" / "bench_speculative.json")
    args = p.parse_args()
    if args.quick:
        args.batch_sizes, args.ks, args.ngram_ks = [1, 4], [2, 4], [4]
        args.max_tokens, args.repeats = 32, 1
    return args


def validation_text(target: Path) -> str:
    """The held-out 10% of the target's training corpus (training.json's "corpus")."""
    info = json.loads((target / "training.json").read_text())
    corpus = Path(info["corpus"])
    if not corpus.is_absolute():
        corpus = (REPO / corpus).resolve()
    text = corpus.read_text(encoding="utf-8")
    return text[text.rfind("\n", 0, int(len(text) * 0.9)) + 1:]


def prompts_for(workload: str, tokenizer, text: str, count: int, length: int,
                seed: int) -> list[list[int]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    separator = tokenizer.encode("\n\n", add_special_tokens=False)
    out = []
    for _ in range(count):
        start = rng.randrange(0, len(ids) - 2 * length)
        window = ids[start:start + length]
        if workload == "text":
            out.append([1] + window)
        else:  # the window, a blank line, then its first eighth again: continuing means copying
            out.append([1] + window + separator + window[:max(4, length // 8)])
    return out


CONFIGS = {
    "plain": lambda args, k: {},
    "draft": lambda args, k: dict(speculative_model=args.draft, num_speculative_tokens=k,
                                  speculative_max_verify_tokens=0, **drafter(args)),
    # What LLM(speculative_model=...) does with no other option: its default k and batch rule.
    "draft default": lambda args, k: dict(speculative_model=args.draft, **drafter(args)),
    "ngram": lambda args, k: dict(speculative_method="ngram", num_speculative_tokens=k,
                                  speculative_max_verify_tokens=0),
    "ngram default": lambda args, k: dict(speculative_method="ngram"),
    "eagle3": lambda args, k: dict(speculative_method="eagle3", speculative_model=args.eagle3,
                                   num_speculative_tokens=k, speculative_max_verify_tokens=0,
                                   **drafter(args)),
    "eagle3 default": lambda args, k: dict(speculative_method="eagle3",
                                           speculative_model=args.eagle3, **drafter(args)),
}


def drafter(args) -> dict:
    """The draft model's and the head's options beyond the method (--speculative-quantization)."""
    q = args.speculative_quantization
    return {} if q is None else dict(speculative_quantization=q)


def configs_for(workload: str, args) -> list[tuple[str, int]]:
    draft = [("draft", k) for k in args.ks]
    ngram = [("ngram", k) for k in args.ngram_ks]
    eagle = [("eagle3", k) for k in args.ks] + [("eagle3 default", 0)] if args.eagle3 else []
    if args.defaults_only:
        return [("plain", 0), ("draft default", 0), ("ngram default", 0)] + eagle[-1:]
    default = [("draft default", 0)]
    return [("plain", 0)] + (draft + default + eagle + ngram[:1] if workload == "text"
                             else ngram + [("ngram default", 0)] + draft[-1:])


def run_kvserve(args, workloads) -> tuple[list[dict], dict]:
    engines: dict[tuple[str, int], kvserve.LLM] = {}

    def engine(method: str, k: int) -> kvserve.LLM:
        if (method, k) not in engines:
            engines[(method, k)] = kvserve.LLM(
                args.target, dtype=args.dtype, max_model_len=args.prompt_tokens * 2 + args.max_tokens + 16,
                max_num_seqs=max(args.batch_sizes), **CONFIGS[method](args, k))
        return engines[(method, k)]

    params = kvserve.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for workload, prompts_by_batch in workloads.items():
        for batch, prompts in prompts_by_batch.items():
            configs = configs_for(workload, args)
            times = {c: [] for c in configs}
            counts = {c: None for c in configs}
            for _ in range(args.repeats):
                for method, k in configs:
                    llm = engine(method, k)
                    llm.generate(prompts[:1], params, use_tqdm=False)  # warm
                    before = llm.llm_engine.get_stats()
                    started = time.perf_counter()
                    for group in ([[p] for p in prompts] if batch == 1 else [prompts]):
                        llm.generate(group, params, use_tqdm=False)
                    times[(method, k)].append(time.perf_counter() - started)
                    after = llm.llm_engine.get_stats()
                    counts[(method, k)] = {
                        f: getattr(after, f) - getattr(before, f)
                        for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                  "propose_seconds", "verify_seconds", "num_steps")}
                    counts[(method, k)]["by_position"] = [
                        a - b for a, b in zip(after.accepted_per_position,
                                              before.accepted_per_position)]
            plain = median(times[("plain", 0)])
            for method, k in configs:
                t, c = median(times[(method, k)]), counts[(method, k)]
                rows.append(dict(
                    workload=workload, batch=batch, method=method, k=k,
                    tokens_per_s=len(prompts) * args.max_tokens / t, speedup=plain / t,
                    seconds=t,
                    acceptance_rate=c["num_accepted_tokens"] / c["num_draft_tokens"]
                    if c["num_draft_tokens"] else None,
                    mean_acceptance_length=1 + c["num_accepted_tokens"] / c["num_drafts"]
                    if c["num_drafts"] else None,
                    acceptance_by_position=[n / c["num_drafts"] for n in c["by_position"]]
                    if c["num_drafts"] else [],
                    propose_share=c["propose_seconds"] / t, verify_share=c["verify_seconds"] / t,
                    steps=c["num_steps"]))
            print(f"{workload} batch {batch}: plain {plain:.2f} s; " + ", ".join(
                f"{m}{k} x{plain / median(times[(m, k)]):.2f}" for m, k in configs[1:]), flush=True)
    first = engine("plain", 0)
    return rows, dict(weights_mib=first.model.weight_bytes / 2**20)


def run_transformers(args, prompts: dict[str, list[int]]) -> list[dict]:
    """transformers generate at batch 1: plain, assisted by the draft (k tokens, constant
    schedule) and prompt lookup, same prompt, greedy, medians over repeats."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).eval()
    k = 4
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    runs = {"plain": {}, "assisted (draft)": dict(assistant_model=draft),
            "prompt lookup": dict(prompt_lookup_num_tokens=k)}
    rows = []
    for workload, ids in prompts.items():
        x = torch.tensor([ids])
        times = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, extra in runs.items():
                if workload == "text" and name == "prompt lookup":
                    continue
                with torch.no_grad():
                    started = time.perf_counter()
                    out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                          max_new_tokens=args.max_tokens,
                                          min_new_tokens=args.max_tokens, **extra)
                    times[name].append(time.perf_counter() - started)
                assert out.shape[1] == x.shape[1] + args.max_tokens
        plain = median(times["plain"])
        for name, t in times.items():
            if t:
                rows.append(dict(workload=workload, method=name, k=0 if name == "plain" else k,
                                 tokens_per_s=args.max_tokens / median(t),
                                 speedup=plain / median(t)))
    return rows


def best_k(rows: list[dict], method: str = "draft") -> dict[int, dict]:
    """Per batch size of the text workload: the fastest k of `method`, or None when none beats
    plain."""
    out = {}
    for batch in sorted({r["batch"] for r in rows}):
        drafts = [r for r in rows if r["workload"] == "text" and r["batch"] == batch
                  and r["method"] == method]
        if not drafts:
            continue
        best = max(drafts, key=lambda r: r["speedup"])
        out[batch] = dict(k=best["k"] if best["speedup"] > 1.0 else None, speedup=best["speedup"])
    return out


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    tokenizer = Tokenizer.from_model_dir(args.target)
    text = validation_text(args.target)
    # Batch 1 runs --batch1-prompts prompts one after another, so that its acceptance is not
    # one prompt's.
    workloads = {w: {b: prompts_for(w, tokenizer, text, args.batch1_prompts if b == 1 else b,
                                    args.prompt_tokens, seed=b)
                     for b in args.batch_sizes} for w in args.workloads}
    rows, model = run_kvserve(args, workloads)
    peer = [] if args.no_peer else run_transformers(
        args, {w: workloads[w][min(args.batch_sizes)][0] for w in args.workloads})

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    print(f"\n## kvserve: {args.target.name} ({model['weights_mib']:.0f} MiB of weights) with "
          f"draft {args.draft.name}"
          + (f", EAGLE-3 head {args.eagle3.name}" if args.eagle3 else "")
          + (f", drafters in {args.speculative_quantization}"
             if args.speculative_quantization else "") +
          f", {args.dtype}, {args.max_tokens} new tokens, greedy, "
          f"median of {args.repeats}\n")
    print(markdown_table(
        ["workload", "batch", "method", "k", "tokens/s", "speed-up", "acceptance",
         "mean accepted length", "accepted by position", "propose share", "verify share"],
        [[r["workload"], r["batch"], r["method"], r["k"] or "-", f"{r['tokens_per_s']:.1f}",
          f"{r['speedup']:.2f}x", fmt(r["acceptance_rate"], ".2f"),
          fmt(r["mean_acceptance_length"], ".2f"),
          " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]) or "-",
          f"{r['propose_share']:.0%}", f"{r['verify_share']:.0%}"] for r in rows]))
    rule = {m: best_k(rows, m) for m in ("draft", "eagle3")}
    for method, per_batch in rule.items():
        if per_batch:
            print(f"\nfastest {method} k per batch size (text): " + ", ".join(
                f"{b}: {'off' if v['k'] is None else v['k']} ({v['speedup']:.2f}x)"
                for b, v in per_batch.items()))
    if peer:
        print("\n## transformers generate, batch 1\n")
        print(markdown_table(["workload", "method", "k", "tokens/s", "speed-up"],
                             [[r["workload"], r["method"], r["k"] or "-", f"{r['tokens_per_s']:.1f}",
                               f"{r['speedup']:.2f}x"] for r in peer]))
    path = write_json(args.json, dict(machine=machine_info(), args={
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        kvserve=rows, transformers=peer, best_k=rule))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
