"""Logit distillation: the loss against torch's own KL divergence; a short run from the shipped
trained model into a pruned copy lowers the student's validation loss; early stopping keeps the
best weights; bad arguments are clear errors."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kvserve
from kvserve.cli import main as cli_main
from kvserve.distill import DistillConfig, distill, distillation_loss
from kvserve.prune import prune_checkpoint
from tests.conftest import SHARED_DATA

TEACHER = Path(__file__).resolve().parents[2] / "models" / "shakespeare-target"
CORPUS = SHARED_DATA / "tinyshakespeare" / "input.txt"
QUICK = dict(batch_size=4, seq_len=96, eval_every=5, eval_batches=3, warmup_steps=2)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_loss_is_torch_kl_divergence(temperature):
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 7, 33, generator=g), torch.randn(2, 7, 33, generator=g) * 3
    want = torch.nn.functional.kl_div(
        torch.log_softmax(student / temperature, -1).view(-1, 33),
        torch.log_softmax(teacher / temperature, -1).view(-1, 33),
        log_target=True, reduction="batchmean") * temperature ** 2
    torch.testing.assert_close(distillation_loss(student, teacher, temperature), want)
    assert distillation_loss(teacher, teacher, temperature).abs() < 1e-6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(a pruned copy of the shipped Shakespeare model, a short corpus of Shakespeare)."""
    if not CORPUS.is_file():
        pytest.skip(f"needs the shared corpus {CORPUS}")
    tmp = tmp_path_factory.mktemp("distill")
    text = CORPUS.read_text(encoding="utf-8")[:120_000]
    corpus = tmp / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    student = tmp / "student"
    prune_checkpoint(TEACHER, text[:20_000], student, hidden=160, intermediate=256, heads=4)
    return student, corpus


def test_distillation_lowers_the_validation_loss(setup, tmp_path):
    student, corpus = setup
    done = distill(TEACHER, student, corpus, tmp_path / "out",
                   DistillConfig(steps=15, lr=2e-3, **QUICK), progress=False)
    before, after = done["before"], done["after"]
    assert after["validation_loss"] < before["validation_loss"] - 0.2, done
    assert after["validation_kl"] < before["validation_kl"] * 0.8, done
    assert done["teacher_validation_loss"] < after["validation_loss"]
    with open(tmp_path / "out" / "distill_log.csv") as f:
        log = list(csv.DictReader(f))
    assert [int(r["step"]) for r in log] == list(range(16))
    assert all(float(r["train_kd"]) >= 0 for r in log[1:])
    # The student is a checkpoint kvserve serves, with the teacher's tokenizer.
    llm = kvserve.LLM(tmp_path / "out", dtype=torch.float32)
    out = llm.generate(["ROMEO:"], kvserve.SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_early_stop_keeps_the_best_weights(setup, tmp_path):
    """A learning rate that wrecks the student: validation only gets worse, training stops after
    `patience` evaluations, and the starting weights are the ones written."""
    student, corpus = setup
    done = distill(TEACHER, student, corpus, tmp_path / "out",
                   DistillConfig(steps=50, lr=3.0, patience=2, **QUICK), progress=False)
    assert done["stopped_early"] and done["steps_run"] == 10 and done["best_step"] == 0
    original = load_file(student / "model.safetensors")
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert original.keys() == written.keys()
    for name, tensor in original.items():
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=0)


def test_cli(setup, tmp_path, capsys):
    student, corpus = setup
    with pytest.raises(SystemExit) as e:
        cli_main(["distill", "--teacher", str(TEACHER), "--student", str(student), "--corpus",
                  str(corpus), "--out", str(tmp_path / "out"), "--steps", "2", "--batch-size",
                  "2", "--seq-len", "64", "--eval-every", "1", "--eval-batches", "1"])
    assert e.value.code == 0
    assert "validation loss" in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "distill.json").read_text())
    assert summary["steps_run"] == 2 and summary["config"]["seq_len"] == 64


def test_bad_arguments(setup, tmp_path, checkpoint_factory):
    student, corpus = setup
    other = checkpoint_factory("LlamaForCausalLM")  # another tokenizer
    with pytest.raises(ValueError, match="tokenizer"):
        distill(TEACHER, other, corpus, tmp_path / "a", DistillConfig(steps=1, **QUICK))
    with pytest.raises(ValueError, match="another directory"):
        distill(TEACHER, student, corpus, student, DistillConfig(steps=1, **QUICK))
    with pytest.raises(ValueError, match="temperature"):
        distill(TEACHER, student, corpus, tmp_path / "b", DistillConfig(temperature=0.0))
    with pytest.raises(FileNotFoundError, match="corpus"):
        distill(TEACHER, student, tmp_path / "missing.txt", tmp_path / "c",
                DistillConfig(steps=1, **QUICK))
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(student, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        distill(TEACHER, no_tokenizer, corpus, tmp_path / "d", DistillConfig(steps=1, **QUICK))
