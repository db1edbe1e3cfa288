"""Train a small Hugging Face Llama on a text file, on the CPU, from scratch.

    python scripts/train_tiny.py --out models/shakespeare-target --preset target
    python scripts/train_tiny.py --out models/shakespeare-draft --preset draft \
        --tokenizer models/shakespeare-target
    python scripts/train_tiny.py --out /tmp/stdlib-target --preset stdlib-target --corpus stdlib
    python scripts/train_tiny.py --out /tmp/mla --preset target --attention mla

--attention picks the attention of the same shape (notebooks/02_attention_variants.ipynb compares
them): mha, gqa (4 query heads per KV head), mqa (one KV head) as a Llama; sliding (every layer
attends over the last --sliding-window positions; a Mistral) and hybrid (one global layer in
--global-every, the others sliding; a Qwen2 with layer_types, whose q/k/v projections carry
biases) on --num-key-value-heads, else 4:1; mla (a dense DeepSeek-V2: keys and values from one
latent of --kv-lora-rank plus a --rope-head-dim shared RoPE key per token); ssm (a Mamba2
mixer in place of attention in every layer, the MLP kept: a Granite 4 hybrid without attention
layers; heads of --ssm-head-dim, --ssm-state states) and ssm-hybrid (the same with GQA 4:1 RoPE
attention in one layer of --global-every). --kv-sharing adds cross-layer KV sharing to mha / gqa
/ mqa.

--corpus stdlib trains on the Python standard library's own sources (every .py file of the
running interpreter's stdlib, sorted by path and concatenated: ~30 MB that every machine has),
written once to ~/.cache/kvserve/. --max-minutes fits the step count to a time budget (the
learning-rate schedule shrinks with it).

The corpus (default: tinyshakespeare/input.txt in $KVSERVE_SHARED_DATA, else in ../shared/data
beside the checkout) is split by characters: the first 90% trains, the last 10% validates. A
byte-level BPE tokenizer is trained on the training part with the `tokenizers` library unless
--tokenizer names a directory whose tokenizer.json to reuse (a draft model must share its target's
tokenizer). Every training sequence is BOS followed by a random window of the corpus, so that
generation from "<s> prompt" starts in a familiar state.

Writes a standard Hugging Face directory (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json) plus train_log.csv (step, tokens, train and validation loss,
learning rate, elapsed seconds) and training.json (the command, the split, steps, wall time, final
losses), which scripts/write_model_card.py turns into the model card.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from kvserve import training

REPO = Path(__file__).resolve().parents[1]
# The shared data folder: $KVSERVE_SHARED_DATA, else ../shared/data beside the checkout (the
# rule of tests/conftest.py's shared_data_dir).
SHARED_DATA = Path(os.environ.get("KVSERVE_SHARED_DATA") or REPO.parent / "shared" / "data")
DEFAULT_CORPUS = SHARED_DATA / "tinyshakespeare" / "input.txt"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2

# Shapes of the shipped models. The target is the largest that reaches its best validation loss
# within 30 minutes on a 2-core CPU; the draft is ~10x smaller for speculative decoding. The
# stdlib pair is the speculative-decoding benchmark's (scripts/build_speculative_pair.sh): a
# ~46M-parameter target whose decode step is dominated by reading its weights, and a ~4M draft.
ATTENTION_KINDS = ["mha", "gqa", "mqa", "sliding", "hybrid", "mla", "ssm", "ssm-hybrid"]

PRESETS = {
    "target": dict(hidden_size=320, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=2, intermediate_size=864, steps=700, batch_size=8,
                   lr=1.5e-3, dropout=0.1),
    "draft": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=344, steps=1500, batch_size=8,
                  lr=3e-3, dropout=0.0),
    "stdlib-target": dict(hidden_size=640, num_hidden_layers=10, num_attention_heads=10,
                          num_key_value_heads=2, intermediate_size=1728, steps=100000,
                          batch_size=8, lr=1e-3, dropout=0.0),
    "stdlib-draft": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=688, steps=100000,
                         batch_size=8, lr=2e-3, dropout=0.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output model directory")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="reuse this directory's tokenizer.json instead of training one")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model shape and schedule; explicit flags override it")
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-hidden-layers", type=int)
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--num-key-value-heads", type=int)
    p.add_argument("--intermediate-size", type=int)
    p.add_argument("--head-dim", type=int, default=None,
                   help="width of each attention head (default: hidden size / heads), e.g. a "
                        "pruned model's shape")
    p.add_argument("--kv-sharing", default=None,
                   help="cross-layer KV sharing (kvserve's kv_sharing extension): N to let each "
                        "run of N consecutive layers attend over its first layer's K/V (CLA "
                        "factor N), or an explicit map such as 1:0,3:2 (layer:source)")
    p.add_argument("--attention", choices=ATTENTION_KINDS, default=None,
                   help="the attention design (see above); default: a Llama with the given "
                        "--num-key-value-heads")
    p.add_argument("--sliding-window", type=int, default=128,
                   help="sliding / hybrid: positions a local layer attends to")
    p.add_argument("--global-every", type=int, default=3,
                   help="hybrid: layers i with (i + 1) %% N == 0 are global")
    p.add_argument("--kv-lora-rank", type=int, default=None,
                   help="mla: latent size (default: a quarter of the query width)")
    p.add_argument("--rope-head-dim", type=int, default=16,
                   help="mla: the RoPE part of each query / key head")
    p.add_argument("--ssm-head-dim", type=int, default=48,
                   help="ssm / ssm-hybrid: the width of a mixer head (2 x hidden / it heads)")
    p.add_argument("--ssm-state", type=int, default=32,
                   help="ssm / ssm-hybrid: states per head and position of the selective scan")
    p.add_argument("--seq-len", type=int, default=512, help="training context (tokens, BOS included)")
    p.add_argument("--max-position-embeddings", type=int, default=1024,
                   help="the context the config declares (RoPE has no learned positions; text "
                        "quality degrades past the training context)")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=None,
                   help="training-only dropout on every attention and MLP output (the saved "
                        "model is a plain Llama)")
    p.add_argument("--eval-every", type=int, default=150)
    p.add_argument("--eval-batches", type=int, default=0,
                   help="batches of windows to score per evaluation, and for the final train "
                        "loss (0 = the whole split)")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the dtype of the saved weights (bfloat16 halves a shipped model)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="matmul precision: bf16 autocast (fp32 master weights; ~1.4x faster on "
                        "CPUs with AVX512-BF16) or plain fp32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="fit the number of steps to this wall-clock budget (measured after the "
                        "first steps)")
    args = p.parse_args(argv)
    preset = PRESETS.get(args.preset, {})
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dropout is None:
        args.dropout = 0.0
    heads = args.num_attention_heads
    if args.attention == "mha":
        args.num_key_value_heads = heads
    elif args.attention == "mqa":
        args.num_key_value_heads = 1
    elif args.attention == "gqa" or (
            args.attention in ("sliding", "hybrid", "ssm", "ssm-hybrid")
            and args.num_key_value_heads is None):
        args.num_key_value_heads = max(1, heads // 4) if heads else None
    elif args.attention == "mla" and args.num_key_value_heads is None:
        args.num_key_value_heads = heads  # unused: MLA has no KV heads of its own
    try:
        args.kv_sharing = parse_kv_sharing(args.kv_sharing, args.num_hidden_layers)
    except ValueError as e:
        p.error(f"--kv-sharing: {e}")
    if args.kv_sharing and args.attention not in (None, "mha", "gqa", "mqa"):
        p.error("--kv-sharing works on mha, gqa and mqa attention")
    missing = [k for k in PRESETS["target"] if getattr(args, k) is None]
    if missing:
        p.error("without --preset, give " + ", ".join("--" + k.replace("_", "-") for k in missing))
    return args


def parse_kv_sharing(spec: str | None, num_layers: int | None) -> dict[int, int]:
    """{layer: source} from "N" (runs of N layers share their first layer's K/V) or "l:s,...";
    {} for None."""
    if not spec:
        return {}
    if spec.isdigit():
        factor = int(spec)
        if factor < 1 or num_layers is None:
            raise ValueError(f"a factor must be >= 1 (with a layer count), got {spec!r}")
        return {layer: layer - layer % factor for layer in range(num_layers) if layer % factor}
    try:
        pairs = [item.split(":") for item in spec.split(",")]
        return {int(layer): int(source) for layer, source in pairs}
    except ValueError:
        raise ValueError(f"expected N or layer:source,... got {spec!r}") from None


def stdlib_corpus() -> Path:
    """The Python standard library's .py sources (site-packages excluded), sorted by path and
    concatenated, each file after a '# file: <relative path>' line; cached per Python version."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out = Path.home() / ".cache" / "kvserve" / f"python{sys.version_info[0]}.{sys.version_info[1]}-stdlib.txt"
    if not out.is_file():
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
        parts = []
        for f in files:
            try:
                parts.append(f"# file: {f.relative_to(root)}\n" + f.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(parts), encoding="utf-8")
    return out


def read_split(corpus: Path) -> tuple[str, str]:
    """The corpus split 90/10 (kvserve.training.read_split), or exit naming where it should be."""
    try:
        return training.read_split(corpus)
    except FileNotFoundError:
        raise SystemExit(f"corpus {corpus} not found (the shared data lives in ../shared/data "
                         "beside the checkout, or where KVSERVE_SHARED_DATA points)") from None


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE: any text encodes (no unknown tokens) and decodes back exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return tok


def load_or_train_tokenizer(args: argparse.Namespace, train_text: str):
    from tokenizers import Tokenizer

    if args.tokenizer is None:
        return train_tokenizer(train_text, args.vocab_size)
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise SystemExit(f"{args.tokenizer}: expected {name} at id {i}")
    return tok


def encode(tok, text: str) -> torch.Tensor:
    return torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)


def make_config(args: argparse.Namespace, vocab_size: int):
    """A Llama of the given shape, or the architecture that has --attention's design."""
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        max_position_embeddings=args.max_position_embeddings, rms_norm_eps=1e-5,
        initializer_range=0.02, tie_word_embeddings=True, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID)
    layers = args.num_hidden_layers
    head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
    if args.attention == "sliding":
        config = transformers.MistralConfig(**common, sliding_window=args.sliding_window,
                                            head_dim=head_dim)
    elif args.attention == "hybrid":
        kinds = ["full_attention" if (i + 1) % args.global_every == 0 else "sliding_attention"
                 for i in range(layers)]
        config = transformers.Qwen2Config(**common, use_sliding_window=True,
                                          sliding_window=args.sliding_window,
                                          max_window_layers=0, layer_types=kinds)
    elif args.attention == "mla":
        rope = args.rope_head_dim
        config = transformers.DeepseekV2Config(
            **common, first_k_dense_replace=layers, n_routed_experts=1, num_experts_per_tok=1,
            q_lora_rank=None, kv_lora_rank=args.kv_lora_rank or args.hidden_size // 4,
            qk_rope_head_dim=rope, qk_nope_head_dim=head_dim - rope, v_head_dim=head_dim)
    elif args.attention in ("ssm", "ssm-hybrid"):
        attends = args.attention == "ssm-hybrid"
        kinds = ["attention" if attends and (i + 1) % args.global_every == 0 else "mamba"
                 for i in range(layers)]
        inner = 2 * args.hidden_size
        config = transformers.GraniteMoeHybridConfig(
            **{**common, "intermediate_size": args.intermediate_size},
            shared_intermediate_size=args.intermediate_size, num_local_experts=0,
            layer_types=kinds, position_embedding_type="rope",
            mamba_n_heads=inner // args.ssm_head_dim, mamba_d_head=args.ssm_head_dim,
            mamba_expand=2, mamba_n_groups=1, mamba_d_state=args.ssm_state, mamba_d_conv=4,
            mamba_chunk_size=64, embedding_multiplier=1.0, residual_multiplier=1.0,
            logits_scaling=1.0, attention_multiplier=head_dim ** -0.5)
    else:
        config = transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False,
                                          head_dim=head_dim)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    if args.kv_sharing:
        config.kv_sharing = {str(layer): source for layer, source in args.kv_sharing.items()}
    return config


def add_residual_dropout(model, p: float) -> None:
    """Dropout on each attention and MLP block's output before it joins the residual stream (as
    in GPT-2 / nanoGPT), as forward hooks: active in train() mode only, and nothing of it is
    saved, so the checkpoint stays a standard Llama."""
    if p <= 0:
        return

    def hook(module, inputs, output):
        if not module.training:
            return output
        if isinstance(output, tuple):
            return (torch.nn.functional.dropout(output[0], p, True),) + output[1:]
        return torch.nn.functional.dropout(output, p, True)

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def save(model, tok, out: Path, dtype: str = "float32") -> None:
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    model.to(getattr(torch, dtype)).save_pretrained(out)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, do_sample=True, temperature=0.8,
                     top_k=50).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))  # keep our post-processor (BOS) byte-for-byte
    # The portable class name (transformers 4 and 5 both map it to the tokenizers backend).
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_path.write_text(json.dumps(tok_config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    started = time.monotonic()
    if str(args.corpus) == "stdlib":
        args.corpus = stdlib_corpus()

    train_text, val_text = read_split(args.corpus)
    tok = load_or_train_tokenizer(args, train_text)
    train_ids, val_ids = encode(tok, train_text), encode(tok, val_text)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = make_config(args, vocab_size)
    if args.kv_sharing:  # layers that attend over an earlier layer's K/V (kvserve.testing.cla)
        from kvserve.testing.cla import cla_llama
        model = cla_llama(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    add_residual_dropout(model, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"corpus {args.corpus}: {len(train_text):,} train / {len(val_text):,} validation chars, "
          f"{len(train_ids):,} / {len(val_ids):,} tokens (vocab {vocab_size}); "
          f"model {n_params / 1e6:.2f}M parameters", file=sys.stderr)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    val_windows = training.validation_windows(val_ids, args.seq_len, BOS_ID)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "train_log.csv"
    tokens_per_step = args.batch_size * (args.seq_len - 1)
    train_loss = val_loss = float("nan")
    model.train()
    training_started = time.monotonic()
    with open(log_path, "w", newline="") as log_file, \
            tqdm(range(args.steps), desc="train", unit="step", file=sys.stderr) as bar:
        log = csv.writer(log_file)
        log.writerow(["step", "tokens", "train_loss", "val_loss", "lr", "elapsed_s"])
        running = None
        best = (float("inf"), 0, None)  # validation loss, step, weights
        for step in bar:
            lr = training.schedule(optimizer, step, args.lr, args.steps, args.warmup_steps,
                                   args.min_lr_ratio)
            batch = training.sample_batch(train_ids, args.batch_size, args.seq_len, gen, BOS_ID)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss = model(batch, labels=batch, use_cache=False).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            train_loss = loss.item()
            running = train_loss if running is None else 0.95 * running + 0.05 * train_loss
            if args.max_minutes and step + 1 == 5:  # the schedule fits the time budget
                per_step = (time.monotonic() - training_started) / 5
                budget = args.max_minutes * 60 - (training_started - started)
                args.steps = max(6, min(args.steps, int(budget / (per_step * 1.05))))
                args.warmup_steps = min(args.warmup_steps, args.steps // 10)
                bar.total = args.steps
            if step + 1 > args.steps:
                break
            last = step + 1 == args.steps
            if (step + 1) % args.eval_every == 0 or last:
                val_loss = training.evaluate(model, val_windows, args.eval_batches,
                                             args.batch_size)
                if val_loss < best[0]:
                    best = (val_loss, step + 1, copy.deepcopy(model.state_dict()))
            bar.set_postfix(loss=f"{running:.3f}", val=f"{val_loss:.3f}", lr=f"{lr:.1e}")
            log.writerow([step + 1, (step + 1) * tokens_per_step, f"{train_loss:.4f}",
                          f"{val_loss:.4f}" if (step + 1) % args.eval_every == 0 or last else "",
                          f"{lr:.3e}", f"{time.monotonic() - started:.1f}"])
            log_file.flush()
            if last:
                break
    # Early stopping: the small corpus is seen many times over, so keep the weights with the best
    # validation loss.
    val_loss, best_step, state = best
    model.load_state_dict(state)
    final_train = training.evaluate(
        model, training.validation_windows(train_ids[-len(val_ids):], args.seq_len, BOS_ID),
        args.eval_batches, args.batch_size)
    wall = time.monotonic() - started
    save(model, tok, args.out, args.save_dtype)
    summary = {
        "command": "python " + " ".join(shlex.quote(a) for a in
                                        ["scripts/train_tiny.py", *(argv or sys.argv[1:])]),
        "corpus": os.path.relpath(args.corpus.resolve(), REPO),
        "train_chars": len(train_text), "validation_chars": len(val_text),
        "train_tokens": len(train_ids), "validation_tokens": len(val_ids),
        "vocab_size": vocab_size, "parameters": n_params, "steps": args.steps,
        "best_step": best_step, "batch_size": args.batch_size, "precision": args.precision,
        "dropout": args.dropout, "seq_len": args.seq_len, "attention": args.attention,
        "save_dtype": args.save_dtype,
        "tokens_seen": args.steps * tokens_per_step, "lr": args.lr, "seed": args.seed,
        "threads": torch.get_num_threads(), "wall_time_s": round(wall, 1),
        "final_train_loss": round(final_train, 4), "final_validation_loss": round(val_loss, 4),
    }
    (args.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"done in {wall / 60:.1f} min: kept step {best_step}: train loss {final_train:.3f} "
          f"(last 10%-sized slice of the training split), validation loss {val_loss:.3f} "
          f"-> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
