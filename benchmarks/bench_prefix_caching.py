"""Prefix caching: 32 requests that share a 1,024-token system prompt.

Runs the same requests (system prompt + a distinct 32-token question each, one output token)
through LLM.generate with prefix caching off and on, and reports the prefill tokens the model
computed and the time to first token. With caching on, the first request computes the system
prompt's blocks and the other 31 reuse them within the same batch; a second call finds them
already cached ("warm"). Outputs are checked to be identical across the three runs.

    python benchmarks/bench_prefix_caching.py [--system-tokens 1024] [--requests 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import kvserve
from kvserve.testing.bench import cached_checkpoint, machine_info, markdown_table, write_json

HERE = Path(__file__).resolve().parent
# The shipped target model's shape, with room for 1,024 + 32 tokens of context.
SHAPE = dict(vocab_size=1024, hidden_size=320, intermediate_size=864, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
             tie_word_embeddings=True)


def run(llm, prompts) -> dict:
    params = kvserve.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    started = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.monotonic() - started
    ttft = [o.metrics.time_to_first_token for o in outs]
    computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outs)
    return dict(prefill_tokens=computed, ttft_median_s=statistics.median(ttft),
                ttft_max_s=max(ttft), wall_s=wall,
                tokens=[o.outputs[0].token_ids for o in outs])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="a checkpoint directory (default: a random one of the shipped target's "
                        "shape, cached in benchmarks/.cache)")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    model = args.model or cached_checkpoint(HERE / ".cache", "target-shape", "LlamaForCausalLM",
                                            SHAPE, args.dtype)
    rng = random.Random(0)
    system = [1] + [rng.randrange(3, 1024) for _ in range(args.system_tokens - 1)]
    prompts = [system + [rng.randrange(3, 1024) for _ in range(args.question_tokens)]
               for _ in range(args.requests)]
    total = sum(len(x) for x in prompts)

    results = {}
    for name, caching in [("off", False), ("on", True)]:
        llm = kvserve.LLM(model, dtype=args.dtype, enable_prefix_caching=caching,
                          max_num_seqs=args.requests)
        results[f"caching {name}"] = run(llm, prompts)
        if caching:
            results["caching on, warm"] = run(llm, prompts)
    reference = results["caching off"]["tokens"]
    assert all(r["tokens"] == reference for r in results.values()), "outputs differ"

    rows = [[name, f"{r['prefill_tokens']:,} / {total:,}", f"{r['ttft_median_s'] * 1e3:.0f} ms",
             f"{results['caching off']['ttft_median_s'] / r['ttft_median_s']:.1f}x"]
            for name, r in results.items()]
    print(f"{args.requests} requests = {args.system_tokens}-token system prompt + "
          f"{args.question_tokens}-token question each; model {model.name}, {args.dtype}")
    print(markdown_table(["run", "prefill tokens computed", "TTFT (median)", "TTFT speedup"], rows))
    for r in results.values():
        del r["tokens"]
    path = write_json(HERE / "results" / "prefix_caching.json",
                      dict(machine=machine_info(), args={k: str(v) for k, v in vars(args).items()},
                           results=results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
