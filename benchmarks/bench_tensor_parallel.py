"""What tensor parallelism costs on one machine: the same model at tp=1 and tp=2 in one run.

For each model (the shipped 6.8M-parameter Shakespeare model, and a random ~60M Llama of
hidden size 768 unless --no-random-model), interleaved rounds of:
  * batch-1 decode: TPOT of one greedy request of --tokens tokens;
  * throughput: --requests prompts of 16 tokens, --tokens generated each, output tokens/s;
at tp=1 (the process's threads: the machine's cores) and tp=2 (two ranks, one thread each, Gloo
over loopback). Beside them, what a step pays to communicate, measured on two ranks: the
latency of one all-reduce of a decode step's activations ([1, hidden], fp32) and of a step's
broadcast to the workers, times the collectives a step makes (two all-reduces per layer, one
after the embedding, the logits' all-gather, the step message); and what each rank holds (the
memory plan). On 2 shared cores no speed-up is
expected: the figures say what the parallel path's overhead is.

    python benchmarks/bench_tensor_parallel.py
    python benchmarks/bench_tensor_parallel.py --rounds 3 --tokens 64 --no-random-model
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.testing.bench import machine_info, markdown_table, median
from kvserve.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "models" / "shakespeare-target"


def _collective_us(groups, hidden: int, repeats: int) -> dict:
    """Microseconds of one all-reduce of [1, hidden] fp32 (device group) and one step message
    (a 2-value header and ~60 values, control group), medians of `repeats`."""
    device, control = groups.device_communicator(), groups.control_communicator()
    x, header, payload = torch.zeros(1, hidden), torch.zeros(2, dtype=torch.long), \
        torch.zeros(60, dtype=torch.long)

    def timed(fn) -> float:
        for _ in range(10):
            fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return median(samples) * 1e6

    return dict(all_reduce=timed(lambda: device.all_reduce_(x)),
                step_message=timed(lambda: (control.broadcast_(header, 0),
                                            control.broadcast_(payload, 0))))


def _decode_tpot(llm: LLM, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params, use_tqdm=False)[0]
    return out.metrics.time_per_output_token


def _throughput(llm: LLM, requests: int, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [[(7 * r + i) % 200 + 1 for i in range(16)] for r in range(requests)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def bench_model(name: str, path: Path, args, cores: int) -> dict:
    torch.set_num_threads(1)  # the worker rank inherits cores // 2 = 1 thread
    two = LLM(path, dtype="float32", tensor_parallel_size=2, max_model_len=256,
              num_blocks=512)
    torch.set_num_threads(cores)
    one = LLM(path, dtype="float32", max_model_len=256, num_blocks=512)
    plan = two.llm_engine.memory_plan()
    rank = two.llm_engine.rank_model
    results = {"tp1": {"tpot": [], "throughput": []}, "tp2": {"tpot": [], "throughput": []}}
    try:
        for _ in range(args.rounds):
            for key, llm, threads in (("tp1", one, cores), ("tp2", two, 1)):
                torch.set_num_threads(threads)
                results[key]["tpot"].append(_decode_tpot(llm, args.tokens))
                results[key]["throughput"].append(_throughput(llm, args.requests, args.tokens))
    finally:
        two.shutdown()
        torch.set_num_threads(cores)
    config = one.model.config
    comm = run_ranks(_collective_us, 2, (config.hidden_size, args.repeats))[0]
    # Two all-reduces a layer, one after the embedding, the logits' all-gather (about an
    # all-reduce: both are one exchange of a small tensor on Gloo), and the step message.
    per_step = (2 * config.num_layers + 2) * comm["all_reduce"] + comm["step_message"]
    return dict(model=name, layers=config.num_layers, hidden=config.hidden_size,
                weights_tp1_mib=one.model.weight_bytes / 2**20,
                weights_rank_mib=two.model.weight_bytes / 2**20,
                split_mib=rank.split_bytes / 2**20, replicated_mib=rank.replicated_bytes / 2**20,
                tpot_ms={k: median(v["tpot"]) * 1e3 for k, v in results.items()},
                throughput={k: median(v["throughput"]) for k, v in results.items()},
                all_reduce_us=comm["all_reduce"], step_message_us=comm["step_message"],
                communication_ms_per_step=per_step / 1e3, memory_plan=plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200, help="timings of each collective")
    parser.add_argument("--no-random-model", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/tensor_parallel_raw.json")
    args = parser.parse_args()
    cores = torch.get_num_threads()
    rows = [bench_model("shakespeare-target (6.8M)", SHIPPED, args, cores)]
    if not args.no_random_model:
        from kvserve.testing.checkpoints import make_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            path = make_checkpoint(tmp, "LlamaForCausalLM", hidden_size=768, num_hidden_layers=8,
                                   num_attention_heads=12, num_key_value_heads=4,
                                   intermediate_size=2048, vocab_size=32000)
            rows.append(bench_model("random Llama (hidden 768, 8 layers)", path, args, cores))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=machine_info(), args=vars(args), rows=rows), indent=1))
    print(markdown_table(
        ["model", "TPOT tp=1", "TPOT tp=2", "tok/s tp=1", "tok/s tp=2", "all-reduce",
         "step message", "communication per step", "weights per rank (split + replicated)"],
        [[r["model"], f"{r['tpot_ms']['tp1']:.2f} ms", f"{r['tpot_ms']['tp2']:.2f} ms",
          f"{r['throughput']['tp1']:.0f}", f"{r['throughput']['tp2']:.0f}",
          f"{r['all_reduce_us']:.0f} µs", f"{r['step_message_us']:.0f} µs",
          f"{r['communication_ms_per_step']:.2f} ms",
          f"{r['weights_rank_mib']:.1f} of {r['weights_tp1_mib']:.1f} MiB "
          f"({r['split_mib']:.1f} + {r['replicated_mib']:.1f})"] for r in rows]))


if __name__ == "__main__":
    main()
