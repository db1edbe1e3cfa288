"""`python -m kvserve` end to end in a subprocess, and in this process where a test patches the
default model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvserve


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvserve", *args], capture_output=True, text=True,
                          timeout=120)


def test_generate_prints_text_and_metrics(checkpoint_factory):
    path = checkpoint_factory("LlamaForCausalLM")
    result = run_cli("generate", "--model", str(path), "--prompt", "Once upon a time",
                     "--max-tokens", "8", "--temperature", "0", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    llm = kvserve.LLM(path)
    expected = llm.generate("Once upon a time", kvserve.SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    assert result.stdout.startswith("Once upon a time" + expected)
    for metric in ("TTFT", "TPOT", "tokens/s", "8 generated"):
        assert metric in result.stderr


def test_generate_a_state_space_model_with_state_snapshots(checkpoint_factory):
    """--num-state-snapshots reaches the engine (prefix caching of a hybrid of Mamba mixers and
    attention); the text is the one without."""
    path = checkpoint_factory("JambaForCausalLM")
    result = run_cli("generate", "--model", str(path), "--prompt", "Once upon a time there was",
                     "--max-tokens", "8", "--temperature", "0", "--ignore-eos",
                     "--num-state-snapshots", "4", "--block-size", "4")
    assert result.returncode == 0, result.stderr
    expected = kvserve.LLM(path).generate("Once upon a time there was", kvserve.SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    assert result.stdout.startswith("Once upon a time there was" + expected)
    bad = run_cli("generate", "--model", str(checkpoint_factory("LlamaForCausalLM")), "--prompt",
                  "x", "--num-state-snapshots", "4")
    assert bad.returncode != 0
    assert "num_state_snapshots is for models with state-space layers" in bad.stderr


MODELS = Path(__file__).resolve().parents[2] / "models"
DRAFT = str(MODELS / "shakespeare-draft")


@pytest.mark.parametrize("speculation", [["--speculative-model", DRAFT],
                                         ["--ngram", "--num-speculative-tokens", "3"]])
def test_generate_with_speculation_prints_the_same_text_and_the_acceptance(speculation):
    # --model explicitly: a package imported from elsewhere (the sanitizer build) has no models/.
    common = ["generate", "--model", str(MODELS / "shakespeare-target"), "--prompt", "ROMEO:",
              "--max-tokens", "24", "--temperature", "0",
              "--ignore-eos", "--dtype", "float32"]
    plain = run_cli(*common)
    result = run_cli(*common, *speculation)
    assert result.returncode == 0, result.stderr
    assert result.stdout == plain.stdout
    assert "[speculative:" in result.stderr and "mean acceptance length" in result.stderr
    bad = run_cli(*common, "--num-speculative-tokens", "2")
    assert bad.returncode == 2 and "num_speculative_tokens needs speculative_model" in bad.stderr


def test_errors_are_one_clear_line(tmp_path):
    result = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert result.returncode == 2
    assert "kvserve: error:" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_cli("generate", "--model", str(tmp_path), "--prompt", "hi", "--top-p", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_eval_ppl_prints_the_library_figure(checkpoint_factory, tmp_path):
    from kvserve.perplexity import evaluate_perplexity

    path = checkpoint_factory("LlamaForCausalLM")
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 20)
    result = run_cli("eval-ppl", "--model", str(path), "--text", str(text), "--max-length", "64",
                     "--stride", "40", "--max-tokens", "150")
    assert result.returncode == 0, result.stderr
    llm = kvserve.LLM(path)
    ids = llm.tokenizer.encode(text.read_text())[:150]
    expected = evaluate_perplexity(llm, ids, max_length=64, stride=40)
    # The CLI prints four decimals; the in-process figure may round the other way in the last one.
    printed = re.match(r"perplexity (\S+) ", result.stdout)
    assert printed and float(printed.group(1)) == pytest.approx(expected.perplexity, rel=1e-6, abs=1e-4)
    assert "over 149 tokens" in result.stdout


def test_eval_ppl_errors_are_one_clear_line(checkpoint_factory, tmp_path):
    path = checkpoint_factory("LlamaForCausalLM")
    for args, message in [(["--text", str(tmp_path / "missing.txt")], "not found"),
                          (["--text", __file__, "--stride", "0"], "stride"),
                          (["--text", __file__, "--max-tokens", "1"], "max-tokens")]:
        result = run_cli("eval-ppl", "--model", str(path), *args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_generate_defaults_to_the_shipped_model():
    result = run_cli("generate", "--prompt", "ROMEO:", "--max-tokens", "8", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:") and "8 generated" in result.stderr


def run_cli_here(capsys, *args) -> tuple[int, str, str]:
    """The CLI in this process (so that monkeypatch reaches it): exit code, stdout, stderr."""
    from kvserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_generate_without_a_model_says_to_pass_one(monkeypatch, capsys, tmp_path):
    # As after `pip install .`: no models/ beside the installed package, no KVSERVE_MODEL.
    monkeypatch.setattr("kvserve.cli.DEFAULT_MODEL", tmp_path / "models" / "shakespeare-target")
    monkeypatch.delenv("KVSERVE_MODEL", raising=False)
    code, out, err = run_cli_here(capsys, "generate", "--prompt", "hi")
    assert code == 2 and out == ""
    assert err.startswith("kvserve: error: no model given: pass --model DIR")
    assert "KVSERVE_MODEL" in err and "models/shakespeare-target" in err
    assert "Traceback" not in err


def test_generate_model_from_the_environment(monkeypatch, capsys, checkpoint_factory, tmp_path):
    path = checkpoint_factory("LlamaForCausalLM")
    monkeypatch.setattr("kvserve.cli.DEFAULT_MODEL", tmp_path / "missing")
    args = ("generate", "--prompt", "Once", "--max-tokens", "2", "--temperature", "0",
            "--ignore-eos")
    monkeypatch.setenv("KVSERVE_MODEL", str(path))
    code, out, err = run_cli_here(capsys, *args)
    assert code == 0 and out.startswith("Once") and "2 generated" in err
    # --model wins over the environment; a KVSERVE_MODEL that is no directory is named.
    monkeypatch.setenv("KVSERVE_MODEL", str(tmp_path / "nowhere"))
    code, out, err = run_cli_here(capsys, *args, "--model", str(path))
    assert code == 0 and "2 generated" in err
    code, out, err = run_cli_here(capsys, *args)
    assert code == 2 and "KVSERVE_MODEL=" in err and "is not a directory" in err


@pytest.mark.parametrize("flags, params", [
    ((), dict(temperature=0.8, top_k=50)),  # the shipped model's generation_config.json
    (("--top-k", "5"), dict(temperature=0.8, top_k=5)),  # a flag wins
    (("--generation-config", "none"), dict(temperature=0.8)),  # the command's own default
])
def test_generate_samples_with_the_generation_config_unless_told(monkeypatch, capsys, flags,
                                                                  params):
    model = MODELS / "shakespeare-target"
    code, out, err = run_cli_here(capsys, "generate", "--model", str(model), "--prompt", "ROMEO:",
                                  "--max-tokens", "12", "--seed", "4", *flags)
    assert code == 0, err
    want = kvserve.LLM(model).generate("ROMEO:", kvserve.SamplingParams(
        seed=4, max_tokens=12, **params), use_tqdm=False)[0].outputs[0].text
    assert out.startswith("ROMEO:" + want)
