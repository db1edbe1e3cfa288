"""Model-level references computed with Hugging Face transformers (the reference implementation):
perplexity over strided windows, and the greedy agreement of two models. Tests and the model-card
script compare kvserve against these. Needs the ``test`` extra."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_perplexity(model, ids: list[int], max_length: int, stride: int) -> float:
    """The Hugging Face perplexity guide's loop: labels outside the new part of each window are
    -100, and the model's own shifted cross-entropy averages the rest."""
    input_ids = torch.tensor([ids])
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        trg_len = end - prev_end
        window = input_ids[:, begin:end]
        labels = window.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(window, labels=labels, use_cache=False).loss
        valid = (labels[:, 1:] != -100).sum().item()
        nll_sum += loss.item() * valid
        n_tokens += valid
        prev_end = end
        if end == len(ids):
            break
    assert n_tokens == len(ids) - 1, "every token but the first is scored once"
    return math.exp(nll_sum / n_tokens)


def greedy_agreement(model_a, model_b, ids: list[int], window: int, bos_id: int) -> float:
    """Fraction of positions where both models' argmax next token agree, teacher-forced on `ids`
    cut into disjoint windows that each start with BOS (as the models were trained)."""
    agree = total = 0
    body = window - 1
    for begin in range(0, len(ids) - 1, body):
        chunk = torch.tensor([[bos_id] + ids[begin:begin + body]])
        with torch.no_grad():
            a = model_a(chunk, use_cache=False).logits.argmax(-1)
            b = model_b(chunk, use_cache=False).logits.argmax(-1)
        agree += (a == b).sum().item()
        total += a.numel()
    return agree / total
