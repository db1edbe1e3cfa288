"""Command line: ``python -m kvserve generate --model DIR --prompt TEXT``,
``python -m kvserve convert llama2c --checkpoint FILE.bin --tokenizer TOK.bin --out DIR``."""

from __future__ import annotations

import argparse
import sys

from kvserve.convert.llama2c import add_llama2c_parser


def _generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    out = llm.generate([args.prompt], params)[0]
    completion, m = out.outputs[0], out.metrics
    print(args.prompt + completion.text)
    total = m.finished_time - m.arrival_time
    print(f"\n[{len(out.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated, "
          f"finish_reason={completion.finish_reason}] "
          f"TTFT {m.time_to_first_token * 1e3:.1f} ms | "
          f"TPOT {m.time_per_output_token * 1e3:.2f} ms | "
          f"{len(completion.token_ids) / total:.1f} tokens/s", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt and print the text and its metrics")
    g.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.set_defaults(func=_generate)
    c = sub.add_parser("convert", help="write another format's checkpoint as a Hugging Face dir")
    add_llama2c_parser(c.add_subparsers(dest="format", required=True))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        sys.exit(args.func(args))
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        sys.exit(2)
