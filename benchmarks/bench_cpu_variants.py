"""The CPU kernel variants against each other on the integer dot-product ops, in one run.

    python benchmarks/bench_cpu_variants.py [--repeats 5] [--shape 5632 2048]

The integer kernels are built in every variant the CPU runs, and the VNNI ones take the dot
products in one instruction (vpdpbusd / vpdpwssd) where the base variants take two or three
(kernels/cpu_dispatch.h). A variant is chosen once per process (KVSERVE_CPU_CAPABILITY), so each
round starts one process per variant, in an order that rotates round to round; each process
times every case (the median of --calls calls) and prints it. Medians over --repeats rounds.

Cases, on one [n, k] projection (--shape, TinyLlama's MLP by default):
  a8 int8, a8 int4 g32, a8 int4 g128   quantized_linear with quantize_input (int8 / int4 weights,
                                       the input rounded to int8 blocks: the CPU's decode path);
  w8a8                                 llm_int8_linear at threshold 0 (int8 x int8 per token);
at 1, 4 and 16 tokens, with the weights in the last-level cache ("cached": one matrix, called
again and again) and streamed from memory ("streamed": enough copies to exceed the cache, taken
in turn), the weight bytes per second beside the time. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKENS = (1, 4, 16)
CASES = ("a8 int8", "a8 int4 g32", "a8 int4 g128", "w8a8")


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (sysfs), or 32 MiB where it reports none."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 << 20)


# Of weights per streamed case: twice the last-level cache, at least 256 MiB (a Xeon VM's L3
# held 300 MB: a fixed 256 MiB was read from cache there).
STREAM_BYTES = max(256 << 20, 2 * last_level_cache_bytes())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=2, default=(5632, 2048), metavar=("N", "K"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--out", type=Path, default=HERE / "results" / "cpu_variants.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


# ---------------------------------------------------------------- one variant, in its own process


def weights(case: str, n: int, k: int, copies: int, seed: int = 0):
    """`copies` quantized [n, k] weights of `case` and a call(x, w) running its op."""
    import torch

    from kvserve.quantization import quantize_int4, quantize_int8

    ops = torch.ops.kvserve
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, k, generator=g) / k ** 0.5
    if case == "w8a8":
        q = quantize_int8(base)
        made = [(q.qweight.clone(), q.scales.view(-1).contiguous()) for _ in range(copies)]
        return made, lambda x, w: ops.llm_int8_linear(x, w[0], w[1], 0.0, None)
    if case == "a8 int8":
        q = quantize_int8(base)
    else:
        q = quantize_int4(base, 32 if case.endswith("g32") else 128)
    made = [(q.qweight.clone(), q.scales.clone(), None if q.zeros is None else q.zeros.clone(),
             q.group_size) for _ in range(copies)]
    return made, lambda x, w: ops.quantized_linear(x, w[0], w[1], w[2], w[3], None, True)


def weight_bytes(w) -> int:
    import torch
    return sum(t.numel() * t.element_size() for t in w if isinstance(t, torch.Tensor))


def child(args: argparse.Namespace) -> None:
    import torch

    import kvserve

    n, k = args.shape
    results = {"capability": kvserve._C.cpu_capability()}
    for case in CASES:
        one, call = weights(case, n, k, 1)
        copies = max(2, STREAM_BYTES // weight_bytes(one[0]))
        streamed, _ = weights(case, n, k, copies)
        for tokens in TOKENS:
            x = torch.randn(tokens, k).to(torch.bfloat16)
            for mode, ws in (("cached", one), ("streamed", streamed)):
                for w in ws[:2]:
                    call(x, w)  # warm-up
                times = []
                for i in range(args.calls):
                    w = ws[i % len(ws)]
                    start = time.perf_counter()
                    call(x, w)
                    times.append(time.perf_counter() - start)
                times.sort()
                seconds = times[len(times) // 2]
                results[f"{case}|{tokens}|{mode}"] = dict(
                    us=seconds * 1e6, gbs=weight_bytes(ws[0]) / seconds / 1e9)
    print("RESULT " + json.dumps(results))


# ---------------------------------------------------------------- the parent: rounds, medians


def run_variant(capability: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "KVSERVE_CPU_CAPABILITY": capability}
    cmd = [sys.executable, __file__, "--child", "--shape", *map(str, args.shape),
           "--calls", str(args.calls)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    result = json.loads(next(line for line in out.splitlines()
                             if line.startswith("RESULT "))[len("RESULT "):])
    if result.pop("capability") != capability:
        raise RuntimeError(f"the process asked for {capability} ran another variant")
    return result


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    import kvserve
    from kvserve.testing.bench import machine_info, markdown_table, median, write_json

    variants = [c for c in kvserve._C.supported_cpu_capabilities()
                if c in kvserve._C.built_cpu_capabilities() and c != "default"]
    rounds: dict[str, list[dict]] = {c: [] for c in variants}
    for r in range(args.repeats):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for capability in order:
            rounds[capability].append(run_variant(capability, args))
        print(f"round {r + 1}/{args.repeats} done", flush=True)
    keys = list(rounds[variants[0]][0])
    medians = {c: {key: {m: median([run[key][m] for run in rounds[c]]) for m in ("us", "gbs")}
                   for key in keys} for c in variants}
    headers = ["case", "tokens", "weights"] + [f"{c} µs" for c in variants]
    pairs = [(c, c.removesuffix("_vnni")) for c in variants
             if c.endswith("_vnni") and c.removesuffix("_vnni") in variants]
    headers += [f"{base} / {c}" for c, base in pairs] + [f"{c} GB/s" for c, _ in pairs]
    rows = []
    for key in keys:
        case, tokens, mode = key.split("|")
        row = [case, tokens, mode] + [f"{medians[c][key]['us']:.1f}" for c in variants]
        row += [f"{medians[base][key]['us'] / medians[c][key]['us']:.2f}x" for c, base in pairs]
        row += [f"{medians[c][key]['gbs']:.1f}" for c, _ in pairs]
        rows.append(row)
    print(markdown_table(headers, rows))
    write_json(args.out, dict(machine=machine_info(), shape=list(args.shape),
                              repeats=args.repeats, calls=args.calls, variants=variants,
                              medians=medians))


if __name__ == "__main__":
    main()
