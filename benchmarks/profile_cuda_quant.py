"""One quantized_linear case on a CUDA GPU, run a few times for Nsight Compute to profile.

The Llama-3-8B projection shapes of bench_cuda_quant.py with bf16 activations; `cuda_session.sh
profile-quant` runs each case under `ncu` (speed of light, memory and compute workload,
occupancy, warp stall reasons) so that a figure below its goal comes with the profile that says
why.

    python benchmarks/profile_cuda_quant.py --shape "gate_up 4096->28672" --format int8 --tokens 64
    ncu --kernel-name regex:quantized_gemm --launch-skip 2 --launch-count 1 \\
        python benchmarks/profile_cuda_quant.py --format int4 --tokens 8
"""

from __future__ import annotations

import argparse

import torch

import kvserve
from bench_cuda_quant import SHAPES
from kvserve.quantization import quantize_fp8, quantize_int4, quantize_int8

ops = torch.ops.kvserve
QUANTIZERS = {"int8": quantize_int8, "int4": lambda w: quantize_int4(w, 128), "fp8": quantize_fp8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="gate_up 4096->28672", choices=list(SHAPES))
    parser.add_argument("--format", default="int8", choices=list(QUANTIZERS))
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--kernel", default="auto",
                        choices=["auto", "mma", "wide", "gemv", "dequantize"])
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, k = SHAPES[args.shape]
    q = QUANTIZERS[args.format](torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5)
    x = torch.randn(args.tokens, k, device="cuda", generator=gen).to(torch.bfloat16)
    kvserve._C.set_cuda_quantized_linear_kernel(args.kernel)
    for _ in range(args.calls):
        ops.quantized_linear(x, q.qweight, q.scales, q.zeros, q.group_size)
    torch.cuda.synchronize()
    print(f"{args.shape} {args.format} x {args.tokens} tokens: {args.calls} calls done")


if __name__ == "__main__":
    main()
