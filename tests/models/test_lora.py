"""kvserve.merge_lora against peft's own merge_and_unload, on adapters that peft makes here."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvserve
from kvserve.cli import main as cli_main

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 17, 45, 9, 200, 31], [1, 5, 5, 90]]


def make_adapter(base, out, dtype=torch.float32, seed=0, **lora_args):
    """A peft LoRA adapter on `base` with random A and B (peft starts B at zero), saved to `out`;
    returns peft's merge_and_unload() of it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**lora_args))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(out)
    return peft_model.merge_and_unload().eval()


CASES = {
    "attention": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-linear-rslora": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "patterns": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "down_proj"],
                     rank_pattern={"down_proj": 2},
                     alpha_pattern={r"layers\.0\.self_attn\.q_proj": 32}),
    "embedding-and-saved-head": dict(r=4, lora_alpha=4, target_modules=["embed_tokens", "o_proj"],
                                     modules_to_save=["lm_head"]),
}


@pytest.mark.parametrize("case", CASES)
def test_merged_weights_equal_peft_merge(checkpoint_factory, tmp_path, case):
    base = checkpoint_factory("LlamaForCausalLM")
    reference = make_adapter(base, tmp_path / "adapter", **CASES[case])
    done = kvserve.merge_lora(base, tmp_path / "adapter", tmp_path / "merged")
    assert done["merged"]
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    want = reference.state_dict()
    assert set(merged) == set(load_file(base / "model.safetensors"))
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, want[name], atol=2e-6, rtol=1e-5, msg=name)
    changed = [n for n in merged if not torch.equal(merged[n],
                                                    load_file(base / "model.safetensors")[n])]
    assert len(changed) >= len(done["merged"])


def test_merged_checkpoint_generates_like_the_peft_model(checkpoint_factory, tmp_path):
    """kvserve on the merged directory gives the greedy tokens of transformers running peft's
    merged model."""
    base = checkpoint_factory("Qwen3ForCausalLM")
    reference = make_adapter(base, tmp_path / "adapter", r=8, lora_alpha=16,
                             target_modules="all-linear")
    kvserve.merge_lora(base, tmp_path / "adapter", tmp_path / "merged")
    llm = kvserve.LLM(tmp_path / "merged")
    params = kvserve.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for prompt, tokens in zip(PROMPTS, got):
        ids = torch.tensor([prompt])
        want = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
        assert tokens == want[0, len(prompt):].tolist()
    # and the base model's tokens differ: the adapter changed something
    plain = kvserve.LLM(base).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != got


def test_bf16_base(checkpoint_factory, tmp_path):
    base = checkpoint_factory("LlamaForCausalLM", dtype=torch.bfloat16)
    reference = make_adapter(base, tmp_path / "adapter", dtype=torch.bfloat16, r=4,
                             lora_alpha=8, target_modules=["gate_proj", "up_proj"])
    kvserve.merge_lora(base, tmp_path / "adapter", tmp_path / "merged")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    for name, tensor in reference.state_dict().items():
        assert merged[name].dtype == torch.bfloat16
        # peft adds in bf16, kvserve in fp32 then rounds: at most one bf16 step apart
        torch.testing.assert_close(merged[name].float(), tensor.float(), atol=1e-2, rtol=1e-2)


def test_cli(checkpoint_factory, tmp_path, capsys):
    base = checkpoint_factory("LlamaForCausalLM")
    make_adapter(base, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["v_proj"])
    with pytest.raises(SystemExit) as done:
        cli_main(["merge-lora", "--base", str(base), "--adapter", str(tmp_path / "adapter"),
                  "--out", str(tmp_path / "merged")])
    assert done.value.code == 0
    assert "weights merged" in capsys.readouterr().out
    assert (tmp_path / "merged" / "config.json").is_file()
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    kvserve.LLM(tmp_path / "merged")  # loads


def test_bad_adapters_are_clear_errors(checkpoint_factory, tmp_path):
    base = checkpoint_factory("LlamaForCausalLM")
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter"):
        kvserve.merge_lora(base, tmp_path, tmp_path / "out")
    adapter = tmp_path / "adapter"
    make_adapter(base, adapter, r=2, lora_alpha=4, target_modules=["v_proj"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(dict(config, use_dora=True)))
    with pytest.raises(ValueError, match="DoRA"):
        kvserve.merge_lora(base, adapter, tmp_path / "out")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="new directory"):
        kvserve.merge_lora(base, adapter, base)
    # an adapter made for another shape
    other = checkpoint_factory("LlamaForCausalLM", hidden_size=64, intermediate_size=128)
    with pytest.raises(ValueError, match="base weight"):
        kvserve.merge_lora(other, adapter, tmp_path / "out")
    # and one for a module the base does not have
    tensors = load_file(adapter / "adapter_model.safetensors")
    renamed = {k.replace("v_proj", "w_proj"): v for k, v in tensors.items()}
    save_file(renamed, adapter / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="does not hold"):
        kvserve.merge_lora(base, adapter, tmp_path / "out")
    # the command line reports errors as such
    with pytest.raises(SystemExit) as done:
        cli_main(["merge-lora", "--base", str(base), "--adapter", str(tmp_path / "missing"),
                  "--out", str(tmp_path / "out2")])
    assert done.value.code == 2
