"""Cross-layer KV sharing (the `kv_sharing` config extension) against its PyTorch reference
(kvserve.testing.cla, on transformers' Llama layers): logits and greedy tokens, the KV that the
sharing layers do not allocate, and the configs and weights that are rejected."""

from __future__ import annotations

import json

import pytest
import torch

import kvserve
from tests.models.test_parity import (NUM_GREEDY_TOKENS, PROMPTS, assert_logits_close,
                                      hf_greedy, kvserve_prompt_logits)

transformers = pytest.importorskip("transformers")
from kvserve.testing.cla import cla_llama, load_cla_llama, make_cla_checkpoint  # noqa: E402
from kvserve.testing.checkpoints import make_checkpoint, make_config  # noqa: E402

SHARING = {1: 0, 3: 2, 4: 2}  # pairs, and a layer that reads a non-adjacent earlier one


@pytest.fixture(scope="module")
def cla_path(tmp_path_factory):
    return make_cla_checkpoint(tmp_path_factory.mktemp("cla"), SHARING, num_hidden_layers=5)


def test_reference_without_sharing_is_transformers_llama(tmp_path):
    """The reference's attention is transformers' own when nothing is shared."""
    path = make_checkpoint(tmp_path, "LlamaForCausalLM")
    ours = load_cla_llama(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-6, rtol=1e-6)


def test_reference_shares(cla_path):
    """Sharing layers have no K/V projections; only the owners leave K/V for them."""
    model = load_cla_llama(cla_path)
    layers = [layer.self_attn for layer in model.model.layers]
    assert [hasattr(a, "k_proj") for a in layers] == [True, False, True, False, False]
    with torch.no_grad():
        model(torch.tensor([PROMPTS[0]]))
    assert sorted(layers[0].stash) == [0, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_and_greedy_match_the_reference(cla_path, dtype):
    ref = load_cla_llama(cla_path, dtype)
    llm = kvserve.LLM(cla_path, dtype=dtype)
    for prompt in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
        assert_logits_close(kvserve_prompt_logits(llm, prompt), want, dtype)
    if dtype != torch.float32:
        return
    params = kvserve.SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NUM_GREEDY_TOKENS)


def test_sharing_layers_allocate_no_kv(cla_path):
    llm = kvserve.LLM(cla_path, kv_cache_memory=8 << 20)
    config = llm.config
    assert config.kv_sources == [0, 0, 2, 2, 2] and config.num_kv_layers() == 2
    kv = llm.kv_cache
    assert kv.num_layers == 2  # one cache per owning layer: 2 of 5
    per_layer = 2 * config.num_kv_heads * config.head_dim * 4  # fp32 key + value per token
    assert kv.bytes_per_token == 2 * per_layer
    # The same memory holds 5/2 as many tokens as without sharing.
    plain = kvserve._C.KVCacheLayout.multi_head_equivalent(config).bytes_per_token(torch.float32)
    assert plain == 5 * per_layer
    assert "KV sharing: 2 of 5 layers cache K/V" in llm.llm_engine.memory_plan()
    assert "2.5x more" in llm.llm_engine.memory_plan()


def test_every_layer_can_share_the_first(tmp_path):
    path = make_cla_checkpoint(tmp_path, {1: 0, 2: 0}, num_hidden_layers=3)
    ref, llm = load_cla_llama(path), kvserve.LLM(path)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPTS[2]])).logits[0]
    assert_logits_close(kvserve_prompt_logits(llm, PROMPTS[2]), want, torch.float32)
    assert llm.kv_cache.num_layers == 1


@pytest.mark.parametrize("sharing, fragment", [
    ({"1": 1}, "maps layer 1 to 1; a source must be an earlier layer"),
    ({"0": 1}, "maps layer 0 to 1; a source must be an earlier layer"),
    ({"2": 1, "1": 0}, "maps layer 2 to layer 1, which shares another layer's KV itself"),
    ({"7": 0}, "names layer '7'; layers are 0..3"),
    ({"x": 0}, "names layer 'x'"),
    ({"1": "0"}, "maps layer 1 to '0'"),
    ([1, 0], "must map layer -> earlier source layer"),
])
def test_bad_kv_sharing_is_rejected(cla_path, tmp_path, sharing, fragment):
    from kvserve.config import load_checkpoint_info

    path = make_cla_checkpoint(tmp_path, {1: 0}, num_hidden_layers=4)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "kv_sharing": sharing}))
    with pytest.raises(ValueError) as error:
        load_checkpoint_info(path)
    assert "kv_sharing" in str(error.value) and fragment in str(error.value)


def test_sharing_a_layer_with_another_window_is_rejected():
    from pathlib import Path

    from kvserve.config import _model_config
    config = make_config("MistralForCausalLM", sliding_window=8, num_hidden_layers=2).to_dict()
    config.update(layer_types=["sliding_attention", "full_attention"], kv_sharing={"1": 0})
    with pytest.raises(ValueError, match="whose sliding window differs"):
        _model_config(config, Path("config.json"))


def test_weights_must_match_the_sharing(cla_path, tmp_path):
    """A sharing layer that still has k_proj/v_proj, or an owner without them, is named."""
    config = json.loads((cla_path / "config.json").read_text())
    plain = make_checkpoint(tmp_path / "plain", "LlamaForCausalLM", num_hidden_layers=5)
    (plain / "config.json").write_text(json.dumps({**json.loads(
        (plain / "config.json").read_text()), "kv_sharing": config["kv_sharing"]}))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        kvserve.LLM(plain)
    unshared = tmp_path / "unshared"
    unshared.mkdir()
    for f in cla_path.iterdir():
        (unshared / f.name).write_bytes(f.read_bytes())
    del config["kv_sharing"]
    (unshared / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        kvserve.LLM(unshared)


def test_cla_llama_rejects_what_kvserve_rejects():
    config = make_config("LlamaForCausalLM", num_hidden_layers=3)
    config.kv_sharing = {"2": 1, "1": 0}
    with pytest.raises(ValueError, match="earlier layer that owns its KV"):
        cla_llama(config)


def test_train_tiny_trains_a_cla_model_that_kvserve_serves(tmp_path):
    """scripts/train_tiny.py --kv-sharing 2: layers 1 and 3 read layers 0 and 2; the trained
    directory loads in kvserve and agrees with the reference."""
    import subprocess
    import sys

    from tests.conftest import REPO
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 400)
    out = tmp_path / "model"
    subprocess.run([sys.executable, str(REPO / "scripts" / "train_tiny.py"), "--out", str(out),
                    "--corpus", str(corpus), "--vocab-size", "280", "--hidden-size", "32",
                    "--num-hidden-layers", "4", "--num-attention-heads", "2",
                    "--num-key-value-heads", "1", "--intermediate-size", "64", "--steps", "6",
                    "--batch-size", "2", "--lr", "3e-3", "--seq-len", "32", "--warmup-steps",
                    "2", "--eval-every", "100", "--eval-batches", "1", "--precision", "fp32",
                    "--kv-sharing", "2"], check=True, capture_output=True)
    assert json.loads((out / "config.json").read_text())["kv_sharing"] == {"1": 0, "3": 2}
    llm = kvserve.LLM(out, dtype="float32")
    assert llm.config.kv_sources == [0, 0, 2, 2] and llm.kv_cache.num_layers == 2
    prompt = llm.generate(["the quick"], kvserve.SamplingParams(max_tokens=1))[0].prompt_token_ids
    with torch.no_grad():
        want = load_cla_llama(out)(torch.tensor([prompt])).logits[0]
    assert_logits_close(kvserve_prompt_logits(llm, prompt), want, torch.float32)


def test_kv_sharing_flag_forms():
    import importlib.util

    from tests.conftest import REPO
    spec = importlib.util.spec_from_file_location("train_tiny", REPO / "scripts" / "train_tiny.py")
    train_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tiny)
    assert train_tiny.parse_kv_sharing("3", 7) == {1: 0, 2: 0, 4: 3, 5: 3}
    assert train_tiny.parse_kv_sharing("1:0,3:1", 4) == {1: 0, 3: 1}
    assert train_tiny.parse_kv_sharing(None, 4) == {}
    with pytest.raises(ValueError):
        train_tiny.parse_kv_sharing("1-0", 4)
