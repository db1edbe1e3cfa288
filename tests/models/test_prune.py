"""Structured pruning: the pruned checkpoint loads in transformers and kvserve with equal outputs,
and what activation importance removes first is what contributes nothing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvserve
from kvserve.cli import main as cli_main
from kvserve.prune import prune_checkpoint
from tests.models.test_parity import check_parity

CALIBRATION = ("the quick brown fox jumps over the lazy dog while the cat sleeps in the sun. "
               "a stitch in time saves nine, and the early bird catches the worm. ") * 8
PROMPTS = [[1, 17, 45, 9, 200, 31, 8, 77], [1, 5, 5, 90, 12]]


def logits(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in PROMPTS]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_pruned_checkpoint_matches_in_both_runtimes(checkpoint_factory, tmp_path, architecture):
    base = checkpoint_factory(architecture, num_hidden_layers=3)
    done = prune_checkpoint(base, CALIBRATION, tmp_path / "pruned", layers=2, heads=2,
                            intermediate=96, hidden=64)
    config = json.loads((tmp_path / "pruned" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"],
            config["hidden_size"]) == (2, 2, 1, 96, 64)
    assert len(done["layers"]) == 2
    check_parity(tmp_path / "pruned")  # kvserve's logits and greedy tokens = transformers'


def test_full_targets_keep_the_model(checkpoint_factory, tmp_path):
    base = checkpoint_factory("LlamaForCausalLM")
    prune_checkpoint(base, CALIBRATION, tmp_path / "same", layers=2, heads=4, intermediate=160,
                     hidden=96)
    for a, b in zip(logits(base), logits(tmp_path / "same")):
        torch.testing.assert_close(a, b)


def _with_dead_parts(base, out):
    """A copy of `base` in which MLP channels 3 and 7 and KV group 1 (its values) of every
    layer, and all of layer 2 (its output projections), are zero: they contribute nothing."""
    tensors = load_file(base / "model.safetensors")
    head_dim = 96 // 4
    for i in range(3):
        tensors[f"model.layers.{i}.mlp.up_proj.weight"][[3, 7]] = 0
        tensors[f"model.layers.{i}.self_attn.v_proj.weight"][head_dim:2 * head_dim] = 0
    tensors["model.layers.2.self_attn.o_proj.weight"].zero_()
    tensors["model.layers.2.mlp.down_proj.weight"].zero_()
    out.mkdir()
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(tensors, out / "model.safetensors")
    return out


def test_importance_removes_what_contributes_nothing_first(checkpoint_factory, tmp_path):
    """Channels, a KV group and a layer that contribute nothing score lowest, so pruning exactly
    them leaves the outputs unchanged."""
    base = _with_dead_parts(checkpoint_factory("LlamaForCausalLM", num_hidden_layers=3),
                            tmp_path / "base")
    want = logits(base)
    for target, directory in [(dict(intermediate=158), "mlp"), (dict(heads=2), "heads"),
                              (dict(layers=2), "layers")]:
        done = prune_checkpoint(base, CALIBRATION, tmp_path / directory, **target)
        if directory == "layers":
            assert done["layers"] == [0, 1]
        for a, b in zip(want, logits(tmp_path / directory)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    pruned = load_file(tmp_path / "heads" / "model.safetensors")
    original = load_file(base / "model.safetensors")
    # every layer kept KV group 0 and its query heads 0 and 1
    torch.testing.assert_close(pruned["model.layers.1.self_attn.k_proj.weight"],
                               original["model.layers.1.self_attn.k_proj.weight"][:24])
    torch.testing.assert_close(pruned["model.layers.1.self_attn.q_proj.weight"],
                               original["model.layers.1.self_attn.q_proj.weight"][:48])


def test_bad_targets_are_clear_errors(checkpoint_factory, tmp_path):
    base = checkpoint_factory("LlamaForCausalLM")
    with pytest.raises(ValueError, match="multiple of the GQA group"):
        prune_checkpoint(base, CALIBRATION, tmp_path / "a", heads=3)
    with pytest.raises(ValueError, match=r"--intermediate must be in \[1, 160\]"):
        prune_checkpoint(base, CALIBRATION, tmp_path / "a", intermediate=500)
    with pytest.raises(ValueError, match="another directory"):
        prune_checkpoint(base, CALIBRATION, base, layers=1)
    with pytest.raises(ValueError, match="pruning supports"):
        prune_checkpoint(checkpoint_factory("DeepseekV2ForCausalLM"), CALIBRATION, tmp_path / "b",
                         layers=1)


def test_cli(checkpoint_factory, tmp_path, capsys):
    base = checkpoint_factory("LlamaForCausalLM")
    (tmp_path / "calibration.txt").write_text(CALIBRATION)
    with pytest.raises(SystemExit) as done:
        cli_main(["prune", "--model", str(base), "--calibration", str(tmp_path / "calibration.txt"),
                  "--out", str(tmp_path / "out"), "--intermediate", "80"])
    assert done.value.code == 0
    assert "intermediate 80" in capsys.readouterr().out
    kvserve.LLM(tmp_path / "out")
    with pytest.raises(SystemExit) as done:
        cli_main(["prune", "--model", str(base), "--calibration", str(tmp_path / "missing.txt"),
                  "--out", str(tmp_path / "out2"), "--layers", "1"])
    assert done.value.code == 2
