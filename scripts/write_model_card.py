"""Measure a model trained by scripts/train_tiny.py and write its model card (README.md).

    python scripts/write_model_card.py --model models/shakespeare-target
    python scripts/write_model_card.py --model models/shakespeare-draft --target models/shakespeare-target

Measures, on the validation split that training held out: perplexity by transformers and by
kvserve (the same strided windows), the draft's greedy agreement with its target, the KV-cache
bytes per token, and a sample from kvserve. Reads the training facts from training.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import kvserve
from kvserve.perplexity import evaluate_perplexity
from kvserve.testing.cla import load_cla_llama
from kvserve.testing.hf_reference import greedy_agreement, hf_perplexity, load_hf_model
from train_tiny import BOS_ID, DEFAULT_CORPUS, REPO, read_split

SAMPLE_PROMPT = "ROMEO:\n"


def kv_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """Bytes the paged KV pool holds per token of context, by kvserve's own layout (K/V heads of
    the layers that own a cache, or MLA's latent)."""
    layout = kvserve._C.KVCacheLayout.for_model(model_config)
    return kvserve._C.PagedKVCache.bytes_per_block(layout, 1, dtype)


def attention_row(c, training: dict) -> str:
    """The attention design in words."""
    head_dim = c.hidden_size // c.num_attention_heads
    kind = training.get("attention")
    if kind == "mla":
        return (f"multi-head latent attention: {c.num_attention_heads} query heads; keys and "
                f"values from one {c.kv_lora_rank}-wide latent + a {c.qk_rope_head_dim}-wide "
                f"RoPE key per token (nope {c.qk_nope_head_dim}, value {c.v_head_dim} per head)")
    kv = c.num_key_value_heads
    heads = (f"{c.num_attention_heads} query heads, {kv} KV head{'s' if kv > 1 else ''} "
             + ("(MHA)" if kv == c.num_attention_heads else "(MQA)" if kv == 1
                else f"(GQA {c.num_attention_heads // kv}:1)") + f", head dim {head_dim}")
    if kind == "sliding":
        heads += f"; every layer sees the last {c.sliding_window} positions"
    elif kind == "hybrid":
        local = sum(t == "sliding_attention" for t in c.layer_types)
        heads += (f"; {local} of {len(c.layer_types)} layers see the last {c.sliding_window} "
                  f"positions, the others all (`layer_types`)")
    if getattr(c, "kv_sharing", None):
        heads += f"; cross-layer KV sharing {c.kv_sharing} (layer: the layer whose KV it reads)"
    if kind in ("ssm", "ssm-hybrid"):
        # transformers 5 names Granite's layer kinds linear_attention / full_attention.
        mixers = sum(t in ("mamba", "linear_attention") for t in c.layer_types)
        ssm = (f"Mamba2 mixers instead in {mixers} of {len(c.layer_types)} layers "
               f"({c.mamba_n_heads} heads of {c.mamba_d_head}, {c.mamba_d_state} states, "
               f"convolution of {c.mamba_d_conv}; a fixed state per sequence)")
        return ssm if mixers == len(c.layer_types) else f"{heads} in the others; {ssm}"
    return heads


def measure(model_dir: Path, target_dir: Path | None, corpus: Path, max_tokens: int | None,
            prompt: str) -> dict:
    training = json.loads((model_dir / "training.json").read_text())
    _, val_text = read_split(corpus)
    llm = kvserve.LLM(model_dir, dtype="float32")
    ids = llm.tokenizer.encode(val_text)[:max_tokens]
    window = training["seq_len"]
    stride = window // 2
    ours = evaluate_perplexity(llm, ids, max_length=window, stride=stride)
    # transformers has no cross-layer KV sharing: its Llama with kvserve's CLA layers instead.
    cla = bool(json.loads((model_dir / "config.json").read_text()).get("kv_sharing"))
    hf = load_cla_llama(model_dir) if cla else load_hf_model(model_dir)
    theirs = hf_perplexity(hf, ids, window, stride)
    facts = dict(training=training, config=hf.config, cla=cla, val_tokens=ours.num_tokens,
                 window=window,
                 stride=stride, ppl_kvserve=ours.perplexity, ppl_hf=theirs,
                 state_bytes=llm.kv_cache.state_bytes_per_sequence,
                 kv_fp32=kv_bytes_per_token(llm.config, torch.float32),
                 kv_bf16=kv_bytes_per_token(llm.config, torch.bfloat16))
    if target_dir is not None:
        facts["target"] = target_dir.name
        facts["agreement"] = greedy_agreement(hf, load_hf_model(target_dir), ids[1:], window, BOS_ID)
    params = kvserve.SamplingParams(temperature=0.8, top_k=50, seed=0, max_tokens=96,
                                    ignore_eos=True)
    facts["sample"] = llm.generate([prompt], params)[0].outputs[0].text
    facts["prompt"] = prompt
    facts["corpus_name"] = ("the Python standard library's own sources" if "stdlib" in str(corpus)
                            else "Tiny Shakespeare")
    return facts


def render(name: str, f: dict) -> str:
    t, c = f["training"], f["config"]
    architecture = c.architectures[0]
    local = t.get("attention") in ("sliding", "hybrid")
    window_note = "; a sliding layer keeps at most its window" if local else ""
    cla_note = " (its Llama with the CLA layers of kvserve.testing.cla)" if f.get("cla") else ""
    if "target" in f:
        role = f"the speculative-decoding draft for `{f['target']}`"
    elif t.get("attention"):
        role = (f"the {t['attention']} member of a family of one shape and training budget that "
                f"differ only in attention (`scripts/train_attention_family.sh`)")
    else:
        role = "the default model of `make demo` and `python -m kvserve generate`"
    lines = [
        f"# {name}",
        "",
        f"A small {architecture.removesuffix('ForCausalLM')} trained from scratch on "
        f"{f['corpus_name']} by kvserve's own "
        f"`scripts/train_tiny.py`; {role}. It imitates its corpus, it does not make sense: it has "
        f"{t['parameters'] / 1e6:.2f}M parameters and saw {t['tokens_seen'] / 1e6:.1f}M tokens.",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        f"| class | `{architecture}` (Hugging Face format, "
        f"{'bf16' if t.get('save_dtype') == 'bfloat16' else 'fp32'} safetensors) |",
        f"| parameters | {t['parameters']:,} (embeddings tied with the output layer) |",
        f"| layers, hidden, MLP | {c.num_hidden_layers}, {c.hidden_size}, {c.intermediate_size} (SwiGLU) |",
        f"| attention | {attention_row(c, t)}"
        + ("" if t.get("attention") == "ssm" else
           f"; RoPE θ {int(c.rope_parameters['rope_theta'])}") + " |",
        f"| context | trained on {t['seq_len']}-token windows; the config allows "
        f"{c.max_position_embeddings} (RoPE has no learned positions, but text past "
        f"{t['seq_len']} tokens is out of distribution) |",
        f"| KV cache per token | {f['kv_fp32']:,} bytes in fp32, {f['kv_bf16']:,} in bf16 "
        f"(kvserve's paged pool{window_note}) |",
        *([f"| state per sequence | {f['state_bytes']:,} bytes (fp32 SSM state, conv state in "
           f"fp32), whatever the sequence's length |"] if f.get("state_bytes") else []),
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE, {t['vocab_size']:,} tokens (ids 0/1/2 = `<unk>`/`<s>`/`</s>`), trained "
        f"with the `tokenizers` library on the training split; every text encodes without unknown "
        f"tokens. The tokenizer prepends `<s>`. "
        + ("Every member of the family shares it." if t.get("attention")
           else "A target and its draft share it."),
        "",
        "## Training",
        "",
        f"- Corpus: `{t['corpus']}` ({f['corpus_name']}). Split by characters at a line boundary: "
        f"the first 90% trains ({t['train_chars']:,} chars, {t['train_tokens']:,} tokens), the last "
        f"10% validates ({t['validation_chars']:,} chars, {t['validation_tokens']:,} tokens).",
        f"- Each sequence is `<s>` + {t['seq_len'] - 1} tokens from a random offset; batch "
        f"{t['batch_size']}; AdamW (β 0.9/0.95, weight decay 0.1), peak learning rate {t['lr']}, "
        f"warm-up then cosine decay; "
        + ("bf16 autocast with fp32 weights; " if t["precision"] == "bf16" else "fp32; ")
        + (f"dropout {t['dropout']} on every attention and MLP output (training only); "
           if t.get("dropout") else "no dropout; ")
        + f"seed {t['seed']}; {t['threads']} CPU thread{'s' if t['threads'] > 1 else ''}.",
        f"- {t['steps']:,} steps in {t['wall_time_s'] / 60:.1f} minutes of wall time; the weights "
        f"kept are those of step {t['best_step']:,}, the best validation loss.",
        f"- Final loss (mean next-token cross entropy, nats): train {t['final_train_loss']:.3f} "
        f"(on a 10%-sized slice of the training split), validation {t['final_validation_loss']:.3f}."
        f" The per-step log is `train_log.csv`.",
        "",
        "## Evaluation",
        "",
        f"Validation perplexity over {f['val_tokens']:,} scored validation tokens, in strided "
        f"windows of {f['window']} tokens with stride {f['stride']}. kvserve's figure is what "
        f"this prints:",
        "",
        "```",
        f"tail -c {t['validation_chars']} {t['corpus']} > /tmp/validation.txt",
        f"python -m kvserve eval-ppl --model {f['dir']} --text /tmp/validation.txt "
        f"--max-length {f['window']} --stride {f['stride']}"
        + (f" --max-tokens {f['max_tokens']}" if f.get("max_tokens") else ""),
        "```",
        "",
        "| runtime | perplexity |",
        "|---|---|",
        f"| transformers{cla_note} | {f['ppl_hf']:.4f} |",
        f"| kvserve | {f['ppl_kvserve']:.4f} |",
        "",
        f"They differ by {abs(f['ppl_kvserve'] / f['ppl_hf'] - 1) * 100:.4f}%.",
    ]
    if "agreement" in f:
        lines += ["", f"Greedy agreement with `{f['target']}`: the two models' argmax next tokens "
                  f"agree at **{f['agreement'] * 100:.1f}%** of validation positions "
                  f"(teacher-forced, {f['window']}-token windows)."]
    lines += [
        "",
        "## Sample",
        "",
        f"kvserve, prompt `{f['prompt']!r}`, temperature 0.8, top-k 50, seed 0, 96 tokens:",
        "",
        "```",
        f["prompt"] + f["sample"],
        "```",
        "",
        "## Rebuild",
        "",
        "```",
        t["command"],
        f"python scripts/write_model_card.py --model {f['dir']}"
        + (f" --target {f['target_dir']}" if "target" in f else "")
        + (f" --corpus {f['corpus_arg']} --max-tokens {f['max_tokens']} --prompt {f['prompt']!r}"
           if f.get("max_tokens") else ""),
        "```",
        "",
        "Training is seeded (initialization and data order). Bit-identical weights also need the "
        "same CPU, thread count and library versions.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--target", type=Path, default=None, help="for a draft: its target model")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="score only the first N validation tokens (default: all)")
    p.add_argument("--prompt", default=SAMPLE_PROMPT, help="the sample's prompt")
    args = p.parse_args()
    torch.manual_seed(0)
    facts = measure(args.model, args.target, args.corpus, args.max_tokens, args.prompt)
    facts.update(dir=str(args.model), target_dir=str(args.target), max_tokens=args.max_tokens,
                 corpus_arg=str(args.corpus))
    card = render(args.model.resolve().name, facts)
    (args.model / "README.md").write_text(card)
    print(card)
    print(f"wrote {args.model / 'README.md'} (repo {REPO})", file=sys.stderr)


if __name__ == "__main__":
    main()
