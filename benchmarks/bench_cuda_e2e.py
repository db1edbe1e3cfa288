"""kvserve end to end on a CUDA GPU, against the weight-read bound and transformers, in one run.

For each model (random weights of a real shape, bf16, built on the GPU and saved once):
  * batch-1 decode: TPOT of greedy decoding a --decode-tokens continuation of a 128-token prompt
    (request metrics of LLM.generate), against the time to read every weight once from HBM at the
    bandwidth of a device-to-device copy measured in the same run (bytes read + written);
  * offline throughput: --batch prompts of --prompt-len random tokens, each generating
    --gen-len tokens greedily (ignore_eos), in one LLM.generate; output tokens per second, against
    transformers `generate` on the same model object, prompts and token counts (greedy,
    min_new_tokens = max_new_tokens, its default dynamic cache).
kvserve runs once per --modes entry: `graphs` (CUDA graphs for its decode steps,
enforce_eager=False, the default), `async` (graphs and async_scheduling: each step launched
before the last one's samples reach the host), `eager` (enforce_eager=True), and any with
`-<kernel>` appended (`graphs-rows`: paged_attention's row kernel forced,
kvserve._C.set_cuda_attention_kernel, set before each of that engine's calls so that its graphs
capture it). Medians of --repeats, the
engines interleaved. Prints a markdown table; writes JSON to --out.
With --profile-steps N (default 32), each mode's batch-1 decode is then profiled for N steps
(torch.profiler, kvserve.testing.bench.device_profile): wall and GPU-busy ms per step (their gap
is the GPU waiting for the host), kernels per step and the kernels that take the most time.

    python benchmarks/bench_cuda_e2e.py                               # llama3-8b and qwen3-0.6b
    python benchmarks/bench_cuda_e2e.py --models qwen3-0.6b --repeats 1
    python benchmarks/bench_cuda_e2e.py --models qwen3-0.6b --modes graphs graphs-rows
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvserve
from kvserve.testing.bench import device_profile, markdown_table, median
from kvserve.testing.checkpoints import build_tokenizer, make_config

MODELS = {
    "llama3-8b": ("LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=8192, rope_theta=500000.0)),
    "qwen3-0.6b": ("Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=1e6)),
}


def copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * n / median(times)


def build(name: str, cache: Path):
    """(the transformers model on the GPU, its saved directory)."""
    from transformers import AutoModelForCausalLM

    arch, overrides = MODELS[name]
    path = cache / name
    config = make_config(arch, **overrides)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    if not (path / "config.json").is_file():
        model.save_pretrained(path, max_shard_size="4GB")
        build_tokenizer(320).save(str(path / "tokenizer.json"))
    return model, path


def weight_bytes(model) -> int:
    """Bytes a decode step reads: every parameter once, the input embedding excepted unless it is
    also the LM head (a row gather)."""
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - embed.numel() * embed.element_size()


def kvserve_decode(llm, prompt, tokens) -> float:
    params = kvserve.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    return out.metrics.time_per_output_token


def kvserve_throughput(llm, prompts, gen_len) -> float:
    params = kvserve.SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def profile_decode(llm, prompt, steps: int) -> dict:
    """device_profile of `steps` batch-1 decode steps (after the prompt's prefill)."""
    params = kvserve.SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    engine = llm.llm_engine
    engine.add_request("profiled", prompt, params)
    engine.step()  # the prefill

    def run():
        for _ in range(steps):
            engine.step()

    profile = device_profile(run, steps)
    while engine.has_unfinished_requests():
        engine.step()
    return profile


def print_profile(name: str, mode: str, profile: dict) -> None:
    print(f"\n{name}, {mode}: {profile['wall_ms']:.3f} ms a decode step, GPU busy "
          f"{profile['busy_ms']:.3f} ms ({profile['busy_ms'] / profile['wall_ms']:.0%}), "
          f"{profile['events']:.0f} kernels and copies a step")
    print(markdown_table(["kernel", "ms a step", "calls a step"],
                         [[k["name"], f"{k['ms']:.4f}", f"{k['calls']:.0f}"]
                          for k in profile["top"]]))
    print(markdown_table(["host CUDA runtime call", "ms a step (profiled)", "calls a step"],
                         [[k["name"], f"{k['ms']:.4f}", f"{k['calls']:.1f}"]
                          for k in profile["runtime"]]))


def hf_throughput(model, prompts, gen_len) -> float:
    ids = torch.tensor(prompts, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=gen_len, min_new_tokens=gen_len, pad_token_id=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", default="/tmp/kvserve-bench-checkpoints")
    parser.add_argument("--modes", nargs="+", default=["graphs", "async", "eager"],
                        help="graphs | async | eager, optionally -mma / -rows / -general")
    parser.add_argument("--profile-steps", type=int, default=32,
                        help="decode steps profiled per mode (0: none)")
    parser.add_argument("--out", default="benchmarks/results/cuda_e2e.json")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    bandwidth = copy_bandwidth()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.models:
        model, path = build(name, Path(args.cache))
        bound = weight_bytes(model) / bandwidth
        engines = {mode: kvserve.LLM(path, dtype=torch.bfloat16, device="cuda",
                                     max_model_len=2048, max_num_seqs=args.batch,
                                     max_num_batched_tokens=4096, kv_cache_memory=8 << 30,
                                     log_memory_plan=False,
                                     enforce_eager=mode.startswith("eager"),
                                     async_scheduling=mode.startswith("async"))
                   for mode in args.modes}

        def use(mode):  # the mode's attention kernel, for this engine's next calls
            kvserve._C.set_cuda_attention_kernel(mode.partition("-")[2] or "auto")

        vocab = model.config.vocab_size
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
        prompts = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=gen).tolist()
        for mode, llm in engines.items():  # warm-up (and the graphs of the sizes measured)
            use(mode)
            kvserve_decode(llm, prompt, 8)
            kvserve_throughput(llm, prompts, 4)
        hf_throughput(model, prompts[:4], 4)
        tpot = {mode: [] for mode in engines}
        tok_s = {mode: [] for mode in engines}
        theirs = []
        for _ in range(args.repeats):
            for mode, llm in engines.items():
                use(mode)
                tpot[mode].append(kvserve_decode(llm, prompt, args.decode_tokens))
                tok_s[mode].append(kvserve_throughput(llm, prompts, args.gen_len))
            theirs.append(hf_throughput(model, prompts, args.gen_len))
        row = dict(model=name, weight_gb=weight_bytes(model) / 1e9, bound_ms=bound * 1e3,
                   transformers_tok_s=median(theirs))
        for mode in engines:
            row[f"tpot_ms_{mode}"] = median(tpot[mode]) * 1e3
            row[f"bound_fraction_{mode}"] = bound / median(tpot[mode])
            row[f"kvserve_tok_s_{mode}"] = median(tok_s[mode])
            row[f"speedup_{mode}"] = median(tok_s[mode]) / row["transformers_tok_s"]
        if args.profile_steps > 0:
            row["profiles"] = {}
            for mode, llm in engines.items():
                use(mode)
                row["profiles"][mode] = profile_decode(llm, prompt, args.profile_steps)
                print_profile(name, mode, row["profiles"][mode])
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profiles"}), flush=True)
        use("auto")
        del engines, model
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name()
    print(f"\n{name}: device-to-device copy {bandwidth / 1e12:.2f} TB/s (read + write); bf16; "
          f"batch {args.batch} x ({args.prompt_len} prompt + {args.gen_len} generated)\n")
    print(markdown_table(
        ["model", "weights GB", "mode", "batch-1 TPOT ms", "weight-read bound ms",
         "of bound", "kvserve tok/s", "transformers tok/s", "speed-up"],
        [[r["model"], f"{r['weight_gb']:.2f}", mode, f"{r[f'tpot_ms_{mode}']:.2f}",
          f"{r['bound_ms']:.2f}", f"{r[f'bound_fraction_{mode}']:.0%}",
          f"{r[f'kvserve_tok_s_{mode}']:.0f}", f"{r['transformers_tok_s']:.0f}",
          f"{r[f'speedup_{mode}']:.1f}x"] for r in rows for mode in args.modes]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=name, copy_bandwidth=bandwidth, rows=rows), indent=1))


if __name__ == "__main__":
    main()
