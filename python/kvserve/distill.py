"""Logit distillation: a student checkpoint trained to match a teacher's next-token distribution.

The teacher's logits come from kvserve's runtime (the model `LLM` serves, run over whole windows
with a contiguous KVCache); the student trains in PyTorch through transformers. The loss is the
forward KL divergence from the teacher's distribution to the student's, both softened by a
temperature T and scaled by T^2 (Hinton et al.; Minitron distils a pruned model this way), plus
an optional weight on the ordinary next-token cross entropy:

    loss = T^2 * KL(softmax(teacher / T) || softmax(student / T)) + ce_weight * CE(student, text)

The corpus is split by characters (the last validation_fraction validates); every training window
is BOS plus a random run of the training text. Every eval_every steps the student is scored on the
held-out windows (cross entropy and KL to the teacher at T = 1); training stops after `patience`
evaluations without a better validation cross entropy, and the best weights are written.

    kvserve.distill.distill("teacher", "student", "corpus.txt", "distilled", steps=600)
    python -m kvserve distill --teacher DIR --student DIR --corpus FILE --out DIR
        [--steps N] [--batch-size N] [--seq-len N] [--lr X] [--temperature T] [--ce-weight W]
        [--eval-every N] [--patience N] [--seed N] [--device cpu|cuda]
"""

from __future__ import annotations

import copy
import csv
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvserve import training

# Files of a checkpoint directory that are not weights or config: copied to the output unchanged.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


@dataclass(frozen=True)
class DistillConfig:
    steps: int = 600
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.0
    temperature: float = 1.0
    ce_weight: float = 0.0
    validation_fraction: float = 0.1
    eval_every: int = 50
    eval_batches: int = 8       # batches of held-out windows per evaluation (0: all of them)
    patience: int = 4           # evaluations without improvement before stopping (0: never)
    seed: int = 0
    device: str = "cpu"

    def check(self) -> None:
        positive = ["steps", "batch_size", "eval_every"]
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"seq_len must be an integer >= 2, got {self.seq_len!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if not self.lr > 0 or self.ce_weight < 0 or self.weight_decay < 0:
            raise ValueError("lr must be positive; ce_weight and weight_decay non-negative")
        if self.patience < 0 or self.eval_batches < 0 or self.warmup_steps < 0:
            raise ValueError("patience, eval_batches and warmup_steps must be non-negative")


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of T^2 * KL(softmax(teacher / T) || softmax(student / T)); logits
    [..., vocab]."""
    t = teacher_logits.float() / temperature
    s = student_logits.float() / temperature
    teacher_logp = torch.log_softmax(t, dim=-1)
    kl = (teacher_logp.exp() * (teacher_logp - torch.log_softmax(s, dim=-1))).sum(-1)
    return kl.mean() * temperature ** 2


class Teacher:
    """A checkpoint on kvserve's runtime, returning fp32 logits of whole windows."""

    def __init__(self, model_dir: str | Path, max_len: int, device: str):
        from kvserve import LLM

        self.llm = LLM(model_dir, dtype=torch.float32, max_model_len=max_len, num_blocks=2,
                       device=device)
        self.max_len = max_len
        self._caches = {}

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[batch, len] token ids -> [batch, len, vocab] fp32 logits."""
        from kvserve import KVCache

        batch = tokens.shape[0]
        if batch not in self._caches:
            self._caches[batch] = KVCache.for_model(batch, self.max_len, self.llm.config,
                                                    torch.float32, self.llm.model.device)
        caches = self._caches[batch]
        for cache in caches:
            cache.reset()
        return self.llm.model(tokens.to(self.llm.model.device), caches)


def _vocab(model_dir: Path) -> dict[str, int]:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
    return json.loads(path.read_text())["model"]["vocab"]


def validation_kl(student, teacher: Teacher, windows: torch.Tensor, limit: int,
                  batch_size: int) -> float:
    """Mean KL(teacher || student) at T = 1 over the held-out windows' positions."""
    def kl(chunk, logits):
        theirs = teacher.logits(chunk).to(logits.device)
        return distillation_loss(logits, theirs).item() * chunk.numel(), chunk.numel()

    return training.held_out_mean(student, windows, limit, batch_size, kl)


def distill(teacher_dir: str | Path, student_dir: str | Path, corpus: str | Path,
            out_dir: str | Path, config: DistillConfig | None = None, *,
            progress: bool = True) -> dict:
    """Distils the teacher into the student on the corpus and writes the best student to
    out_dir (its config and tokenizer files, the trained weights, distill_log.csv and
    distill.json); returns the summary that distill.json holds."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from kvserve.tokenizer import Tokenizer

    config = config or DistillConfig()
    config.check()
    teacher_dir, student_dir, out_dir = Path(teacher_dir), Path(student_dir), Path(out_dir)
    if out_dir.resolve() in (teacher_dir.resolve(), student_dir.resolve()):
        raise ValueError("--out must be another directory than --teacher and --student")
    if _vocab(teacher_dir) != _vocab(student_dir):
        raise ValueError("the teacher and the student must share one tokenizer (their "
                         "tokenizer.json vocabularies differ)")
    started = time.monotonic()
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)

    train_text, val_text = training.read_split(corpus, config.validation_fraction)
    tokenizer = Tokenizer.from_model_dir(student_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    bos = student.config.bos_token_id
    if bos is None:
        raise ValueError(f"{student_dir}/config.json has no bos_token_id to start windows with")
    train_ids = torch.tensor(tokenizer.encode(train_text, add_special_tokens=False))
    val_ids = torch.tensor(tokenizer.encode(val_text, add_special_tokens=False))
    val_windows = training.validation_windows(val_ids, config.seq_len, bos)
    teacher = Teacher(teacher_dir, config.seq_len, config.device)
    if teacher.llm.config.vocab_size != student.config.vocab_size:
        raise ValueError(f"vocabulary sizes differ: teacher {teacher.llm.config.vocab_size}, "
                         f"student {student.config.vocab_size}")
    device = torch.device(config.device)
    student.to(device).train()

    decay = [p for p in student.parameters() if p.dim() >= 2]
    no_decay = [p for p in student.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config.lr, betas=(0.9, 0.95))

    def scores() -> tuple[float, float]:
        return (training.evaluate(student, val_windows, config.eval_batches, config.batch_size),
                validation_kl(student, teacher, val_windows, config.eval_batches,
                              config.batch_size))

    val_ce, val_kl = scores()
    before = {"validation_loss": val_ce, "validation_kl": val_kl}
    best = (val_ce, 0, copy.deepcopy(student.state_dict()))
    teacher_val = _teacher_loss(teacher, val_windows, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens_per_step = config.batch_size * config.seq_len
    stale, steps_run, stopped_early = 0, 0, False
    with open(out_dir / "distill_log.csv", "w", newline="") as log_file, \
            tqdm(range(config.steps), desc="distil", unit="step", file=sys.stderr,
                 disable=not progress) as bar:
        log = csv.writer(log_file)
        log.writerow(["step", "tokens", "train_kd", "train_ce", "val_loss", "val_kl", "lr",
                      "elapsed_s"])
        log.writerow([0, 0, "", "", f"{val_ce:.4f}", f"{val_kl:.4f}", "", "0.0"])
        for step in bar:
            lr = training.schedule(optimizer, step, config.lr, config.steps,
                                   config.warmup_steps, config.min_lr_ratio)
            batch = training.sample_batch(train_ids, config.batch_size, config.seq_len, gen, bos)
            target = teacher.logits(batch).to(device)
            batch = batch.to(device)
            logits = student(batch).logits
            kd = distillation_loss(logits, target, config.temperature)
            ce = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
            loss = kd + config.ce_weight * ce if config.ce_weight else kd
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
            steps_run = step + 1
            evaluated = steps_run % config.eval_every == 0 or steps_run == config.steps
            if evaluated:
                val_ce, val_kl = scores()
                if val_ce < best[0]:
                    best, stale = (val_ce, steps_run, copy.deepcopy(student.state_dict())), 0
                else:
                    stale += 1
            bar.set_postfix(kd=f"{kd.item():.3f}", val=f"{val_ce:.3f}", lr=f"{lr:.1e}")
            log.writerow([steps_run, steps_run * tokens_per_step, f"{kd.item():.4f}",
                          f"{ce.item():.4f}", f"{val_ce:.4f}" if evaluated else "",
                          f"{val_kl:.4f}" if evaluated else "", f"{lr:.3e}",
                          f"{time.monotonic() - started:.1f}"])
            log_file.flush()
            if evaluated and config.patience and stale >= config.patience:
                stopped_early = True
                break
    best_loss, best_step, state = best
    student.load_state_dict(state)
    student.to(torch.float32).cpu().save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (student_dir / name).is_file():
            shutil.copyfile(student_dir / name, out_dir / name)
    student.to(device)
    final_ce, final_kl = scores()
    summary = {
        "teacher": str(teacher_dir), "student": str(student_dir), "corpus": str(corpus),
        "config": asdict(config), "parameters": sum(p.numel() for p in student.parameters()),
        "train_tokens": len(train_ids), "validation_tokens": len(val_ids),
        "steps_run": steps_run, "stopped_early": stopped_early, "best_step": best_step,
        "tokens_seen": steps_run * tokens_per_step,
        "teacher_validation_loss": round(teacher_val, 4),
        "before": {k: round(v, 4) for k, v in before.items()},
        "after": {"validation_loss": round(final_ce, 4), "validation_kl": round(final_kl, 4)},
        "wall_time_s": round(time.monotonic() - started, 1),
    }
    (out_dir / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@torch.no_grad()
def _teacher_loss(teacher: Teacher, windows: torch.Tensor, config: DistillConfig) -> float:
    """The teacher's own validation cross entropy (the floor the student approaches)."""
    if config.eval_batches:
        windows = windows[:config.eval_batches * config.batch_size]
    total, count = 0.0, 0
    for chunk in windows.split(config.batch_size):
        logits = teacher.logits(chunk)[:, :-1].cpu()
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count
