"""One copy of every weight: what the model holds (packed or plain) is the checkpoint's size in
the run dtype, and loading leaves no second copy resident. Before, every Linear kept its weight
twice (plain for the GEMV, packed for the GEMM): 1.8x the checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

import kvserve

pytest.importorskip("transformers")

# Sizes that are multiples of oneDNN's blocks, as real models' are (padding stays small).
SHAPE = dict(hidden_size=256, intermediate_size=704, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=1024)


def checkpoint_bytes(path, dtype: torch.dtype) -> int:
    """Bytes of every tensor of the checkpoint, in `dtype`."""
    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            numel = 1
            for d in f.get_slice(name).get_shape():
                numel *= d
            total += numel
    return total * dtype.itemsize


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_are_the_checkpoint_size(checkpoint_factory, tied, dtype):
    path = checkpoint_factory("LlamaForCausalLM", tie_word_embeddings=tied, **SHAPE)
    llm = kvserve.LLM(path, dtype=dtype, num_blocks=4)
    want = checkpoint_bytes(path, dtype)
    assert want * 0.999 <= llm.model.weight_bytes <= want * 1.02
    assert f"weights {llm.model.weight_bytes / 2**20:.1f} MiB" in llm.llm_engine.memory_plan()
    # The embedding held apart from the LM head (a decode step reads one row of it): none when
    # tied, else the checkpoint's matrix in the model's dtype.
    embedding = SHAPE["vocab_size"] * SHAPE["hidden_size"] * dtype.itemsize
    assert llm.model.embedding_bytes == (0 if tied else embedding)
    # The tied embedding reads the LM head's packed rows: the text must not change.
    greedy = kvserve.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([[1, 5, 9]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 8


def test_resident_memory_after_loading_is_one_copy(checkpoint_factory):
    """In a fresh process, resident memory grows by about the checkpoint's size when a model
    loads (file pages of the checkpoint are not kept mapped; freed buffers go back to the OS)."""
    path = checkpoint_factory("LlamaForCausalLM", hidden_size=512, intermediate_size=1408,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                              num_hidden_layers=4, vocab_size=8192, tie_word_embeddings=False)
    script = textwrap.dedent(f"""
        import json, kvserve, torch
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) * 1024
        before = rss()
        llm = kvserve.LLM({str(path)!r}, dtype="float32", num_blocks=2)
        print(json.dumps(dict(growth=rss() - before, weights=llm.model.weight_bytes)))
    """)
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("AddressSanitizer's allocator (make test-asan) inflates resident memory")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    want = checkpoint_bytes(path, torch.float32)
    assert measured["weights"] <= want * 1.02
    # Two copies would be ~2x; the rest is the runtime's own buffers (RoPE table, oneDNN).
    assert measured["growth"] <= 1.3 * want + (48 << 20), measured
