"""What training from text needs, shared by scripts/train_tiny.py and `kvserve distill`: the
corpus split, batches of random windows, held-out windows, the learning-rate schedule and the
next-token loss over held-out windows."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def read_split(corpus: str | Path, validation_fraction: float = 0.1) -> tuple[str, str]:
    """The corpus text split by characters at a line boundary: the first 1 - validation_fraction
    trains, the rest validates."""
    corpus = Path(corpus)
    if not corpus.is_file():
        raise FileNotFoundError(f"corpus {corpus} not found")
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    text = corpus.read_text(encoding="utf-8")
    cut = text.rfind("\n", 0, int(len(text) * (1 - validation_fraction))) + 1
    return text[:cut], text[cut:]


def sample_batch(ids: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator,
                 bos_id: int) -> torch.Tensor:
    """[batch, seq_len]: BOS then seq_len - 1 consecutive corpus tokens from a random offset."""
    if len(ids) < seq_len:
        raise ValueError(f"the training text has {len(ids)} tokens, fewer than a window of "
                         f"{seq_len}")
    starts = torch.randint(0, len(ids) - seq_len + 1, (batch_size,), generator=gen)
    rows = torch.stack([ids[s:s + seq_len - 1] for s in starts.tolist()])
    bos = torch.full((batch_size, 1), bos_id, dtype=torch.long)
    return torch.cat([bos, rows], dim=1)


def validation_windows(ids: torch.Tensor, seq_len: int, bos_id: int) -> torch.Tensor:
    """Non-overlapping BOS-prefixed windows covering the validation split."""
    body = seq_len - 1
    n = (len(ids) - 1) // body
    if n == 0:
        raise ValueError(f"the validation text has {len(ids)} tokens, fewer than a window of "
                         f"{seq_len}")
    rows = ids[:n * body].view(n, body)
    return torch.cat([torch.full((n, 1), bos_id, dtype=torch.long), rows], dim=1)


def learning_rate(step: int, lr: float, steps: int, warmup_steps: int,
                  min_lr_ratio: float) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at `steps`."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    floor = lr * min_lr_ratio
    return floor + 0.5 * (lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def steps_in_budget(done: int, total: int, per_step_s: float, budget_s: float,
                    evaluation_s: float = 0.0, eval_every: int = 0, margin: float = 1.05) -> int:
    """The schedule length that fits a time budget: `done` steps run, `budget_s` seconds left,
    a step taking per_step_s and an evaluation (every eval_every steps) evaluation_s; at most
    `total`, at least one step more than `done`."""
    per_step = per_step_s + (evaluation_s / eval_every if eval_every else 0.0)
    return max(done + 1, min(total, done + int(max(0.0, budget_s) / (per_step * margin))))


def schedule(optimizer, step: int, lr: float, steps: int, warmup_steps: int,
             min_lr_ratio: float) -> float:
    """Sets every parameter group's learning rate to learning_rate(step, ...); returns it."""
    value = learning_rate(step, lr, steps, warmup_steps, min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = value
    return value


@torch.no_grad()
def held_out_mean(model, windows: torch.Tensor, limit: int, batch_size: int, score) -> float:
    """sum(totals) / sum(counts) of score(chunk, logits) -> (total, count) over batches of the
    windows, the model in eval mode (then back); limit > 0 scores only the first `limit`
    batches. chunk is on the model's device, logits are the model's (transformers)."""
    was_training = model.training
    model.eval()
    if limit:
        windows = windows[:limit * batch_size]
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        chunk = chunk.to(device)
        t, c = score(chunk, model(chunk, use_cache=False).logits)
        total += t
        count += c
    model.train(was_training)
    return total / count


def evaluate(model, windows: torch.Tensor, limit: int, batch_size: int) -> float:
    """Mean next-token cross entropy of a transformers model over the windows (the loss at BOS is
    not counted); limit > 0 scores only the first `limit` batches."""
    def cross_entropy(chunk, logits):
        logits = logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum")
        return loss.item(), chunk[:, 1:].numel()

    return held_out_mean(model, windows, limit, batch_size, cross_entropy)
