"""Stream several requests to the terminal as the engine produces them.

    python examples/stream.py [--model models/shakespeare-target]

Requests arrive at different steps; each line shows which request a piece of text belongs to.
"""

import argparse
from pathlib import Path

from kvserve import LLMEngine, SamplingParams

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, default=REPO / "models" / "shakespeare-target")
    args = p.parse_args()
    engine = LLMEngine(args.model)
    arrivals = {0: ("romeo", "ROMEO:\n"), 3: ("juliet", "JULIET:\n"), 8: ("king", "KING HENRY:\n")}
    params = SamplingParams(temperature=0.8, top_k=50, seed=0, max_tokens=48, stop=["\n\n"])
    step = 0
    while arrivals or engine.has_unfinished_requests():
        if step in arrivals:
            request_id, prompt = arrivals.pop(step)
            engine.add_request(request_id, prompt, params)
            print(f"[step {step}] + {request_id}")
        for out in engine.step():
            delta = out.outputs[0].delta_text
            if delta:
                print(f"[step {step}] {out.request_id:>6}: {delta!r}")
            if out.finished:
                m = out.metrics
                print(f"[step {step}] {out.request_id:>6} finished ({out.outputs[0].finish_reason})"
                      f" TTFT {m.time_to_first_token * 1e3:.0f} ms, "
                      f"TPOT {m.time_per_output_token * 1e3:.1f} ms")
        step += 1
    stats = engine.get_stats()
    print(f"{stats.num_finished_requests} requests, {stats.num_preemptions} preemptions, "
          f"prefix-cache hit rate {stats.prefix_cache_hit_rate:.0%}")


if __name__ == "__main__":
    main()
