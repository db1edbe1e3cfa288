"""Serving at a fixed KV memory budget: full attention vs sliding window vs hybrid local/global vs
cross-layer KV sharing, on random checkpoints of one shape that differ only in how their layers
attend.

Five variants of an 8-layer model (hidden 512, 8 heads, 4 KV heads of 64, fp32): every layer full
(Llama); every layer a 256-token window (Mistral); local and global alternating and five local to
one global (the same window, through `layer_types`); and layer pairs sharing KV (kvserve's
`kv_sharing`). Each serves the same --requests requests (a 128-token prompt, --output-len greedy
tokens, ignore_eos) through LLMEngine with the same `kv_cache_memory` budget, all submitted at
once: the table gives how many such requests fit in the pool at their full length (the bound the
scheduler admits by), how many ran per decode step on average, the preemptions, and the output
tokens per second. Then the decode step time of one request at --context tokens of context (median of
--steps steps): what a local layer saves in attention reads at long context. With --repeats N
the variants run in turn N times and the table gives the medians.

    python benchmarks/bench_hybrid_capacity.py [--requests 48] [--budget-mib 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import kvserve
from kvserve.engine import blocks_per_sequence
from kvserve.testing.bench import cached_checkpoint, machine_info, markdown_table, write_json

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LAYERS, WINDOW, PROMPT = 8, 256, 128
SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=LAYERS,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=8192, tie_word_embeddings=False)
KINDS = ("sliding_attention", "full_attention")
VARIANTS = {
    "full attention": ("LlamaForCausalLM", {}),
    f"window {WINDOW}": ("MistralForCausalLM", dict(sliding_window=WINDOW)),
    "1:1 local / global": ("MistralForCausalLM", dict(
        sliding_window=WINDOW, layer_types=[KINDS[i % 2] for i in range(LAYERS)])),
    "3:1 local / global": ("MistralForCausalLM", dict(
        sliding_window=WINDOW, layer_types=[KINDS[(i + 1) % 4 == 0] for i in range(LAYERS)])),
    "CLA, pairs share KV": ("cla", {}),
}


def checkpoint(name: str) -> Path:
    arch, config = VARIANTS[name]
    if arch != "cla":
        return cached_checkpoint(HERE / ".cache", "capacity", arch, {**SHAPE, **config}, "float32")
    from kvserve.testing.cla import make_cla_checkpoint
    path = HERE / ".cache" / "capacity-cla-float32"
    if not (path / "config.json").is_file():
        make_cla_checkpoint(path, {i: i - 1 for i in range(1, LAYERS, 2)}, **SHAPE)
    return path


def serve(path: Path, args) -> dict:
    e = kvserve.LLMEngine(path, dtype="float32", kv_cache_memory=args.budget_mib << 20,
                          log_memory_plan=False)
    params = kvserve.SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.requests):
        e.add_request(str(i), [1] + [3 + (i * 7 + j) % 8000 for j in range(PROMPT - 1)], params)
    running, started = [], time.perf_counter()
    while e.has_unfinished_requests():
        e.step()
        running.append(e.get_stats().num_running_requests)
    seconds = time.perf_counter() - started
    stats, kv = e.get_stats(), e.kv_cache
    per_request = blocks_per_sequence(kv.layout, PROMPT + args.output_len, kv.block_size, PROMPT)
    return dict(blocks=kv.num_blocks, fit=(kv.num_blocks - 1) // per_request,
                mean_running=statistics.fmean(running), preemptions=stats.num_preemptions,
                tokens_per_s=args.requests * args.output_len / seconds)


def decode_step_ms(path: Path, args) -> float:
    e = kvserve.LLMEngine(path, dtype="float32", max_num_seqs=1, max_model_len=args.context + 64,
                          log_memory_plan=False)
    e.add_request("long", [1] + [3 + j % 8000 for j in range(args.context - 1)],
                  kvserve.SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True))
    while not any(out.outputs[0].token_ids for out in e.step()):  # through the prefill
        pass
    times = []
    while e.has_unfinished_requests():
        started = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--output-len", type=int, default=384)
    p.add_argument("--budget-mib", type=int, default=48)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    runs = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):  # interleaved: every variant sees the same drift
        for name in VARIANTS:
            path = checkpoint(name)
            runs[name].append({**serve(path, args), "decode_ms": decode_step_ms(path, args)})
            print(name, runs[name][-1], flush=True)
    results = {name: {key: statistics.median(run[key] for run in r) for key in r[0]}
               for name, r in runs.items()}
    full = results["full attention"]
    rows = [[name, int(r["fit"]), f"{r['mean_running']:.1f}", int(r["preemptions"]),
             f"{r['tokens_per_s']:.0f}",
             f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}x", f"{r['decode_ms']:.1f}",
             f"{full['decode_ms'] / r['decode_ms']:.2f}x"] for name, r in results.items()]
    print(f"\n{args.requests} requests of {PROMPT} + {args.output_len} tokens in {args.budget_mib} MiB "
          f"of KV; decode step at {args.context:,} tokens of context:")
    print(markdown_table(["layers attend", "fit at full length", "mean running", "preemptions",
                          "output tok/s", "vs full", "decode step ms", "vs full"], rows))
    path = write_json(RESULTS / "hybrid_capacity.json",
                      dict(args=vars(args), machine=machine_info(), results=results, runs=runs))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
