"""scripts/train_tiny.py --attention: each design trains for a few steps into a directory that
transformers and kvserve load, with the same logits, and the KV layout the design implies."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import kvserve
from tests.conftest import REPO
from tests.models.test_parity import assert_logits_close, kvserve_prompt_logits

transformers = pytest.importorskip("transformers")

# attention -> (architecture, KV heads of the 4-head model, sliding windows per layer)
EXPECTED = {
    "mha": ("LlamaForCausalLM", 4, [0, 0, 0]),
    "mqa": ("LlamaForCausalLM", 1, [0, 0, 0]),
    "sliding": ("MistralForCausalLM", 1, [8, 8, 8]),
    "hybrid": ("Qwen2ForCausalLM", 1, [8, 8, 0]),
    "mla": ("DeepseekV2ForCausalLM", None, [0, 0, 0]),
    "ssm-hybrid": ("GraniteMoeHybridForCausalLM", 1, [0, 0, 0]),  # Mamba2 mixers in layers 0, 1
}


@pytest.mark.parametrize("attention", sorted(EXPECTED))
def test_train_tiny_attention_variants(tmp_path, attention):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 400)
    out = tmp_path / "model"
    subprocess.run([sys.executable, str(REPO / "scripts" / "train_tiny.py"), "--out", str(out),
                    "--corpus", str(corpus), "--vocab-size", "280", "--hidden-size", "64",
                    "--num-hidden-layers", "3", "--num-attention-heads", "4",
                    "--intermediate-size", "96", "--steps", "4", "--batch-size", "2",
                    "--lr", "3e-3", "--seq-len", "32", "--warmup-steps", "1", "--eval-every",
                    "100", "--eval-batches", "1", "--precision", "fp32", "--attention", attention,
                    "--sliding-window", "8", "--kv-lora-rank", "16", "--rope-head-dim", "8",
                    "--ssm-head-dim", "32", "--ssm-state", "8"],
                   check=True, capture_output=True)
    architecture, kv_heads, windows = EXPECTED[attention]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture]
    llm = kvserve.LLM(out, dtype="float32", log_memory_plan=False)
    if kv_heads is not None:
        assert llm.config.num_kv_heads == kv_heads
    else:
        assert llm.config.mla.kv_lora_rank == 16 and llm.config.mla.qk_rope_head_dim == 8
    assert list(llm.config.sliding_windows) == windows
    if attention == "ssm-hybrid":  # one attention layer in --global-every (3), mixers elsewhere
        assert list(llm.config.ssm.layers) == [1, 1, 0] and llm.config.ssm.head_dim == 32
    prompt = [1] + list(range(5, 45))  # longer than the window
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        want = ref(torch.tensor([prompt])).logits[0]
    assert_logits_close(kvserve_prompt_logits(llm, prompt), want, torch.float32)
