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
    python benchmarks/bench_attention.py --mla            # MLA decode instead (below)

--mla: one layer of DeepSeek-V2-Lite's multi-head latent attention (16 heads, latent 512 + rope
64, nope 128, v 128) decoding batch 1/8 at contexts 512/2048/4096, three ways over the same
tokens: absorbed (the engine's decode: q W_UK, paged_attention as MQA over the latent cache,
then W_UV), expanded (the latents gathered and expanded by kv_b_proj to per-head K/V, then
paged_attention), and a GQA layer at equal context (the qwen3-0.6b shape: 16 heads, 8 KV heads
of 128). The table gives each one's KV bytes read per step and its time.
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


MLA_SHAPE = dict(heads=16, kv_lora_rank=512, rope=64, nope=128, v=128)  # DeepSeek-V2-Lite
MLA_CASES = [(b, s) for b in (1, 8) for s in (512, 2048, 4096)]


class MLACase:
    """One MLA layer's decode step over a latent paged cache, in both forms, and a GQA layer's
    decode over a K/V cache of the same context (qwen3-0.6b's 16 / 8 heads of 128)."""

    def __init__(self, dtype, batch, context_len, seed=0):
        m = MLA_SHAPE
        H, L, R, N, V = m["heads"], m["kv_lora_rank"], m["rope"], m["nope"], m["v"]
        g = torch.Generator().manual_seed(seed)
        blocks_per_seq = -(-context_len // BLOCK_SIZE)
        num_blocks = 1 + batch * blocks_per_seq
        order = torch.randperm(num_blocks - 1, generator=g) + 1
        self.block_tables = order.view(batch, blocks_per_seq).int().contiguous()
        self.latents = (torch.randn(num_blocks, BLOCK_SIZE, 1, L + R, generator=g) * 0.5).to(dtype)
        self.query_start_loc = torch.arange(0, batch + 1, dtype=torch.int32)
        self.seq_lens = torch.full((batch,), context_len, dtype=torch.int32)
        # As the engine holds them: kv_b_proj's per-head halves in fp32 (see MLAAttention).
        kv_b = torch.randn(H * (N + V), L, generator=g) / L ** 0.5
        self.w_uk = kv_b.view(H, N + V, L)[:, :N].contiguous()
        self.w_uv = kv_b.view(H, N + V, L)[:, N:].contiguous()
        self.q_nope = torch.randn(batch, H, N, generator=g).to(dtype)
        self.q_rope = torch.randn(batch, H, R, generator=g).to(dtype)
        self.scale = (N + R) ** -0.5
        self.gather = self.block_tables.view(-1).long()
        self.expanded_tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(
            batch, blocks_per_seq)
        gqa_heads, gqa_kv, gqa_dim = SHAPES["qwen3-0.6b"]
        self.gqa_key = torch.randn(num_blocks, BLOCK_SIZE, gqa_kv, gqa_dim, generator=g).to(dtype)
        self.gqa_value = torch.randn_like(self.gqa_key)
        self.gqa_query = torch.randn(batch, gqa_heads, gqa_dim, generator=g).to(dtype)
        elt = torch.tensor([], dtype=dtype).element_size()
        tokens = batch * context_len
        self.bytes = dict(absorbed=tokens * (L + R) * elt, expanded=tokens * (L + R) * elt,
                          gqa=tokens * 2 * gqa_kv * gqa_dim * elt,
                          mha_equivalent=tokens * H * (N + R + V) * elt)
        self.dims = (H, L, R, N, V)

    def absorbed(self):
        H, L, R, N, V = self.dims
        n = self.q_nope.size(0)
        query = torch.empty(n, H, L + R, dtype=self.q_nope.dtype)
        query[..., :L] = torch.bmm(self.q_nope.transpose(0, 1).float(), self.w_uk).transpose(0, 1)
        query[..., L:] = self.q_rope
        out = torch.empty(n, H, L, dtype=self.q_nope.dtype)
        torch.ops.kvserve.paged_attention(out, query, self.latents, self.latents,
                                          self.query_start_loc, self.seq_lens, self.block_tables,
                                          self.scale, 0, 0.0)
        return torch.bmm(out.transpose(0, 1).float(), self.w_uv.transpose(1, 2)).transpose(
            0, 1).to(out.dtype)

    def expanded(self):
        H, L, R, N, V = self.dims
        blocks = self.latents.index_select(0, self.gather)
        nb = blocks.size(0)
        flat = blocks.view(nb * BLOCK_SIZE, L + R)
        latent = flat[:, :L].float()
        keys = torch.empty(nb, BLOCK_SIZE, H, N + R, dtype=flat.dtype)
        keys[..., :N] = F.linear(latent, self.w_uk.view(H * N, L)).view(nb, BLOCK_SIZE, H, N)
        keys[..., N:] = flat[:, L:].view(nb, BLOCK_SIZE, 1, R)
        values = F.linear(latent, self.w_uv.view(H * V, L)).to(flat.dtype).view(
            nb, BLOCK_SIZE, H, V)
        query = torch.cat([self.q_nope, self.q_rope], dim=-1)
        out = torch.empty(query.size(0), H, V, dtype=query.dtype)
        torch.ops.kvserve.paged_attention(out, query, keys, values, self.query_start_loc,
                                          self.seq_lens, self.expanded_tables, self.scale, 0, 0.0)
        return out

    def gqa(self):
        out = torch.empty_like(self.gqa_query)
        torch.ops.kvserve.paged_attention(out, self.gqa_query, self.gqa_key, self.gqa_value,
                                          self.query_start_loc, self.seq_lens, self.block_tables,
                                          self.gqa_query.size(-1) ** -0.5, 0, 0.0)
        return out


def run_mla(args) -> list[dict]:
    headers = ["dtype", "batch", "context", "form", "KV MiB read", "ms", "GB/s",
               "vs absorbed"]
    rows, results = [], []
    cases = [(1, 2048), (8, 2048)] if args.quick else MLA_CASES
    for dtype_name in args.dtypes:
        for batch, context_len in cases:
            case = MLACase(DTYPES[dtype_name], batch, context_len)
            if args.refcheck:
                torch.testing.assert_close(case.absorbed().float(), case.expanded().float(),
                                           **TOLERANCES[DTYPES[dtype_name]])
            forms = {"absorbed": case.absorbed, "expanded": case.expanded, "gqa": case.gqa}
            for fn in forms.values():
                fn()  # warm up
            times = {name: [] for name in forms}
            repeats = args.repeats or (5 if args.quick else 15)
            contention = CpuContention().start()
            for i in range(repeats):
                names = list(forms) if i % 2 == 0 else list(reversed(forms))
                for name in names:
                    times[name].append(timed(forms[name]))
            load = contention.stop()
            absorbed_ms = median(times["absorbed"]) * 1e3
            for name in forms:
                ms = median(times[name]) * 1e3
                r = dict(dtype=dtype_name, batch=batch, context_len=context_len, form=name,
                         kv_bytes=case.bytes[name], ms=ms, all_ms=[t * 1e3 for t in times[name]],
                         mha_equivalent_bytes=case.bytes["mha_equivalent"],
                         other_cpu_load=load)
                results.append(r)
                rows.append([dtype_name, batch, context_len, name, case.bytes[name] / 2**20, ms,
                             case.bytes[name] / ms / 1e6, ms / absorbed_ms])
                print(markdown_table(headers, rows[-1:]).splitlines()[-1], flush=True)
            del case
    print()
    print(markdown_table(headers, rows))
    m = MLA_SHAPE
    ratio = m["heads"] * (m["nope"] + m["rope"] + m["v"]) / (m["kv_lora_rank"] + m["rope"])
    print(f"\nplain multi-head K/V of the same model ({m['heads']} heads of K {m['nope'] + m['rope']}"
          f" + V {m['v']}) would read {ratio:.1f}x the latent cache's bytes per step")
    return results


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
    parser.add_argument("--mla", action="store_true",
                        help="MLA decode (absorbed, expanded) against GQA instead")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mla:
        results = run_mla(args)
        machine = machine_info()
        path = write_json(args.out or HERE / "results" / "bench_attention_mla.json",
                          dict(machine=machine, block_size=BLOCK_SIZE, shape=MLA_SHAPE,
                               results=results))
        print(f"machine: {machine['cpu']}, {machine['usable_cpus']} usable CPUs, kvserve "
              f"{machine['kvserve_cpu_capability']}\nwrote {path}")
        return

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
    path = write_json(args.out or HERE / "results" / "bench_attention.json",
                      dict(machine=machine, block_size=BLOCK_SIZE, gqa="enable_gqa=True",
                                     refcheck=args.refcheck, results=results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
