"""kvserve's linear against ATen's (what transformers calls) and the machine's limits, by tokens.

For each weight shape and dtype, and each number of tokens M, one call of y = x W^T on:
  * kvserve: `linear` as the engine calls it, on the packed weight (`linear_prepack`, the only
    copy the engine keeps): the streaming GEMV reading the packed layout up to 16 tokens in fp32
    with AVX-512 (4 for weights over 4 MiB without)
    and 2 in bf16 (up to 8 for bf16 weights of at most 4 MiB), oneDNN's GEMM on it above;
  * kvserve, plain weight: the GEMV on the row-major weight up to 8 tokens, ATen's GEMM above
    (what a CPU whose oneDNN layout the GEMV cannot read gets);
  * ATen: `torch.nn.functional.linear`, which repacks the weight on every call;
  * oneDNN: its GEMM on the same packed weight at every token count (where the GEMV's limit is
    set).
Each timing cycles through enough copies of the weight to exceed the last-level cache, as a model's
layers do. A few tokens are bound by reading the weight (GB/s against the measured read
bandwidth), many by arithmetic (GFLOP/s against a square 2048 torch.mm, which also repacks its
operands, so a packed GEMM can pass it).

    python benchmarks/bench_linear.py [--dtypes float32 bfloat16] [--tokens 1 2 4 ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing.bench import (best_time, machine_info, markdown_table, matmul_flops,
                                   memory_read_bandwidth, write_json)

HERE = Path(__file__).resolve().parent
SHAPES = {  # name: (out_features, in_features), the ~100M Llama of bench_throughput
    "gate_up 768->4096": (4096, 768),
    "down 2048->768": (768, 2048),
    "qkv 768->1280": (1280, 768),
    "lm_head 768->32000": (32000, 768),
}
WORKING_SET = 96 << 20  # bytes of weight copies cycled through per timing


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """oneDNN's GEMM on a weight linear_prepack packed (what kvserve's linear calls past its
    GEMV's token limit)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def time_per_call(fn, weights) -> float:
    return best_time(lambda: [fn(w) for w in weights], repeats=5) / len(weights)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 128, 512, 2048])
    args = p.parse_args()
    ops = torch.ops.kvserve
    bandwidth = memory_read_bandwidth()
    rows, results = [], []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        peak = matmul_flops(dtype, n=2048, repeats=5)
        print(f"{dtype_name}: torch.mm peak {peak / 1e9:.0f} GFLOP/s, "
              f"read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
        for shape in args.shapes:
            n, k = SHAPES[shape]
            copies = max(1, WORKING_SET // (n * k * dtype.itemsize))
            weights = [(torch.randn(n, k) / k**0.5).to(dtype) for _ in range(copies)]
            packed = {id(w): ops.linear_prepack(w) for w in weights}
            packed = {key: p if p is not None else w for (key, p), w in zip(packed.items(), weights)}
            for m in args.tokens:
                x = torch.randn(m, k).to(dtype)
                t = dict(
                    kvserve=time_per_call(lambda w: ops.linear(x, packed[id(w)], None), weights),
                    unpacked=time_per_call(lambda w: ops.linear(x, w, None), weights),
                    aten=time_per_call(lambda w: F.linear(x, w), weights))
                if packed[id(weights[0])].is_mkldnn:  # oneDNN's GEMM on the same packed weight
                    t["onednn"] = time_per_call(lambda w: onednn_linear(x, packed[id(w)]), weights)
                flops, nbytes = 2 * m * n * k, n * k * dtype.itemsize
                results.append(dict(dtype=dtype_name, shape=shape, tokens=m, seconds=t,
                                    peak_flops=peak, bandwidth=bandwidth))
                rows.append([dtype_name, shape, m]
                            + [f"{flops / t[c] / 1e9:.0f}" if c in t else "-"
                               for c in ("kvserve", "unpacked", "aten", "onednn")]
                            + [f"{t['aten'] / t['kvserve']:.2f}",
                               f"{t['onednn'] / t['kvserve']:.2f}" if "onednn" in t else "-",
                               f"{flops / t['kvserve'] / peak:.0%}",
                               f"{nbytes / t['kvserve'] / bandwidth:.0%}"])
                print(rows[-1], flush=True)
    print(markdown_table(["dtype", "weight", "tokens", "kvserve GFLOP/s", "plain weight GFLOP/s",
                          "ATen GFLOP/s", "oneDNN packed GFLOP/s", "ATen time / kvserve",
                          "oneDNN time / kvserve", "of torch.mm 2048² FLOP/s",
                          "of read bandwidth"], rows))
    path = write_json(HERE / "results" / "linear.json",
                      dict(machine=machine_info(), args=vars(args), results=results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
