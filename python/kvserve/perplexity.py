"""Perplexity of a text under a model, computed with kvserve's runtime.

Texts longer than the context are scored in strided windows, the method of the Hugging Face
perplexity guide: each window holds up to `max_length` tokens; only the tokens that the previous
window did not score count, and the rest of the window is their context. Every token but the
first is scored exactly once, with at least `max_length - stride` tokens of context (or all that
precede it). The stride is below `max_length`: disjoint windows would leave the first token of
each window unscored.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from kvserve import _C


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float             # mean negative log-likelihood per scored token (nats)
    num_tokens: int        # tokens scored (every token but the first)
    num_windows: int
    max_length: int
    stride: int
    seconds: float


def strided_windows(num_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) per window; positions first_scored..end-1 are scored.

    Every position 1..num_tokens-1 is scored exactly once (position 0 has no context)."""
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    if not 1 <= stride < max_length:
        raise ValueError(f"stride must be in [1, max_length={max_length}), got {stride}")
    windows, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        first = max(prev_end, 1)
        windows.append((begin, end, first))
        prev_end = end
        if end == num_tokens:
            break
    return windows


def evaluate_perplexity(model: _C.CausalLM, token_ids: list[int], max_length: int,
                        stride: int | None = None,
                        kv_cache_dtype: torch.dtype | None = None) -> PerplexityResult:
    """Scores token_ids (BOS included, if the model expects one) with `model`.

    max_length: tokens per window, at most the model's context.
    stride: window step (default max_length // 2).
    kv_cache_dtype: torch.int8 / torch.float8_e4m3fn to attend over keys and values quantized
        as LLM(kv_cache_dtype=...) caches them (default: the model's dtype).
    """
    if len(token_ids) < 2:
        raise ValueError(f"need at least 2 tokens to score, got {len(token_ids)}")
    vocab = model.config.vocab_size
    if min(token_ids) < 0 or max(token_ids) >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab})")
    stride = max(1, max_length // 2) if stride is None else stride
    windows = strided_windows(len(token_ids), max_length, stride)
    caches = _C.KVCache.for_model(1, max_length, model.config, kv_cache_dtype or model.dtype,
                                  model.device)
    ids = torch.tensor(token_ids, dtype=torch.long)
    started = time.perf_counter()
    total_nll, scored = 0.0, 0
    for begin, end, first in windows:
        for cache in caches:
            cache.reset()
        logits = model(ids[begin:end].unsqueeze(0), caches)[0]  # [end - begin, vocab], fp32
        # The logit at position p predicts token p + 1.
        predicting = logits[first - 1 - begin:end - 1 - begin]
        targets = ids[first:end]
        log_probs = torch.log_softmax(predicting.double(), dim=-1)
        total_nll -= log_probs.gather(1, targets.unsqueeze(1)).sum().item()
        scored += end - first
    nll = total_nll / scored
    return PerplexityResult(math.exp(nll), nll, scored, len(windows), max_length, stride,
                            time.perf_counter() - started)
