"""Command line:

    python -m kvserve generate [--model DIR] --prompt TEXT [--speculative-model DIR | --ngram]
                               [--kv-cache-dtype int8|fp8]
    python -m kvserve eval-ppl --model DIR --text FILE [--max-tokens N] [engine options]
    python -m kvserve serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                            [engine options]
    python -m kvserve convert llama2c --checkpoint FILE.bin --tokenizer TOK.bin --out DIR
    python -m kvserve quantize --model DIR --method int8|w8a8|llm.int8|fp8|int4|awq --out DIR
                               [--group-size N] [--calibration FILE] [--eval-text FILE]
                               [--lm-head] [--embeddings]
    python -m kvserve merge-lora --base DIR --adapter DIR --out DIR
    python -m kvserve prune --model DIR --calibration FILE --out DIR [--layers N] [--heads N]
                            [--intermediate N] [--hidden N]
    python -m kvserve distill --teacher DIR --student DIR --corpus FILE --out DIR [--steps N]
                              [--temperature T] [--ce-weight W] [--patience N]
    python -m kvserve train-eagle --target DIR --corpus FILE --out DIR [--steps N]
                                  [--ttt-steps N] [--draft-vocab-size N] [--aux-layers A B C]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvserve.convert.llama2c import add_llama2c_parser
from kvserve.distributed import torchrun_rank
from kvserve.engine_args import AsyncEngineArgs, EngineArgs
from kvserve.server.limits import DEFAULT_MAX_WAITING_REQUESTS, ServerLimits

_MODEL_HELP = "Hugging Face checkpoint directory"

# generate's model when --model is not given: $KVSERVE_MODEL, else the trained model that ships in
# models/ of the source checkout this package runs from (an editable install). An installed wheel
# has no models/ beside it, so there it takes --model or KVSERVE_MODEL.
MODEL_ENV = "KVSERVE_MODEL"
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "shakespeare-target"


def _default_model() -> Path:
    """The model directory for generate without --model. Raises FileNotFoundError saying what to
    pass when there is none."""
    configured = os.environ.get(MODEL_ENV)
    if configured:
        if not Path(configured).is_dir():
            raise FileNotFoundError(f"{MODEL_ENV}={configured} is not a directory: pass --model "
                                    f"DIR or point {MODEL_ENV} at a checkpoint directory")
        return Path(configured)
    if (DEFAULT_MODEL / "config.json").is_file():
        return DEFAULT_MODEL
    raise FileNotFoundError(
        f"no model given: pass --model DIR (a Hugging Face checkpoint directory) or set "
        f"{MODEL_ENV}=DIR. The trained models that come with kvserve are in models/ of its source "
        f"tree (models/shakespeare-target, models/shakespeare-draft); an installed package does "
        f"not contain them")


def _generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    llm = LLM.from_engine_args(EngineArgs.from_cli_args(
        args, model=args.model or _default_model(), log_memory_plan=False))
    # A flag given, else the checkpoint's generation_config.json, else temperature 0.8 and 64
    # tokens.
    given = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p", "min_p")
             if getattr(args, name) is not None}
    given = given | ({} if args.max_tokens is None else {"max_tokens": args.max_tokens})
    params = SamplingParams(**({"temperature": 0.8, "max_tokens": 64}
                               | llm.llm_engine.default_sampling | given),
                            seed=args.seed, ignore_eos=args.ignore_eos)
    out = llm.generate([args.prompt], params)[0]
    completion, m = out.outputs[0], out.metrics
    print(args.prompt + completion.text)
    total = m.finished_time - m.arrival_time
    print(f"\n[{len(out.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated, "
          f"finish_reason={completion.finish_reason}] "
          f"TTFT {m.time_to_first_token * 1e3:.1f} ms | "
          f"TPOT {m.time_per_output_token * 1e3:.2f} ms | "
          f"{len(completion.token_ids) / total:.1f} tokens/s", file=sys.stderr)
    if m.num_drafts:
        print(f"[speculative: {m.num_drafts} drafts, {m.num_accepted_tokens} of "
              f"{m.num_draft_tokens} draft tokens accepted "
              f"({m.num_accepted_tokens / m.num_draft_tokens:.0%}), mean acceptance length "
              f"{m.mean_acceptance_length:.2f}]", file=sys.stderr)
    return 0


def _eval_ppl(args: argparse.Namespace) -> int:
    from kvserve import LLM
    from kvserve.perplexity import evaluate_perplexity

    if not args.text.is_file():
        raise FileNotFoundError(f"--text {args.text} not found")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args, log_memory_plan=False))
    if llm.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json to encode the text with")
    ids = llm.tokenizer.encode(args.text.read_text(encoding="utf-8"))
    if args.max_tokens is not None:
        ids = ids[:args.max_tokens]
    kv_dtype = llm.llm_engine.kv_cache_dtype
    r = evaluate_perplexity(llm, ids, max_length=args.max_length, stride=args.stride)
    kv = "" if kv_dtype == llm.dtype else f", KV cache {str(kv_dtype).removeprefix('torch.')}"
    tp = "" if args.tensor_parallel_size == 1 else f", {args.tensor_parallel_size} ranks"
    print(f"perplexity {r.perplexity:.4f} (mean NLL {r.nll:.4f} nats) over {r.num_tokens:,} "
          f"tokens of {args.text}; {r.num_windows} windows of up to {r.max_length} tokens, "
          f"stride {r.stride}; {llm.dtype}{kv}{tp}; {r.seconds:.1f} s")
    llm.shutdown()
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from kvserve.quantization.quantize import quantize_checkpoint

    qc = quantize_checkpoint(Path(args.model), Path(args.out), args.method, args.group_size,
                             args.calibration, args.eval_text, args.eval_tokens, args.lm_head,
                             args.embeddings)
    print(f"wrote {args.out} ({qc['quant_method']}, {args.method}"
          f"{f', group size {args.group_size}' if args.method in ('int4', 'awq') else ''}"
          f"{', LM head too' if args.lm_head else ''}"
          f"{', embeddings too' if args.embeddings else ''})")
    return 0


def _merge_lora(args: argparse.Namespace) -> int:
    from kvserve.lora import merge_lora

    done = merge_lora(args.base, args.adapter, args.out)
    print(f"wrote {args.out}: {len(done['merged'])} weights merged, "
          f"{len(done['replaced'])} replaced")
    return 0


def _prune(args: argparse.Namespace) -> int:
    from kvserve.prune import prune_checkpoint

    if not args.calibration.is_file():
        raise FileNotFoundError(f"--calibration {args.calibration}: no such file")
    done = prune_checkpoint(args.model, args.calibration.read_text(), args.out,
                            layers=args.layers, heads=args.heads,
                            intermediate=args.intermediate, hidden=args.hidden)
    c = done["config"]
    print(f"wrote {args.out}: {c['num_hidden_layers']} layers, {c['num_attention_heads']} heads "
          f"({c['num_key_value_heads']} KV), intermediate {c['intermediate_size']}, hidden "
          f"{c['hidden_size']}")
    return 0


def _train_eagle(args: argparse.Namespace) -> int:
    from kvserve.train_eagle import EagleTrainConfig, train_eagle

    config = EagleTrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        ttt_steps=args.ttt_steps, lr=args.lr, warmup_steps=args.warmup_steps,
        draft_vocab_size=args.draft_vocab_size, aux_layers=tuple(args.aux_layers or ()),
        eval_every=args.eval_every, eval_batches=args.eval_batches, patience=args.patience,
        max_minutes=args.max_minutes, seed=args.seed, device=args.device,
        init_from=args.init_from or "", generated_windows=args.generated_windows,
        generate_temperature=args.generate_temperature)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    done = train_eagle(args.target, args.corpus, args.out, config, resume=args.resume)
    agreement = " / ".join(f"{a:.2f}" for a in done["after"]["agreement"])
    print(f"wrote {args.out}: held-out loss {done['before']['validation_loss']:.3f} -> "
          f"{done['after']['validation_loss']:.3f}, agreement with the target's greedy token by "
          f"step {agreement}; {done['steps_run']} steps in {done['wall_time_s']:.0f} s, kept "
          f"step {done['best_step']}")
    return 0


def _distill(args: argparse.Namespace) -> int:
    from kvserve.distill import DistillConfig, distill

    config = DistillConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        warmup_steps=args.warmup_steps, temperature=args.temperature, ce_weight=args.ce_weight,
        eval_every=args.eval_every, eval_batches=args.eval_batches, patience=args.patience,
        seed=args.seed, device=args.device)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    done = distill(args.teacher, args.student, args.corpus, args.out, config)
    before, after = done["before"], done["after"]
    print(f"wrote {args.out}: validation loss {before['validation_loss']:.3f} -> "
          f"{after['validation_loss']:.3f} (teacher {done['teacher_validation_loss']:.3f}), KL "
          f"to the teacher {before['validation_kl']:.3f} -> {after['validation_kl']:.3f}; "
          f"{done['steps_run']} steps, kept step {done['best_step']}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    try:
        from kvserve.server.serve import serve
    except ImportError as e:
        raise ValueError(f"serve needs the server's packages ({e.name} is missing): "
                         f"pip install 'kvserve[serve]' (fastapi, uvicorn, prometheus-client)"
                         ) from e
    if args.threads is not None:
        import torch

        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    engine_args = AsyncEngineArgs.from_cli_args(args, log_memory_plan=False)
    serve(engine_args, args.host, args.port, args.api_key or os.environ.get("KVSERVE_API_KEY"),
          args.served_model_name, args.chat_template, args.log_level,
          lora_modules=_lora_modules(args.lora_modules),
          limits=ServerLimits.from_cli_args(args), enable_docs=args.enable_docs)
    return 0


def _launch(args: argparse.Namespace) -> int:
    from kvserve.launch import launch, plan_workers

    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    if "--model" not in serve_args:
        raise ValueError("give the workers' options after --, --model among them: "
                         "kvserve launch --replicas 2 -- --model DIR")
    workers = plan_workers(args.replicas, args.prefill, args.decode,
                           args.worker_port or args.port + 1)
    try:
        return launch(workers, serve_args, args.host, args.port, args.router_policy,
                      args.threads_per_worker)
    except RuntimeError as e:
        print(f"kvserve launch: {e}", file=sys.stderr)
        return 1


def _lora_modules(specs: list[str] | None) -> dict[str, str]:
    """{name: path} from NAME=PATH arguments."""
    modules = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def _add_training_arguments(p: argparse.ArgumentParser, steps: int, devices: str) -> None:
    """The options distill and train-eagle share: the corpus and its windows, the schedule, the
    held-out evaluations and early stop, the seed, threads and device."""
    p.add_argument("--corpus", required=True, type=Path,
                   help="UTF-8 text; its last tenth (by characters) validates")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window, BOS included")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (cosine decay)")
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8,
                   help="batches of validation windows per evaluation (0: all)")
    p.add_argument("--patience", type=int, default=4,
                   help="stop after this many evaluations without a better validation loss "
                   "(0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help=f"cpu, or cuda[:N] for {devices}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt and print the text and its metrics")
    g.add_argument("--model", help="Hugging Face checkpoint directory (default: $KVSERVE_MODEL, "
                   "else models/shakespeare-target when run from a source checkout)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=None,
                   help="(default: the checkpoint's generation_config.json max_new_tokens, else "
                   "64)")
    sampling = ("(default: the checkpoint's generation_config.json, else %s; "
                "--generation-config none ignores the file)")
    g.add_argument("--temperature", type=float, default=None, help=sampling % "0.8")
    g.add_argument("--top-k", type=int, default=None, help=sampling % "off")
    g.add_argument("--top-p", type=float, default=None, help=sampling % "1: off")
    g.add_argument("--min-p", type=float, default=None, help=sampling % "0: off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    EngineArgs.add_cli_args(g, exclude={"model"})
    g.set_defaults(func=_generate)
    e = sub.add_parser("eval-ppl", help="perplexity of a text file under a model")
    e.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    e.add_argument("--text", required=True, type=Path, help="UTF-8 text file")
    e.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    e.add_argument("--max-length", type=int, default=None,
                   help="tokens per window (default and most: max_model_len - 1)")
    e.add_argument("--stride", type=int, default=None, help="window step (default: half a window)")
    # The engine scores the text as it serves (--kv-cache-dtype int8: with the keys and values
    # quantized as a server caches them; --tensor-parallel-size N: over N ranks). Speculation
    # and LoRA do not apply to scoring.
    EngineArgs.add_cli_args(e, exclude={"model", "speculative_model", "speculative_method",
                                        "num_speculative_tokens", "prompt_lookup_min",
                                        "prompt_lookup_max", "speculative_disable_batch_size",
                                        "speculative_max_verify_tokens", "enable_lora",
                                        "max_loras", "max_lora_rank", "log_memory_plan",
                                        "max_stop_strings", "max_stop_string_length",
                                        "max_waiting_requests", "max_logprobs"})
    e.set_defaults(func=_eval_ppl)
    q = sub.add_parser("quantize", help="write a quantized copy of a checkpoint")
    q.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    q.add_argument("--method", required=True,
                   choices=["int8", "w8a8", "llm.int8", "fp8", "int4", "awq"],
                   help="int8 / fp8 per channel (compressed-tensors; w8a8: int8 with dynamic "
                   "per-token int8 activations); llm.int8: int8 per channel "
                   "run as LLM.int8() (bitsandbytes 8-bit); int4 per group, rounded to nearest or "
                   "after AWQ's search (AWQ gemm)")
    q.add_argument("--calibration", type=Path, default=None,
                   help="text file AWQ calibrates on (--method awq)")
    q.add_argument("--out", required=True, help="directory to write")
    q.add_argument("--eval-text", type=Path, default=None,
                   help="text whose perplexity (quantized and original) the model card gets "
                   "(default: --calibration)")
    q.add_argument("--eval-tokens", type=int, default=4096,
                   help="tokens of --eval-text to score (4096)")
    q.add_argument("--group-size", type=int, default=128, help="int4 inputs per group (128, 64, 32)")
    q.add_argument("--lm-head", action="store_true",
                   help="quantize the LM head too (int8, fp8, int4, awq; a tied head is untied)")
    q.add_argument("--embeddings", action="store_true",
                   help="quantize the input embedding too (int8, fp8; a tied LM head is the "
                   "embedding, quantized with it)")
    q.set_defaults(func=_quantize)
    m = sub.add_parser("merge-lora", help="merge a PEFT LoRA adapter into its base checkpoint")
    m.add_argument("--base", required=True, help="the base model's Hugging Face directory")
    m.add_argument("--adapter", required=True,
                   help="the adapter's directory (adapter_config.json, adapter_model.safetensors)")
    m.add_argument("--out", required=True, help="directory to write the merged checkpoint to")
    m.set_defaults(func=_merge_lora)
    p = sub.add_parser("prune", help="remove the least important layers, heads and channels")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--calibration", required=True, type=Path,
                   help="text whose activations rank what to keep")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--layers", type=int, default=None, help="decoder layers to keep")
    p.add_argument("--heads", type=int, default=None,
                   help="query heads per layer to keep (whole GQA groups)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP channels to keep")
    p.add_argument("--hidden", type=int, default=None, help="model width to keep")
    p.set_defaults(func=_prune)
    d = sub.add_parser("distill", help="train a student on a teacher's logits (forward KL)")
    d.add_argument("--teacher", required=True, help="the teacher's checkpoint directory")
    d.add_argument("--student", required=True,
                   help="the student's checkpoint directory (e.g. a pruned teacher); same tokenizer")
    d.add_argument("--out", required=True, help="directory to write the distilled student to")
    _add_training_arguments(d, steps=600, devices="teacher and student")
    d.add_argument("--temperature", type=float, default=1.0,
                   help="softens both distributions; the loss is scaled by its square")
    d.add_argument("--ce-weight", type=float, default=0.0,
                   help="weight of the next-token cross entropy on the text, added to the KL")
    d.set_defaults(func=_distill)
    e = sub.add_parser("train-eagle", help="train an EAGLE-3 speculation head for a target")
    e.add_argument("--target", required=True, help="the target's checkpoint directory (Llama)")
    e.add_argument("--out", required=True, help="directory to write the head to")
    _add_training_arguments(e, steps=800, devices="target and head")
    e.add_argument("--ttt-steps", type=int, default=3,
                   help="training-time test steps: the head chained on its own outputs")
    e.add_argument("--draft-vocab-size", type=int, default=0,
                   help="the most frequent tokens of the text the head drafts (0: all)")
    e.add_argument("--aux-layers", type=int, nargs=3, default=None, metavar="LAYER",
                   help="the target layers whose entering streams the head reads "
                   "(default: low, middle, high)")
    e.add_argument("--max-minutes", type=float, default=0.0,
                   help="stop after an evaluation once training took this long (0: no limit); "
                   "the learning-rate schedule spans the steps that fit (timed over the first "
                   "five)")
    e.add_argument("--generated-windows", type=int, default=0, metavar="N",
                   help="self-distillation: train on N windows the target wrote itself "
                   "(continuations of corpus prompts, generated with kvserve before training) "
                   "instead of corpus windows (0: corpus)")
    e.add_argument("--generate-temperature", type=float, default=0.0,
                   help="the temperature those continuations are sampled at (0: greedy)")
    e.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its training_state.pt (written at each "
                   "evaluation) up to --steps, with the same other settings")
    e.add_argument("--init-from", default=None, metavar="HEAD_DIR",
                   help="start from a head written before (same target layers and draft "
                   "vocabulary), with a fresh optimizer and learning-rate schedule")
    e.set_defaults(func=_train_eagle)
    v = sub.add_parser("serve", help="serve the OpenAI API over HTTP")
    v.add_argument("--model", required=True, help=_MODEL_HELP)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1 (default: $KVSERVE_API_KEY)")
    v.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: --model as given)")
    v.add_argument("--threads", type=int, default=None,
                   help="compute threads (default: torch's, one per core); leave a core to the "
                   "event loop and clients on small hosts")
    v.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs every request)")
    v.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file or text) instead of the checkpoint's")
    v.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=None,
                   help="LoRA adapters (PEFT directories) served as models named NAME "
                   "(turns --enable-lora on)")
    v.add_argument("--enable-docs", action="store_true",
                   help="serve /docs and /openapi.json (behind --api-key)")
    AsyncEngineArgs.add_cli_args(v, exclude={"model"},
                                 defaults={"max_waiting_requests": DEFAULT_MAX_WAITING_REQUESTS})
    ServerLimits.add_cli_args(v)
    v.set_defaults(func=_serve)
    la = sub.add_parser("launch", help="several serve workers behind vLLM's router (replicas, "
                        "or prefill/decode disaggregation)")
    la.add_argument("--replicas", type=int, default=0, help="colocated workers")
    la.add_argument("--prefill", type=int, default=0, help="prefill workers (--kv-role producer)")
    la.add_argument("--decode", type=int, default=0, help="decode workers (--kv-role consumer)")
    la.add_argument("--host", default="127.0.0.1", help="the router's address")
    la.add_argument("--port", type=int, default=8000, help="the router's port")
    la.add_argument("--worker-port", type=int, default=None,
                    help="the first worker's port, the others follow (default: --port + 1)")
    la.add_argument("--router-policy", default="cache_aware",
                    choices=["cache_aware", "round_robin", "power_of_two", "random",
                             "consistent_hash"])
    la.add_argument("--threads-per-worker", type=int, default=None,
                    help="compute threads of each worker (default: cores / workers)")
    la.add_argument("serve_args", nargs=argparse.REMAINDER,
                    help="-- then the options of every `kvserve serve` (--model DIR ...)")
    la.set_defaults(func=_launch)
    c = sub.add_parser("convert", help="write another format's checkpoint as a Hugging Face dir")
    add_llama2c_parser(c.add_subparsers(dest="format", required=True))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        launched = torchrun_rank()
        if launched is not None and launched[0] > 0:
            # A torchrun rank > 0 of generate or serve: the engine's worker, not the command.
            if not hasattr(args, "tensor_parallel_size"):
                raise ValueError("under torchrun, only generate, serve and eval-ppl run on "
                                 "several ranks")
            from kvserve.tensor_parallel import run_torchrun_worker

            sys.exit(run_torchrun_worker(EngineArgs.from_cli_args(
                args, model=getattr(args, "model", None) or _default_model(),
                log_memory_plan=False)))
        sys.exit(args.func(args))
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        sys.exit(2)
