"""fused_moe vs the per-expert loop of Hugging Face transformers, on the same routed tokens.

Both compute the routed experts of one MoE layer for the same hidden states, expert ids and
routing weights (the router is not timed):
  * kvserve: torch.ops.kvserve.fused_moe: tokens grouped by expert, one projection per active
    expert through kvserve's linear op (GEMV for a few tokens, oneDNN's GEMM on packed weights
    for more), experts side by side on the threads when each has few tokens, fp32 combine.
  * transformers: the layer's own experts module (DeepseekV2Experts: a Python loop over the
    experts hit, each gathering its tokens, running F.linear twice and index_add-ing the result).
Shapes: DeepSeek-V2-Lite's MoE layer (hidden 2048, 64 experts of 1408, top-6) and a Qwen3-MoE-
like one (hidden 2048, 128 experts of 768, top-8), at decode (1, 4, 16 tokens) and prefill (128,
512) token counts. The limit for a few tokens is reading the experts they hit once: the table
gives those bytes over kvserve's time, next to this machine's measured read bandwidth.
Medians of interleaved repeats.

    python benchmarks/bench_moe.py                 # full run
    python benchmarks/bench_moe.py --quick         # one shape, fewer cases
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing.bench import (CpuContention, machine_info, markdown_table, median,
                                   memory_read_bandwidth, write_json)

HERE = Path(__file__).resolve().parent
SHAPES = {  # name -> (hidden, moe_intermediate, num_experts, top_k)
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "qwen3-moe-30b-a3b": (2048, 768, 128, 8),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENS = [1, 4, 16, 128, 512]


class Layer:
    """One MoE layer's experts, held both ways: kvserve's per-expert (packed) weights and
    transformers' DeepseekV2Experts module with the same values."""

    def __init__(self, shape, dtype, seed=0):
        from transformers import AutoConfig
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Experts

        hidden, inter, experts, self.k = shape
        config = AutoConfig.for_model("deepseek_v2", hidden_size=hidden,
                                      moe_intermediate_size=inter, n_routed_experts=experts,
                                      num_experts_per_tok=self.k)
        self.hf = DeepseekV2Experts(config).to(dtype).eval()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.hf.gate_up_proj.copy_(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02)
            self.hf.down_proj.copy_(torch.randn(experts, hidden, inter, generator=g) * 0.02)
        prepack = torch.ops.kvserve.linear_prepack
        self.w13 = [prepack(w.contiguous()) if prepack(w.contiguous()) is not None
                    else w.contiguous() for w in self.hf.gate_up_proj.detach()]
        self.w2 = [prepack(w.contiguous()) if prepack(w.contiguous()) is not None
                   else w.contiguous() for w in self.hf.down_proj.detach()]
        self.expert_bytes = 3 * hidden * inter * dtype.itemsize
        self.shape, self.dtype = shape, dtype

    def inputs(self, tokens, seed=1):
        hidden, _, experts, k = self.shape
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, hidden, generator=g).to(self.dtype)
        scores = torch.randn(tokens, experts, generator=g).softmax(-1)
        weights, ids = scores.topk(k, dim=-1)
        return x, weights.contiguous(), ids.contiguous()

    def ours(self, x, weights, ids):
        return torch.ops.kvserve.fused_moe(x, self.w13, self.w2, weights, ids)

    def peer(self, x, weights, ids):
        with torch.no_grad():
            return self.hf(x, ids, weights)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def run(layer: Layer, tokens: int, repeats: int, refcheck: bool) -> dict:
    x, weights, ids = layer.inputs(tokens)
    if refcheck:
        torch.testing.assert_close(layer.ours(x, weights, ids).float(),
                                   layer.peer(x, weights, ids).float(),
                                   atol=2e-2, rtol=2e-2)
    layer.ours(x, weights, ids), layer.peer(x, weights, ids)  # warm up
    ours, theirs = [], []
    contention = CpuContention().start()
    for i in range(repeats):
        if i % 2 == 0:
            ours.append(timed(layer.ours, x, weights, ids))
            theirs.append(timed(layer.peer, x, weights, ids))
        else:
            theirs.append(timed(layer.peer, x, weights, ids))
            ours.append(timed(layer.ours, x, weights, ids))
    active = int(ids.unique().numel())
    return dict(tokens=tokens, active_experts=active, kvserve_ms=median(ours) * 1e3,
                transformers_ms=median(theirs) * 1e3, speedup=median(theirs) / median(ours),
                expert_bytes_read=active * layer.expert_bytes,
                kvserve_GBps=active * layer.expert_bytes / median(ours) / 1e9,
                other_cpu_load=contention.stop())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--refcheck", action="store_true", help="check both agree before timing")
    ap.add_argument("--quick", action="store_true", help="one shape, bf16, 1 and 128 tokens")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "bench_moe.json")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.dtypes, args.tokens, args.repeats = (["deepseek-v2-lite"],
                                                               ["bfloat16"], [1, 128], 3)
    bandwidth = memory_read_bandwidth(repeats=5)
    headers = ["shape", "dtype", "tokens", "experts hit", "kvserve ms", "transformers ms",
               "speed-up", "kvserve GB/s", "of bandwidth"]
    rows, results = [], []
    for shape in args.shapes:
        for dtype in args.dtypes:
            layer = Layer(SHAPES[shape], DTYPES[dtype])
            for tokens in args.tokens:
                r = run(layer, tokens, args.repeats, args.refcheck)
                r.update(shape=shape, dtype=dtype)
                results.append(r)
                rows.append([shape, dtype, tokens, r["active_experts"], r["kvserve_ms"],
                             r["transformers_ms"], r["speedup"], r["kvserve_GBps"],
                             r["kvserve_GBps"] * 1e9 / bandwidth])
                print(markdown_table(headers, rows[-1:]).splitlines()[-1], flush=True)
            del layer
    bandwidth = max(bandwidth, memory_read_bandwidth(repeats=5))
    print()
    print(markdown_table(headers, rows))
    machine = machine_info()
    print(f"\nmachine: {machine['cpu']}, {machine['usable_cpus']} usable CPUs, "
          f"{machine['torch_threads']} torch threads, kvserve {machine['kvserve_cpu_capability']}; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    path = write_json(args.out, dict(machine=machine, read_bandwidth_Bps=bandwidth,
                                     results=results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
