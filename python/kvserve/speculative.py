"""Speculative decoding options of ``EngineArgs``: a draft model directory or n-gram prompt
lookup, checked at start-up against the target (vocabulary, tokenizer, context length).

The drafting and the rejection sampling run in C++ (``_C.SpeculativeDecoder`` inside the engine
step); this module only turns the options into a ``_C.SpeculativeConfig`` and loads the
draft checkpoint."""

from __future__ import annotations

from pathlib import Path

from kvserve import _C
from kvserve.config import load_checkpoint_info
from kvserve.tokenizer import Tokenizer

# Defaults when the options are not given: k draft tokens per sequence, shrunk per step to
# DEFAULT_MAX_VERIFY_TOKENS / running - 1 (so a step verifies at most that many tokens, and
# speculation stops from that many running sequences on), never paused by a plain batch-size
# threshold. benchmarks/bench_speculative.py: on a 2-core CPU a 46M fp32 model's forward stays
# memory-bound up to about 8 tokens; beyond, verifying k + 1 tokens per sequence costs more
# than the accepted drafts save.
DEFAULT_NUM_SPECULATIVE_TOKENS = 2
# An EAGLE-3 head drafts for less (one layer on the target's streams) and is accepted further:
# on the stdlib pair at batch 1, k = 3 gave 1.72x against k = 2's 1.67x (fp32 head) and 1.95x
# against 1.72x (int8 head, 5 interleaved repeats); with a self-distilled int4 head, k = 4 gave
# 2.70x / 2.43x against k = 3's 2.35x / 2.21x (jemalloc) and 1.89x / 2.02x against 1.93x / 1.97x
# (glibc), about what k = 5..8 gave, with fewer drafts wasted where a head is accepted less.
# A draft model: k = 3 beat k = 2 at batch 1 in each table of the stdlib pair (fp32 draft 1.50x
# against 1.33x, int8 1.63x against 1.61x, int4 1.66x / 1.70x against 1.54x / 1.51x under glibc
# / jemalloc); k = 4 and beyond beat k = 3 only under jemalloc. N-gram lookup keeps 2 (copy prompts:
# 1.62x against k = 4's 1.40x).
DEFAULT_NUM_SPECULATIVE_TOKENS_BY_METHOD = {"draft_model": 3, "eagle3": 4}
DEFAULT_MAX_VERIFY_TOKENS = 8
DEFAULT_DISABLE_BATCH_SIZE = 0
# Methods whose drafter the target checkpoint itself holds (the engine passes it to C++ in the
# draft model's place): multi-token prediction (kvserve.loader.mtp_weights).
TARGET_DRAFTS = ("mtp",)


def default_num_speculative_tokens(method: str) -> int:
    """Draft tokens per sequence when num_speculative_tokens is not given."""
    return DEFAULT_NUM_SPECULATIVE_TOKENS_BY_METHOD.get(method, DEFAULT_NUM_SPECULATIVE_TOKENS)


def speculative_config(args) -> _C.SpeculativeConfig:
    """The engine's SpeculativeConfig from an EngineArgs; method "" (off) when neither
    speculative_model nor speculative_method is given. Raises ValueError for contradictory
    options (the C++ SpeculativeDecoder checks the ranges)."""
    from kvserve.engine_args import SPECULATIVE_METHODS

    method = args.speculative_method
    if args.speculative_model is not None:
        if method is None:
            method = "draft_model"
        elif not SPECULATIVE_METHODS[method] or method in TARGET_DRAFTS:
            raise ValueError(f"speculative_model is a draft model: it cannot be used with "
                             f'speculative_method="{method}"')
    elif method is not None and SPECULATIVE_METHODS[method] and method not in TARGET_DRAFTS:
        raise ValueError(f'speculative_method="{method}" needs speculative_model=DIR')
    if args.speculative_quantization is not None and args.speculative_model is None:
        raise ValueError("speculative_quantization rounds a draft model or an EAGLE-3 head: it "
                         "needs speculative_model=DIR")
    if method is None:
        if args.num_speculative_tokens is not None:
            raise ValueError("num_speculative_tokens needs speculative_model or "
                             'speculative_method="ngram"')
        return _C.SpeculativeConfig()

    def given(value, default):
        return default if value is None else value

    return _C.SpeculativeConfig(
        method=method,
        num_speculative_tokens=given(args.num_speculative_tokens,
                                     default_num_speculative_tokens(method)),
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        disable_batch_size=given(args.speculative_disable_batch_size, DEFAULT_DISABLE_BATCH_SIZE),
        max_verify_tokens=given(args.speculative_max_verify_tokens, DEFAULT_MAX_VERIFY_TOKENS))


def load_draft_info(draft_dir: str | Path, target_config, target_tokenizer: Tokenizer | None):
    """The draft checkpoint's CheckpointInfo, after checking that it can draft for the target:
    the same vocabulary size and the same tokenizer (token strings and ids); its positions are
    checked with the engine's other options (resolve_engine_config). Raises ValueError /
    FileNotFoundError naming the mismatch."""
    info = load_checkpoint_info(draft_dir)
    if info.config.vocab_size != target_config.vocab_size:
        raise ValueError(f"the draft model {draft_dir} has a vocabulary of "
                         f"{info.config.vocab_size} tokens; the target's has "
                         f"{target_config.vocab_size}: a draft must share the target's tokenizer")
    draft_tokenizer = Tokenizer.from_model_dir(draft_dir)
    if (draft_tokenizer is None) != (target_tokenizer is None):
        which = "the draft" if draft_tokenizer is None else "the target"
        raise ValueError(f"{which} has no tokenizer.json, so the draft model {draft_dir} cannot "
                         "be checked against the target's tokenizer")
    if draft_tokenizer is not None and draft_tokenizer.vocab() != target_tokenizer.vocab():
        target_vocab, draft_vocab = target_tokenizer.vocab(), draft_tokenizer.vocab()
        differ = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])
        raise ValueError(f"the draft model {draft_dir} has another tokenizer than the target "
                         f"({len(differ)} token/id pairs differ, e.g. {differ[0]!r}): a draft "
                         "must share the target's tokenizer")
    return info


def quantize_drafter(weights: dict, config: _C.ModelConfig, scheme: str, path) -> None:
    """speculative_quantization: the drafter's projections and LM head (2-D `*_proj.weight`,
    `fc.weight`, `lm_head.weight`; not its embedding, norms or routed experts) rounded in place
    to `scheme` ("int8": symmetric, per output channel, quantize_int8; "int4": asymmetric per
    group of 128 inputs, or 64 or 32 where 128 does not divide them, quantize_int4; a
    projection none of them divides stays as it is), and config's scheme set so that its layers
    read them (their inputs as quantized_activation says: set it after). The drafter's tokens
    only propose; verification keeps the output the target's. Raises ValueError for a drafter
    whose checkpoint is quantized already."""
    from kvserve.quantization import quantize_int4, quantize_int8

    if config.quantization.scheme != "none":
        raise ValueError(f"speculative_quantization: {path} is quantized already "
                         f"({config.quantization.scheme})")
    names = [n for n, t in weights.items() if t.dim() == 2 and "experts" not in n and (
        n.endswith("_proj.weight") or n in ("fc.weight", "lm_head.weight"))]
    for name in names:
        k = weights[name].shape[1]
        if scheme == "int8":
            q = quantize_int8(weights.pop(name))
        else:
            group = next((g for g in (128, 64, 32) if k % g == 0), None)
            if group is None:
                continue
            q = quantize_int4(weights.pop(name), group)
        module = name[:-len(".weight")]
        weights[module + ".qweight"], weights[module + ".scales"] = q.qweight, q.scales
        if q.zeros is not None:
            weights[module + ".zeros"] = q.zeros
    quantization = config.quantization
    quantization.scheme = scheme
    config.quantization = quantization
