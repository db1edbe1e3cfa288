"""Speculative decoding options of ``LLM`` / ``LLMEngine``: a draft model directory or n-gram
prompt lookup, checked at start-up against the target (vocabulary, tokenizer, context length).

The drafting and the rejection sampling run in C++ (``_C.SpeculativeDecoder`` inside the engine
step); this module only turns the keyword arguments into a ``_C.SpeculativeConfig`` and loads the
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
DEFAULT_MAX_VERIFY_TOKENS = 8
DEFAULT_DISABLE_BATCH_SIZE = 0


def speculative_config(speculative_model, speculative_method, num_speculative_tokens,
                       prompt_lookup_min, prompt_lookup_max, disable_batch_size,
                       max_verify_tokens=None) -> _C.SpeculativeConfig:
    """The engine's SpeculativeConfig; method "" (off) when neither option is given.
    Raises ValueError for contradictory or out-of-range options."""
    if speculative_method is not None and speculative_method not in ("ngram", "draft_model"):
        raise ValueError(f'speculative_method must be "ngram" or "draft_model", '
                         f"got {speculative_method!r}")
    if speculative_model is not None:
        if speculative_method not in (None, "draft_model"):
            raise ValueError(f"speculative_model is a draft model: it cannot be used with "
                             f'speculative_method="{speculative_method}"')
        speculative_method = "draft_model"
    elif speculative_method == "draft_model":
        raise ValueError('speculative_method="draft_model" needs speculative_model=DIR')
    if speculative_method is None:
        if num_speculative_tokens is not None:
            raise ValueError("num_speculative_tokens needs speculative_model or "
                             'speculative_method="ngram"')
        return _C.SpeculativeConfig()
    k = DEFAULT_NUM_SPECULATIVE_TOKENS if num_speculative_tokens is None else num_speculative_tokens
    if disable_batch_size is None:
        disable_batch_size = DEFAULT_DISABLE_BATCH_SIZE
    if max_verify_tokens is None:
        max_verify_tokens = DEFAULT_MAX_VERIFY_TOKENS
    for name, value in [("num_speculative_tokens", k), ("prompt_lookup_min", prompt_lookup_min),
                        ("prompt_lookup_max", prompt_lookup_max),
                        ("speculative_disable_batch_size", disable_batch_size),
                        ("speculative_max_verify_tokens", max_verify_tokens)]:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    return _C.SpeculativeConfig(method=speculative_method, num_speculative_tokens=k,
                                prompt_lookup_min=prompt_lookup_min,
                                prompt_lookup_max=prompt_lookup_max,
                                disable_batch_size=disable_batch_size,
                                max_verify_tokens=max_verify_tokens)


def load_draft_info(draft_dir: str | Path, target_config, target_tokenizer: Tokenizer | None,
                    max_model_len: int):
    """The draft checkpoint's CheckpointInfo, after checking that it can draft for the target:
    the same vocabulary size, the same tokenizer (token strings and ids), and at least
    max_model_len positions. Raises ValueError / FileNotFoundError naming the mismatch."""
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
    if info.config.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft model {draft_dir} handles "
                         f"{info.config.max_position_embeddings} positions, fewer than "
                         f"max_model_len {max_model_len}")
    return info
