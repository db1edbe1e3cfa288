"""`python -m kvserve generate` end to end in a subprocess."""

from __future__ import annotations

import subprocess
import sys

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


def test_errors_are_one_clear_line(tmp_path):
    result = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert result.returncode == 2
    assert "kvserve: error:" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_cli("generate", "--model", str(tmp_path), "--prompt", "hi", "--top-p", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
