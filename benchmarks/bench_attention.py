"""paged_attention vs torch's scaled_dot_product_attention on the same data, decode and prefill.

kvserve: torch.ops.kvserve.paged_attention over a paged cache (block_size 16, blocks handed out in
shuffled order, as a long-running engine's block pool would) with flattened varlen queries.
SDPA: torch.nn.functional.scaled_dot_product_attention on the same keys and values laid out
contiguously as [B, H, S, D], with GQA through enable_gqa=True (no expanded copy of K/V). On CPU
that is ATen's flash-attention kernel. Masks: decode has none (one query sees its whole context),
prefill from scratch uses is_causal=True, and prefill after a cached prefix uses an explicit
boolean bottom-right causal mask (SDPA's is_causal aligns top-left when queries < keys).

Cases: decode (one query per sequence, batch 1/8/32, contexts 128/512/2048) and prefill (one
sequence of 128/512/2048 tokens; 256 new tokens over 1,792 cached), fp32 and bf16, for a
Qwen3-0.6B-like shape (16 query heads, 8 KV heads, head_dim 128) and a Llama-3.2-1B-like one
(32/8, head_dim 64). The two implementations are interleaved within each repeat so that they
see the same machine load; the table gives medians and the ratio paged/SDPA (< 1: paged faster).
Other processes' CPU use during each case is recorded (a busy neighbour skews a 2-core run).

    python benchmarks/bench_attention.py                  # full run
    python benchmarks/bench_attention.py --quick          # few cases, few repeats
    python benchmarks/bench_attention.py --refcheck       # check outputs agree before timing
    python benchmarks/bench_attention.py --threads 1      # one thread (steadier on a shared box)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing.bench import CpuContention, machine_info, markdown_table, median, write_json

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 16
SHAPES = {  # name -> (num_heads, num_kv_heads, head_dim)
    "qwen3-0.6b": (16, 8, 128),
    "llama-3.2-1b": (32, 8, 64),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (kind, batch, context_len, query_len per sequence)
CASES = ([("decode", b, s, 1) for b in (1, 8, 32) for s in (128, 512, 2048)]
         + [("prefill", 1, s, s) for s in (128, 512, 2048)] + [("prefix", 1, 2048, 256)])
QUICK_CASES = [("decode", 1, 512, 1), ("decode", 8, 2048, 1), ("prefill", 1, 512, 512),
               ("prefix", 1, 2048, 256)]
# Agreement of the two outputs for --refcheck (both accumulate in fp32; bf16 rounds the output).
TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


class Case:
    """The same queries, keys and values for both implementations."""

    def __init__(self, shape, dtype, batch, context_len, query_len, seed=0):
        num_heads, num_kv_heads, head_dim = shape
        g = torch.Generator().manual_seed(seed)
        self.scale = head_dim ** -0.5
        q = torch.randn(batch, num_heads, query_len, head_dim, generator=g).to(dtype)
        k = torch.randn(batch, num_kv_heads, context_len, head_dim, generator=g).to(dtype)
        v = torch.randn(batch, num_kv_heads, context_len, head_dim, generator=g).to(dtype)
        self.q, self.k, self.v = q, k, v
        self.mask = None
        self.is_causal = query_len == context_len and query_len > 1
        if 1 < query_len < context_len:  # bottom-right aligned causal mask
            rows = torch.arange(context_len - query_len, context_len)[:, None]
            self.mask = torch.arange(context_len)[None, :] <= rows

        # Paged: blocks of every sequence drawn from a shuffled pool (block 0 stays the null block).
        blocks_per_seq = -(-context_len // BLOCK_SIZE)
        num_blocks = 1 + batch * blocks_per_seq
        order = torch.randperm(num_blocks - 1, generator=g) + 1
        self.block_tables = order.view(batch, blocks_per_seq).int().contiguous()
        cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.key_cache = torch.zeros(cache_shape, dtype=dtype)
        self.value_cache = torch.zeros(cache_shape, dtype=dtype)
        padded = blocks_per_seq * BLOCK_SIZE
        for b in range(batch):
            # [kv_heads, S, D] -> [blocks, BLOCK_SIZE, kv_heads, D]
            for src, cache in ((k, self.key_cache), (v, self.value_cache)):
                x = torch.zeros(num_kv_heads, padded, head_dim, dtype=dtype)
                x[:, :context_len] = src[b]
                cache[self.block_tables[b].long()] = x.view(
                    num_kv_heads, blocks_per_seq, BLOCK_SIZE, head_dim).permute(1, 2, 0, 3)
        self.query = q.permute(0, 2, 1, 3).reshape(batch * query_len, num_heads, head_dim).contiguous()
        self.query_start_loc = torch.arange(0, batch + 1, dtype=torch.int32) * query_len
        self.seq_lens = torch.full((batch,), context_len, dtype=torch.int32)
        self.out = torch.empty_like(self.query)

    def paged(self):
        torch.ops.kvserve.paged_attention(self.out, self.query, self.key_cache, self.value_cache,
                                          self.query_start_loc, self.seq_lens, self.block_tables,
                                          self.scale, 0, 0.0)
        return self.out

    def sdpa(self):
        return F.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=self.mask,
                                              is_causal=self.is_causal, scale=self.scale,
                                              enable_gqa=True)

    def refcheck(self):
        batch, num_heads, query_len, head_dim = self.q.shape
        want = self.sdpa().permute(0, 2, 1, 3).reshape(-1, num_heads, head_dim)
        torch.testing.assert_close(self.paged().float(), want.float(),
                                   **TOLERANCES[self.q.dtype])


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_case(case: Case, repeats: int) -> dict:
    case.paged(), case.sdpa()  # warm up (scratch buffers, thread pool)
    paged, sdpa = [], []
    contention = CpuContention().start()
    for i in range(repeats):
        # Alternate which goes first, so neither always runs right after the other.
        if i % 2 == 0:
            paged.append(timed(case.paged)), sdpa.append(timed(case.sdpa))
        else:
            sdpa.append(timed(case.sdpa)), paged.append(timed(case.paged))
    return dict(paged_ms=median(paged) * 1e3, sdpa_ms=median(sdpa) * 1e3,
                paged_all_ms=[t * 1e3 for t in paged], sdpa_all_ms=[t * 1e3 for t in sdpa],
                ratio=median(paged) / median(sdpa), other_cpu_load=contention.stop())


def repeats_for(kind, batch, context_len, query_len, quick):
    """Enough repeats for a stable median in a few seconds per case."""
    work = batch * context_len * query_len
    n = 30 if work <= 64 * 2048 else 15 if work <= 512 * 512 else 7
    return max(3, n // 3) if quick else n


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="few cases and repeats")
    parser.add_argument("--refcheck", action="store_true",
                        help="check that both outputs agree before timing each case")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--kinds", nargs="+", default=["decode", "prefill", "prefix"])
    parser.add_argument("--repeats", type=int, default=None, help="override the repeat count")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both (default: torch's, one per usable CPU)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "bench_attention.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cases = QUICK_CASES if args.quick else CASES
    results = []
    headers = ["shape", "dtype", "case", "batch", "context", "queries", "paged ms", "SDPA ms",
               "paged/SDPA", "other load"]
    rows = []
    for shape_name in args.shapes:
        for dtype_name in args.dtypes:
            for kind, batch, context_len, query_len in cases:
                if kind not in args.kinds:
                    continue
                case = Case(SHAPES[shape_name], DTYPES[dtype_name], batch, context_len, query_len)
                if args.refcheck:
                    case.refcheck()
                repeats = args.repeats or repeats_for(kind, batch, context_len, query_len,
                                                      args.quick)
                r = run_case(case, repeats)
                r.update(shape=shape_name, dtype=dtype_name, kind=kind, batch=batch,
                         context_len=context_len, query_len=query_len, repeats=repeats)
                results.append(r)
                rows.append([shape_name, dtype_name, kind, batch, context_len, query_len,
                             r["paged_ms"], r["sdpa_ms"], r["ratio"], r["other_cpu_load"]])
                print(markdown_table(headers, rows[-1:]).splitlines()[-1], flush=True)
                del case

    print()
    print(markdown_table(headers, rows))
    machine = machine_info()
    print(f"\nmachine: {machine['cpu']}, {machine['usable_cpus']} usable CPUs, "
          f"{machine['torch_threads']} torch threads, kvserve {machine['kvserve_cpu_capability']}, "
          f"torch {machine['torch']} ({machine['torch_cpu_capability']})")
    print(f"SDPA: enable_gqa=True (K/V not expanded); refcheck: {args.refcheck}")
    path = write_json(args.out, dict(machine=machine, block_size=BLOCK_SIZE, gqa="enable_gqa=True",
                                     refcheck=args.refcheck, results=results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
