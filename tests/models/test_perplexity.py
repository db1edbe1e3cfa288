"""Perplexity with kvserve's runtime against transformers computing the same strided windows,
on a random checkpoint and on the trained models that ship in models/."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvserve
from kvserve.perplexity import evaluate_perplexity, strided_windows
from kvserve.testing.hf_reference import hf_perplexity, load_hf_model
from tests.conftest import SHARED_DATA

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ["shakespeare-target", "shakespeare-draft"]


@pytest.mark.parametrize("num_tokens,max_length,stride", [
    (2, 4, 2), (2, 2, 1), (10, 4, 3), (10, 4, 1), (11, 4, 3), (100, 16, 8), (17, 32, 16)])
def test_windows_score_every_position_once(num_tokens, max_length, stride):
    scored = []
    for begin, end, first in strided_windows(num_tokens, max_length, stride):
        assert begin < first < end <= num_tokens and end - begin <= max_length
        scored += range(first, end)
    assert scored == list(range(1, num_tokens))


def test_bad_arguments():
    with pytest.raises(ValueError, match="stride"):
        strided_windows(10, 4, 4)
    with pytest.raises(ValueError, match="max_length"):
        strided_windows(10, 1, 1)


def test_random_checkpoint_matches_transformers(checkpoint_factory):
    path = checkpoint_factory("LlamaForCausalLM")
    llm = kvserve.LLM(path, dtype="float32")
    ids = [1] + torch.randint(3, llm.config.vocab_size, (299,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = evaluate_perplexity(llm, ids, max_length=64, stride=24)
    assert ours.num_tokens == 299 and ours.num_windows == 11
    assert ours.perplexity == pytest.approx(hf_perplexity(load_hf_model(path), ids, 64, 24), rel=1e-5)
    with pytest.raises(ValueError, match="token ids"):
        evaluate_perplexity(llm, [1, llm.config.vocab_size], max_length=64)


def validation_text(num_chars: int = 8000) -> str:
    corpus = SHARED_DATA / "tinyshakespeare" / "input.txt"
    if not corpus.is_file():
        pytest.skip(f"{corpus} is absent (the shared data folder)")
    text = corpus.read_text()
    cut = text.rfind("\n", 0, int(len(text) * 0.9)) + 1  # scripts/train_tiny.py's split
    return text[cut:cut + num_chars]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_matches_transformers(name):
    model_dir = REPO / "models" / name
    llm = kvserve.LLM(model_dir, dtype="float32")
    ids = llm.tokenizer.encode(validation_text())
    ours = evaluate_perplexity(llm, ids, max_length=256, stride=128)
    theirs = hf_perplexity(load_hf_model(model_dir), ids, 256, 128)
    assert ours.perplexity == pytest.approx(theirs, rel=1e-4)  # the issue asks for 0.5%
    assert ours.perplexity < 40  # trained: far below the vocabulary size of a uniform guess


FAMILY = ["mha", "gqa", "mqa", "mla", "sliding", "hybrid", "cla-gqa", "cla-mqa", "ssm", "ssm-hybrid"]


@pytest.mark.parametrize("member", FAMILY)
def test_attention_family_matches_transformers(member):
    """models/attention (scripts/train_attention_family.sh): each design's kvserve perplexity is
    transformers' on held-out text longer than the sliding window, and it learned the corpus.
    The cross-layer-shared members run against kvserve's CLA reference (transformers has no CLA)."""
    from kvserve.testing.cla import load_cla_llama

    model_dir = REPO / "models" / "attention" / member
    llm = kvserve.LLM(model_dir, dtype="float32", log_memory_plan=False)
    ids = llm.tokenizer.encode(validation_text(4000))
    ours = evaluate_perplexity(llm, ids, max_length=256, stride=128)
    reference = load_cla_llama(model_dir) if member.startswith("cla") else load_hf_model(model_dir)
    assert ours.perplexity == pytest.approx(hf_perplexity(reference, ids, 256, 128), rel=1e-4)
    assert ours.perplexity < 60


def test_converted_stories260k_matches_transformers(tmp_path):
    from kvserve.convert import convert_llama2c

    data = SHARED_DATA / "stories260K"
    text_file = SHARED_DATA / "tinystories-sample" / "TinyStories-valid.txt"
    for path in (data / "stories260K.bin", data / "tok512.bin", text_file):
        if not path.is_file():
            pytest.skip(f"{path} is absent (the shared data folder)")
    out = tmp_path / "stories260K"
    convert_llama2c(data / "stories260K.bin", data / "tok512.bin", out)
    llm = kvserve.LLM(out, dtype="float32")
    ids = llm.tokenizer.encode(text_file.read_text())[:3000]
    # Its context is 512 tokens: a window keeps room for the token each request samples.
    ours = evaluate_perplexity(llm, ids, max_length=511, stride=256)
    theirs = hf_perplexity(load_hf_model(out), ids, 511, 256)
    assert ours.perplexity == pytest.approx(theirs, rel=1e-4)  # the issue asks for 0.5%
    assert ours.perplexity < 20  # a trained model on in-domain text
