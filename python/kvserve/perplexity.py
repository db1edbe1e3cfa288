"""Perplexity of a text under a model, computed with kvserve's runtime.

The engine scores the text as it serves it (every window a request for its prompt's logprobs),
so the figure covers its KV cache format, batching and tensor parallelism. Texts longer than the
context are scored in strided windows, the method of the Hugging Face perplexity guide: each
window holds up to `max_length` tokens; only the tokens that the previous window did not score
count, and the rest of the window is their context. Every token but the
first is scored exactly once, with at least `max_length - stride` tokens of context (or all that
precede it). The stride is below `max_length`: disjoint windows would leave the first token of
each window unscored.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.llm import LLM

# Windows submitted to the engine together (it batches up to its max_num_seqs of them).
WINDOWS_PER_BATCH = 64


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


def evaluate_perplexity(llm: LLM, token_ids: list[int], max_length: int | None = None,
                        stride: int | None = None) -> PerplexityResult:
    """Scores token_ids (BOS included, if the model expects one) with `llm`'s engine, as it
    serves: each window is a request that asks for its prompt's logprobs
    (SamplingParams.prompt_logprobs), run in batches through the scheduler, the KV cache (of the
    LLM's kv_cache_dtype) and every rank of a tensor-parallel model.

    max_length: tokens per window, at most max_model_len - 1 (the default): each request keeps
        room for the one token it samples.
    stride: window step (default max_length // 2).
    """
    if len(token_ids) < 2:
        raise ValueError(f"need at least 2 tokens to score, got {len(token_ids)}")
    vocab = llm.config.vocab_size
    if min(token_ids) < 0 or max(token_ids) >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab})")
    limit = llm.max_model_len - 1
    max_length = limit if max_length is None else max_length
    if max_length > limit:
        raise ValueError(f"max_length must be at most {limit} (max_model_len - 1: each window's "
                         f"request samples one token), got {max_length}")
    stride = max(1, max_length // 2) if stride is None else stride
    windows = strided_windows(len(token_ids), max_length, stride)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    started = time.perf_counter()
    total_nll, scored = 0.0, 0
    # A batch of windows at a time: their entries are all that is held at once.
    for batch in range(0, len(windows), WINDOWS_PER_BATCH):
        part = windows[batch:batch + WINDOWS_PER_BATCH]
        outputs = llm.generate([token_ids[begin:end] for begin, end, _ in part], params,
                               use_tqdm=False)
        for (begin, end, first), out in zip(part, outputs):
            if out.error is not None:
                raise RuntimeError(f"scoring tokens {begin}..{end - 1} failed: {out.error}")
            # Entry p of a window's prompt logprobs is its token p under the tokens before it.
            entries = out.prompt_logprobs[first - begin:end - begin]
            total_nll -= math.fsum(entry.logprob for entry in entries)
            scored += end - first
    nll = total_nll / scored
    return PerplexityResult(math.exp(nll), nll, scored, len(windows), max_length, stride,
                            time.perf_counter() - started)
