"""Write a tiny randomly initialised Hugging Face checkpoint (for the demo and for trying kvserve
without a model). Needs transformers.

    python scripts/make_random_checkpoint.py --out build/random-llama [--architecture Qwen3ForCausalLM]
"""

import argparse

import torch

from kvserve.testing.checkpoints import TINY_CONFIGS, make_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--architecture", default="LlamaForCausalLM", choices=sorted(TINY_CONFIGS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = make_checkpoint(args.out, args.architecture, dtype=getattr(torch, args.dtype),
                           seed=args.seed)
    print(f"wrote a random {args.architecture} checkpoint to {path}")


if __name__ == "__main__":
    main()
