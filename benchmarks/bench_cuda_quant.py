"""Quantized projections on a CUDA GPU against bf16 cuBLAS at decode sizes, in one run.

For each Llama-3-8B projection shape (qkv, o, gate_up, down) and each number of tokens, one call
of y = x W^T with bf16 activations on:
  * bf16: torch.nn.functional.linear (cuBLAS), the baseline;
  * int8 (one scale per row), int4 (asymmetric, groups of 128: AWQ's grid), fp8 E4M3 (one scale
    per row): kvserve's `quantized_linear`, with each CUDA body named by --kernels (auto: the
    one it picks; mma: tensor cores on the packed weight in blocks of 16 rows; wide: tensor cores
    in blocks of 128-256 rows sharing the inputs staged in shared memory, the k-blocks split
    among blocks to fill the GPU; gemv: the GEMV up to 8 tokens, which unpacks the weight in
    registers; dequantize: rows dequantized in blocks for cuBLAS);
  * LLM.int8() (int8 per row, activation outliers >= 6 in floating point): `llm_int8_linear`.
Each timing cycles through enough copies of the weight to read past the L2 cache, as a model's
layers do, and covers --calls calls back to back (CUDA events); medians of --repeats, the
formats interleaved. Reported: µs, the weight bytes read per second (entries, scales and zero
points) against a device-to-device copy's bandwidth (read + write) measured in the same run,
speed-up over bf16, and the relative error against the dequantized weight in fp32.

    python benchmarks/bench_cuda_quant.py
    python benchmarks/bench_cuda_quant.py --tokens 1 8 --repeats 5
    python benchmarks/bench_cuda_quant.py --kernels mma gemv dequantize
    python benchmarks/bench_cuda_quant.py --kernels wide mma --tokens 8 16 32 64 128 256
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.quantization import quantize_fp8, quantize_int4, quantize_int8
from kvserve.testing.bench import cuda_event_time, markdown_table, median

ops = torch.ops.kvserve
SHAPES = {  # name: (out_features, in_features), Llama-3-8B's projections
    "qkv 4096->6144": (6144, 4096),
    "o 4096->4096": (4096, 4096),
    "gate_up 4096->28672": (28672, 4096),
    "down 14336->4096": (4096, 14336),
}
QUANTIZED = ["int8", "int4 g128", "fp8"]
WORKING_SET = 256 << 20  # bytes of bf16 weight copies cycled through, past any L2
DEVICE = "cuda"


event_time = cuda_event_time  # CUDA events, calls back to back, median


def copy_bandwidth(repeats: int) -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / event_time(lambda: dst.copy_(src), repeats, 1)


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def format_names(kernels: list[str]) -> list[str]:
    """The columns: bf16, each quantized format with each kernel choice, LLM.int8()."""
    return (["bf16"] + [f"{q} {kernel}" if kernel != "auto" else q
                        for q in QUANTIZED for kernel in kernels] + ["llm.int8"])


def with_kernel(kernel: str, fn):
    def call(x):
        kvserve._C.set_cuda_quantized_linear_kernel(kernel)
        return fn(x)
    return call


def make_formats(w: torch.Tensor, kernels: list[str]) -> dict:
    """Each format of the fp32 weight w: name -> (fn(x), bytes read, () -> the fp32 weight it
    stands for)."""
    bf16 = w.to(torch.bfloat16)
    out = {"bf16": (lambda x: F.linear(x, bf16), nbytes(bf16), lambda: bf16.float())}
    for name, q in (("int8", quantize_int8(w)), ("int4 g128", quantize_int4(w, 128)),
                    ("fp8", quantize_fp8(w))):
        fn = (lambda x, q=q: ops.quantized_linear(x, q.qweight, q.scales, q.zeros,
                                                  q.group_size))
        for kernel in kernels:
            column = f"{name} {kernel}" if kernel != "auto" else name
            out[column] = (with_kernel(kernel, fn), nbytes(q.qweight, q.scales, q.zeros),
                           q.dequantize)
    q = quantize_int8(w)
    scales = q.scales.view(-1).contiguous()
    out["llm.int8"] = (with_kernel("auto", lambda x: ops.llm_int8_linear(x, q.qweight, scales,
                                                                         6.0)),
                       nbytes(q.qweight, scales), q.dequantize)
    return out


def measure(shape, tokens_list, kernels, bandwidth, repeats, calls, gen) -> list[dict]:
    n, k = shape
    copies = max(1, math.ceil(WORKING_SET / (n * k * 2)))
    variants = [make_formats(torch.randn(n, k, device=DEVICE, generator=gen) * k ** -0.5,
                             kernels) for _ in range(copies)]
    names = format_names(kernels)
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, k, device=DEVICE, generator=gen).to(torch.bfloat16)
        x[:, :4] *= 20  # a few outlier columns, as LLM.int8() expects in real activations
        errors = {}
        for name in names:
            fn, _, weight = variants[0][name]
            want = x.float() @ weight().t()
            errors[name] = ((fn(x).float() - want).norm() / want.norm()).item()
        state = {"i": 0}

        def cycled(name):
            def call():
                state["i"] = (state["i"] + 1) % copies
                variants[state["i"]][name][0](x)
            return call

        times = {name: [] for name in names}
        for _ in range(3):  # interleaved rounds
            for name in names:
                times[name].append(event_time(cycled(name), max(repeats // 3, 2), calls))
        seconds = {name: median(t) for name, t in times.items()}
        rows.append(dict(
            n=n, k=k, tokens=tokens, us={f: s * 1e6 for f, s in seconds.items()},
            weight_gbps={f: variants[0][f][1] / s / 1e9 for f, s in seconds.items()},
            copy_fraction={f: variants[0][f][1] / s / bandwidth for f, s in seconds.items()},
            speedup={f: seconds["bf16"] / s for f, s in seconds.items()},
            relative_error=errors))
        r = rows[-1]
        print(f"[{n}, {k}] x {tokens} tokens: " + ", ".join(
            f"{f} {r['us'][f]:.1f} µs ({r['copy_fraction'][f]:.0%})" for f in names),
            flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+",
                        default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--kernels", nargs="+", default=["auto"],
                        choices=["auto", "mma", "wide", "gemv", "dequantize"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/cuda_quant.json")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    bandwidth = copy_bandwidth(args.repeats)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for name in args.shapes:
        rows += measure(SHAPES[name], args.tokens, args.kernels, bandwidth, args.repeats,
                        args.calls, gen)
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    out = Path(args.out)  # written first: a table that fails to print loses no figures
    out.parent.mkdir(parents=True, exist_ok=True)
    names = format_names(args.kernels)
    out.write_text(json.dumps(dict(device=device, copy_bandwidth=bandwidth, formats=names,
                                   rows=rows), indent=1))
    print(f"\n{device}: device-to-device copy {bandwidth / 1e12:.2f} TB/s; bf16 activations; "
          "µs, weight bytes read against copy bandwidth, speed-up over bf16 cuBLAS\n")
    print(markdown_table(
        ["[n, k]", "tokens"] + names + ["worst rel. error"],
        [[f"[{r['n']}, {r['k']}]", r["tokens"]]
         + [f"{r['us'][f]:.1f}, {r['copy_fraction'][f]:.0%}, {r['speedup'][f]:.2f}x"
            for f in names]
         + [f"{max(r['relative_error'].values()):.1e}"] for r in rows]))


if __name__ == "__main__":
    main()
