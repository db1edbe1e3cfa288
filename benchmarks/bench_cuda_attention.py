"""paged_attention on a CUDA GPU against the GPU's memory bandwidth (decode) and torch's flash
scaled_dot_product_attention (prefill), in one run.

  * HBM bandwidth: a device-to-device copy of --copy-gib GiB, bytes read plus bytes written;
  * decode: one query token per sequence over a paged cache (Llama-3-8B attention: 32 query
    heads, 8 KV heads, head_dim 128, bf16, 16-token blocks handed out in random order) for every
    batch size x context length that fits in --max-kv-gib; achieved bytes/s counts every key and
    value read once (plus queries and outputs), over the copy's bandwidth;
  * --variants fp8 mla: decode over an fp8 E4M3 cache (fp32 row scales, the same heads) and over
    DeepSeek's MLA latent (16 heads reading one 576-entry latent row per position, values its
    first 512), at batches 1, 16, 64 and contexts 2,048 and 8,192, bytes counted as stored;
  * prefill: causal attention of a whole prompt (queries = context) for each length, ours against
    torch's scaled_dot_product_attention (the flash backend) on contiguous [B, H, T, D] tensors
    with the KV heads expanded (enable_gqa); time ratio SDPA / ours (>= 1: ours is faster).
Each of --kernels (paged_attention's CUDA bodies: auto = the one the op picks, tensor cores for
bf16; mma64, tensor cores with the 64-row prefill tiles; rows, the row kernel; general) runs
every shape. --parts leaves out decode or prefill; --prefill names the prompt lengths (batch 1,
plus 8 prompts of 1,024). Each figure is the median of --repeats
timings by CUDA events (a decode timing covers 20 calls back to back, so that launch overhead
does not hide the kernel), the kernels of each shape interleaved. Prints markdown tables; writes
JSON to --out.

    python benchmarks/bench_cuda_attention.py
    python benchmarks/bench_cuda_attention.py --quick
    python benchmarks/bench_cuda_attention.py --parts prefill --kernels auto mma64
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing.bench import cuda_event_time, markdown_table, median

ops = torch.ops.kvserve
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE_CALLS = 20  # decode calls per timing, back to back


event_time = cuda_event_time  # CUDA events, calls back to back, median


def copy_bandwidth(gib: float, repeats: int) -> float:
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * n / event_time(lambda: dst.copy_(src), repeats)


def variant_decode_row(variant, batch, context, bandwidth, repeats, gen, kernels):
    """Decode over an fp8 cache ("fp8") or an MLA latent ("mla"), as decode_row."""
    blocks_per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    tables = (torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1).int()
    tables = tables.view(batch, blocks_per_seq)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    if variant == "fp8":
        heads, kv_heads, dim, value_dim = HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM
        key = torch.randn(num_blocks, BLOCK, kv_heads, dim, device="cuda", generator=gen)
        key = key.to(torch.float8_e4m3fn)
        value = torch.randn(key.shape, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        scales = [torch.rand(num_blocks, BLOCK, kv_heads, device="cuda", generator=gen) + 0.5
                  for _ in range(2)]
        row_bytes = 2 * (dim + 4)  # key and value entries, their scales
    else:  # mla
        heads, kv_heads, dim, value_dim = 16, 1, 576, 512
        key = torch.randn(num_blocks, BLOCK, 1, dim, dtype=torch.bfloat16, device="cuda",
                          generator=gen)
        value, scales = key, [None, None]
        row_bytes = 2 * dim  # one latent row, read once for keys and values
    query = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    out = torch.empty(batch, heads, value_dim, dtype=torch.bfloat16, device="cuda")

    def call():
        ops.paged_attention(out, query, key, value, qsl, lens, tables, dim ** -0.5, 0, 0.0,
                            *scales)

    nbytes = batch * context * kv_heads * row_bytes + 2 * (query.numel() + out.numel())
    return dict(variant=variant, batch=batch, context=context,
                **time_kernels(call, out, nbytes, bandwidth, repeats, kernels))


def paged_cache(batch: int, context: int, dtype, gen):
    blocks_per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    key = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda",
                      generator=gen)
    value = torch.randn_like(key)
    tables = (torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1).int()
    tables = tables.view(batch, blocks_per_seq)
    return key, value, tables


def interleaved(fns: dict, repeats: int, calls: int = 1, rounds: int = 3) -> dict:
    """Median seconds of each fn, timed in `rounds` interleaved rounds of repeats / rounds."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(event_time(fn, max(repeats // rounds, 3), calls))
    return {name: median(t) for name, t in times.items()}


def with_kernel(kernel: str, fn):
    def run():
        kvserve._C.set_cuda_attention_kernel(kernel)
        fn()
    return run


def time_kernels(call, out, nbytes, bandwidth, repeats, kernels) -> dict:
    """Decode timings of call() (writing `out`, reading `nbytes`) with each kernel, interleaved:
    µs, fraction of copy bandwidth, and how far the kernels' outputs are apart."""
    outputs = {}
    for kernel in kernels:
        with_kernel(kernel, call)()
        outputs[kernel] = out.clone()
    seconds = interleaved({k: with_kernel(k, call) for k in kernels}, repeats, DECODE_CALLS)
    kvserve._C.set_cuda_attention_kernel("auto")
    first = outputs[kernels[0]].float()
    return dict(us={k: t * 1e6 for k, t in seconds.items()},
                hbm_fraction={k: nbytes / t / bandwidth for k, t in seconds.items()},
                max_difference=max((o.float() - first).abs().max().item()
                                   for o in outputs.values()))


def report(label: str, row: dict, kernels) -> None:
    print(f"{label} batch {row['batch']} context {row['context']}: " + ", ".join(
        f"{k} {row['us'][k]:.1f} µs ({row['hbm_fraction'][k]:.0%})" for k in kernels),
        flush=True)


def decode_row(batch, context, dtype, bandwidth, repeats, gen, kernels):
    key, value, tables = paged_cache(batch, context, dtype, gen)
    query = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype, device="cuda", generator=gen)
    out = torch.empty_like(query)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")

    def call():
        ops.paged_attention(out, query, key, value, qsl, lens, tables, HEAD_DIM ** -0.5, 0, 0.0)

    elem = key.element_size()
    nbytes = 2 * batch * context * KV_HEADS * HEAD_DIM * elem + 2 * query.numel() * elem
    nbytes += tables.numel() * 4
    return dict(batch=batch, context=context,
                **time_kernels(call, out, nbytes, bandwidth, repeats, kernels))


def prefill_row(batch, length, dtype, repeats, gen, kernels):
    key, value, tables = paged_cache(batch, length, dtype, gen)
    query = torch.randn(batch * length, HEADS, HEAD_DIM, dtype=dtype, device="cuda",
                        generator=gen)
    out = torch.empty_like(query)
    qsl = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    # The same keys and values, contiguous, for SDPA: [B, H_kv, T, D].
    flat = tables.long().view(batch, -1)
    k = key[flat].view(batch, -1, KV_HEADS, HEAD_DIM)[:, :length].transpose(1, 2).contiguous()
    v = value[flat].view(batch, -1, KV_HEADS, HEAD_DIM)[:, :length].transpose(1, 2).contiguous()
    q = query.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2).contiguous()

    def ours():
        ops.paged_attention(out, query, key, value, qsl, lens, tables, HEAD_DIM ** -0.5, 0, 0.0)

    def sdpa():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    errors = {}
    for kernel in kernels:
        with_kernel(kernel, ours)()
        err = out.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2).float() - want.float()
        errors[kernel] = (err.norm() / want.float().norm()).item()
    fns = {k: with_kernel(k, ours) for k in kernels}
    fns["sdpa"] = sdpa
    seconds = interleaved(fns, repeats)
    kvserve._C.set_cuda_attention_kernel("auto")
    flops = 4 * batch * HEADS * HEAD_DIM * length * (length + 1) / 2
    return dict(batch=batch, length=length, ms={k: s * 1e3 for k, s in seconds.items()},
                speedup={k: seconds["sdpa"] / seconds[k] for k in kernels},
                tflops={k: flops / s / 1e12 for k, s in seconds.items()},
                relative_error=errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few small shapes")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--copy-gib", type=float, default=2.0)
    parser.add_argument("--max-kv-gib", type=float, default=24.0)
    parser.add_argument("--kernels", nargs="+", default=["auto", "rows"],
                        choices=["auto", "mma", "mma64", "rows", "general"])
    parser.add_argument("--parts", nargs="+", default=["decode", "prefill"],
                        choices=["decode", "prefill"])
    parser.add_argument("--prefill", nargs="+", type=int,
                        help="prompt lengths, batch 1 (default 512 to 32,768; --quick: 512 and "
                        "2,048, without the batch of 8)")
    parser.add_argument("--variants", nargs="*", default=[], choices=["fp8", "mla"])
    parser.add_argument("--out", default="benchmarks/results/cuda_attention.json")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [1, 8, 64] if args.quick else [1, 4, 16, 64, 256]
    contexts = [512, 4096] if args.quick else [512, 2048, 8192, 32768]
    bandwidth = copy_bandwidth(args.copy_gib, args.repeats)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    decode = []
    for batch in batches if "decode" in args.parts else []:
        for context in contexts:
            kv_gib = 2 * batch * context * KV_HEADS * HEAD_DIM * 2 / (1 << 30)
            if kv_gib <= args.max_kv_gib:
                row = decode_row(batch, context, dtype, bandwidth, args.repeats, gen,
                                 args.kernels)
                decode.append(row)
                report("decode", row, args.kernels)
                torch.cuda.empty_cache()
    variants = []
    for variant in args.variants if "decode" in args.parts else []:
        for batch in [1, 16, 64]:
            for context in [2048, 8192]:
                row = variant_decode_row(variant, batch, context, bandwidth, args.repeats, gen,
                                         args.kernels)
                variants.append(row)
                report(f"{variant} decode", row, args.kernels)
                torch.cuda.empty_cache()
    if args.prefill:
        shapes = [(1, n) for n in args.prefill] + [(8, 1024)]
    else:
        shapes = [(1, 512), (1, 2048)] if args.quick else [(1, n) for n in (512, 2048, 8192, 32768)]
        shapes += [] if args.quick else [(8, 1024)]
    prefill = []
    for b, n in shapes if "prefill" in args.parts else []:
        prefill.append(prefill_row(b, n, dtype, args.repeats, gen, args.kernels))
        r = prefill[-1]
        print(f"prefill batch {b} tokens {n}: sdpa {r['ms']['sdpa']:.3f} ms, " + ", ".join(
            f"{k} {r['ms'][k]:.3f} ms ({r['speedup'][k]:.2f}x)" for k in args.kernels), flush=True)
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name()
    out = Path(args.out)  # written first: a table that fails to print loses no figures
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=name, copy_bandwidth=bandwidth, decode=decode,
                                   variants=variants, prefill=prefill), indent=1))
    print(f"{name}: device-to-device copy {bandwidth / 1e12:.2f} TB/s (read + write)\n")
    ks = args.kernels
    if decode:
        print("Decode (one query per sequence), bf16, 32 query / 8 KV heads, head_dim 128:\n")
        print(markdown_table(["batch", "context"] + [f"{k}: µs, of copy bandwidth" for k in ks]
                             + ["max abs. difference"],
                             [[r["batch"], r["context"]]
                              + [f"{r['us'][k]:.1f}, {r['hbm_fraction'][k]:.0%}" for k in ks]
                              + [f"{r['max_difference']:.1e}"] for r in decode]))
    if variants:
        print("\nDecode over an fp8 cache (32 / 8 heads, head_dim 128) and an MLA latent (16 "
              "heads, 576 / 512), bf16 queries:\n")
        print(markdown_table(["cache", "batch", "context"]
                             + [f"{k}: µs, of copy bandwidth" for k in ks] + ["max abs. difference"],
                             [[r["variant"], r["batch"], r["context"]]
                              + [f"{r['us'][k]:.1f}, {r['hbm_fraction'][k]:.0%}" for k in ks]
                              + [f"{r['max_difference']:.1e}"] for r in variants]))
    if not prefill:
        return
    print("\nPrefill (causal, queries = context), bf16, against SDPA's flash backend:\n")
    print(markdown_table(["batch", "tokens", "SDPA ms"]
                         + [f"{k}: ms, SDPA / ours, TFLOP/s, rel. error" for k in ks],
                         [[r["batch"], r["length"], f"{r['ms']['sdpa']:.3f}"]
                          + [f"{r['ms'][k]:.3f}, {r['speedup'][k]:.2f}x, {r['tflops'][k]:.0f}, "
                             f"{r['relative_error'][k]:.1e}" for k in ks] for r in prefill]))


if __name__ == "__main__":
    main()
