"""Online latency under Poisson arrivals: TTFT and time per output token at several request rates.

Requests arrive at exponential intervals (rate in requests/s) and join the running engine
(LLMEngine) as soon as their arrival time has passed; the loop calls step() in real time. For each
rate: TTFT and TPOT p50/p99, queue time p50, output throughput, and preemptions.
`--static-batch B` runs the same arrivals with request-level batching instead (a batch of up to B
waiting requests runs to completion before the next starts), for comparison.

    python benchmarks/bench_latency.py [--rates 1 2 4 8] [--requests 48]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import kvserve
from kvserve.testing.bench import machine_info, markdown_table, write_json

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE.parent / "models" / "shakespeare-target"


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def run_rate(engine: kvserve.LLMEngine, rate: float, n: int, prompt_range, output_range,
             vocab: int, seed: int, static_batch: int = 0) -> dict:
    """static_batch > 0: request-level (static) batching on the same engine: arrived requests,
    up to static_batch of them, start only when the previous batch has finished; 0: continuous
    batching (a request joins the running batch at the next step)."""
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range) - 1)]
        arrivals.append((t, str(i), prompt, rng.randint(*output_range)))
    preempted_before = engine.get_stats().num_preemptions
    start = time.monotonic()
    pending, finished, generated = list(arrivals), {}, 0
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        room = n if not static_batch else 0 if engine.has_unfinished_requests() else static_batch
        while pending and pending[0][0] <= now and room > 0:
            room -= 1
            at, request_id, prompt, max_tokens = pending.pop(0)
            engine.add_request(request_id, prompt,
                               kvserve.SamplingParams(temperature=0.8, max_tokens=max_tokens,
                                                      ignore_eos=True, seed=int(request_id)),
                               arrival_time=start + at)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(pending[0][0] - now, 0.05)))
            continue
        for out in engine.step():
            generated += sum(len(c.new_token_ids) for c in out.outputs)
            if out.finished:
                finished[out.request_id] = out.metrics
    wall = time.monotonic() - start
    ttft = [m.time_to_first_token for m in finished.values()]
    tpot = [m.time_per_output_token for m in finished.values() if m.num_generated_tokens > 1]
    queue = [m.queue_time for m in finished.values()]
    return dict(rate=rate, requests=n, static_batch=static_batch, wall_s=wall,
                output_tokens=generated,
                throughput_tok_s=generated / wall,
                ttft_p50_ms=1e3 * percentile(ttft, 50), ttft_p99_ms=1e3 * percentile(ttft, 99),
                tpot_p50_ms=1e3 * percentile(tpot, 50), tpot_p99_ms=1e3 * percentile(tpot, 99),
                queue_p50_ms=1e3 * statistics.median(queue),
                preemptions=engine.get_stats().num_preemptions - preempted_before)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-range", type=int, nargs=2, default=[32, 256])
    p.add_argument("--output-range", type=int, nargs=2, default=[32, 128])
    p.add_argument("--num-blocks", type=int, default=None,
                   help="a smaller pool shows preemption under load")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--static-batch", type=int, default=0,
                   help="request-level batching of up to this many requests (0: continuous)")
    args = p.parse_args()
    engine = kvserve.LLMEngine(args.model, dtype=args.dtype, num_blocks=args.num_blocks,
                               max_num_batched_tokens=args.max_num_batched_tokens)
    vocab = engine.config.vocab_size
    results = [run_rate(engine, rate, args.requests, args.prompt_range, args.output_range, vocab,
                        args.seed + i, args.static_batch) for i, rate in enumerate(args.rates)]
    rows = [[f"{r['rate']:g}", f"{r['throughput_tok_s']:.0f}", f"{r['ttft_p50_ms']:.0f}",
             f"{r['ttft_p99_ms']:.0f}", f"{r['tpot_p50_ms']:.1f}", f"{r['tpot_p99_ms']:.1f}",
             f"{r['queue_p50_ms']:.0f}", r["preemptions"]] for r in results]
    print(f"{args.model.name}, {args.dtype}, {args.requests} requests per rate, prompts "
          f"{args.prompt_range}, outputs {args.output_range}")
    print(markdown_table(["rate (req/s)", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
                          "TPOT p50 ms", "TPOT p99 ms", "queue p50 ms", "preemptions"], rows))
    path = write_json(HERE / "results" / "latency.json",
                      dict(machine=machine_info(), args={k: str(v) for k, v in vars(args).items()},
                           results=results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
