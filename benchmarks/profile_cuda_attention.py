"""One paged_attention case on a CUDA GPU, run a few times for Nsight Compute to profile.

The decode and prefill shapes of bench_cuda_attention.py (Llama-3-8B attention: 32 query heads,
8 KV heads, head_dim 128, bf16, 16-token blocks in shuffled order); `cuda_session.sh
profile-attention` runs each case under `ncu` (speed of light, occupancy, warp stall reasons)
so that a figure below its goal comes with the profile that says why.

    python benchmarks/profile_cuda_attention.py --case prefill --batch 1 --tokens 8192
    ncu --kernel-name regex:paged_attention --launch-skip 1 --launch-count 1 \
        python benchmarks/profile_cuda_attention.py --case decode --batch 1 --tokens 160
"""

from __future__ import annotations

import argparse

import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from bench_cuda_attention import HEAD_DIM, HEADS, paged_cache

ops = torch.ops.kvserve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=["decode", "prefill"], required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8192, help="context (prefill: its length)")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--kernel", default="auto", choices=["auto", "mma", "mma64", "rows", "general"])
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    gen = torch.Generator(device="cuda").manual_seed(0)
    key, value, tables = paged_cache(args.batch, args.tokens, torch.bfloat16, gen)
    queries = args.batch * (args.tokens if args.case == "prefill" else 1)
    query = torch.randn(queries, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda",
                        generator=gen)
    out = torch.empty_like(query)
    step = args.tokens if args.case == "prefill" else 1
    qsl = torch.arange(0, queries + 1, step, dtype=torch.int32, device="cuda")
    lens = torch.full((args.batch,), args.tokens, dtype=torch.int32, device="cuda")
    kvserve._C.set_cuda_attention_kernel(args.kernel)
    for _ in range(args.calls):
        ops.paged_attention(out, query, key, value, qsl, lens, tables, HEAD_DIM ** -0.5, 0, 0.0)
    torch.cuda.synchronize()
    print(f"{args.case} batch {args.batch} tokens {args.tokens}: {args.calls} calls done")


if __name__ == "__main__":
    main()
