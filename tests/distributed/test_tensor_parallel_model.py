"""A model split over two ranks (kvserve.loader.sharding; Gloo, one thread per rank) gives the
logits of the whole model at every position (fp32, tight tolerance): GQA, key/value heads
replicated when there are fewer than ranks, biases (Qwen2), tied embeddings and sliding windows
with soft-caps (Gemma 2), head norms (Qwen3), a vocabulary 2 does not divide, mixtures of
experts (Mixtral, Qwen3-MoE: each expert split by intermediate column), a layer that reads an
earlier layer's KV (CLA), multi-head latent attention with its experts (DeepSeek-V2 / V3: by
head, the latent replicated), OLMo 2's q/k norms over all heads (sums of squares summed over
the ranks), gpt-oss's stacked experts with their biases and its sinks,
quantized checkpoints (int8, fp8, int4 in groups, quantized experts;
LLM.int8() within its per-rank rounding). Each rank holds half of every projection and of the
vocabulary's rows; what cannot be split yet is a clear error."""

from __future__ import annotations

import pytest
import torch

from kvserve import _C
from kvserve.config import load_checkpoint_info
from kvserve.distributed import ParallelGroups
from kvserve.loader.safetensors_loader import load_weights
from kvserve.loader.sharding import Shard, shard_config
from kvserve.quantization.quantize import quantize_checkpoint
from kvserve.quantization.weights import quantize_fp8, quantize_int4, quantize_int8
from kvserve.testing.checkpoints import make_checkpoint
from kvserve.testing.cla import make_cla_checkpoint
from kvserve.testing.ranks import RankPool

PROMPT = [1, 17, 5, 99, 42, 7, 300, 12, 8, 3, 250, 64]

CASES = {
    "llama-gqa": ("LlamaForCausalLM", {}),
    "llama-one-kv-head": ("LlamaForCausalLM", dict(num_key_value_heads=1, vocab_size=383)),
    "qwen2-biases": ("Qwen2ForCausalLM", {}),
    "qwen3-head-norms": ("Qwen3ForCausalLM", {}),
    "gemma2-tied-sliding": ("Gemma2ForCausalLM", {}),
    "mixtral-moe": ("MixtralForCausalLM", {}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {}),
    "cla-shared-kv": ("CLA", dict(kv_sharing={1: 0})),  # layer 1 reads layer 0's KV
    "deepseek-v2-mla-moe": ("DeepseekV2ForCausalLM", {}),
    "deepseek-v3-mla-moe": ("DeepseekV3ForCausalLM", {}),
    "cohere2-parallel-block": ("Cohere2ForCausalLM", {}),  # LayerNorms, NoPE global layers
    "phi3-fused-checkpoint": ("Phi3ForCausalLM", {}),  # each rank reads its rows of qkv_proj
    # Stacked, transposed, interleaved experts with biases (the down bias on rank 0), sinks.
    "gpt-oss-stacked-experts": ("GptOssForCausalLM", {}),
    # q/k norms over all heads: each rank's sums of squares summed over the ranks, with the key
    # heads split and with one replicated on both.
    "olmo2-full-width-norms": ("Olmo2ForCausalLM", {}),
    "olmo2-one-kv-head": ("Olmo2ForCausalLM", dict(num_key_value_heads=1)),
}


def _logits(groups: ParallelGroups, path, shard: Shard | None) -> dict:
    info = load_checkpoint_info(path)
    config = info.config
    local = config if shard is None else shard_config(config, shard)
    weights = load_weights(path, config, torch.float32, shard=shard)
    communicator = None if shard is None else groups.device_communicator()
    model = _C.create_causal_lm(local, weights, 64, communicator)
    caches = _C.KVCache.for_model(1, len(PROMPT), local)
    logits = model(torch.tensor([PROMPT]), caches)[0]
    projections = sum(t.numel() for name, t in weights.items()
                      if "_proj" in name and name.endswith(".weight"))
    quantized = sum(t.numel() for name, t in weights.items() if name.endswith(".qweight"))
    latent = sum(t.numel() for name, t in weights.items()  # MLA's, replicated
                 if "kv_a_proj" in name or "q_a_proj" in name)
    return dict(logits=logits, projections=projections, quantized=quantized, latent=latent,
                heads=local.num_heads,
                kv_heads=local.num_kv_heads, intermediate=local.intermediate_size,
                vocab_rows=weights["embed_tokens.weight"].shape[0],
                embedding=weights["embed_tokens.weight"].clone(),
                lm_head=weights["lm_head.weight"].clone() if "lm_head.weight" in weights else None)


def _sharded(groups: ParallelGroups, path) -> dict:
    return _logits(groups, path, Shard(groups.rank, groups.world_size))


@pytest.fixture(scope="module")
def ranks():
    """Two ranks for every case of the module (each new rank costs seconds of imports)."""
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: make_cla_checkpoint(tmp_path_factory.mktemp(name), **overrides)
            if arch == "CLA" else make_checkpoint(tmp_path_factory.mktemp(name), arch, **overrides)
            for name, (arch, overrides) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_whole_models_logits(ranks, checkpoints, case):
    path = checkpoints[case]
    whole = _logits(ParallelGroups(0, 1, "gloo"), path, None)
    config = load_checkpoint_info(path).config
    for rank, part in enumerate(ranks.run(_sharded, args=(path,))):
        torch.testing.assert_close(part["logits"], whole["logits"], rtol=1e-5, atol=1e-5,
                                   msg=f"rank {rank}")
        assert part["heads"] == config.num_heads // 2
        assert part["kv_heads"] == max(1, config.num_kv_heads // 2)
        assert part["intermediate"] == config.intermediate_size // 2
        # Each rank holds half of every projection, plus its share of replicated K/V heads
        # (MLA: the whole of the latent projections).
        replicated = 1 if config.num_kv_heads < 2 else 0
        extra = replicated * 2 * config.head_dim * config.hidden_size * config.num_layers // 2
        assert part["latent"] == whole["latent"]
        assert part["projections"] == ((whole["projections"] - whole["latent"]) // 2 + extra
                                       + whole["latent"]), rank
        # The embedding and the LM head by vocabulary row: ceil(vocab / 2) rows, zero past it.
        rows = -(-config.vocab_size // 2)
        assert part["vocab_rows"] == rows
        held = min(rows, config.vocab_size - rank * rows)
        for name in ("embedding", "lm_head"):
            if whole[name] is None:
                continue
            assert torch.equal(part[name][:held], whole[name][rank * rows:rank * rows + held])
            assert not part[name][held:].any()


@pytest.mark.parametrize("architecture, overrides, message", [
    ("LlamaForCausalLM", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96),
     "must divide the 6"),
    ("LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4,
                              intermediate_size=161), "must divide the intermediate size 161"),
])
def test_what_cannot_be_split_is_a_clear_error(tmp_path, architecture, overrides, message):
    path = make_checkpoint(tmp_path, architecture, **overrides)
    config = load_checkpoint_info(path).config
    with pytest.raises(ValueError, match=message):
        shard_config(config, Shard(0, 4))
    with pytest.raises(ValueError, match=message):
        load_weights(path, config, torch.float32, shard=Shard(1, 4))


def test_latent_attention_splits_by_head(checkpoint_factory):
    config = load_checkpoint_info(checkpoint_factory("DeepseekV2ForCausalLM")).config
    assert shard_config(config, Shard(0, 2)).num_heads == config.num_heads // 2
    assert shard_config(config, Shard(0, 1)).num_heads == config.num_heads
    with pytest.raises(ValueError, match="0 <= rank < size"):
        Shard(2, 2)


def test_experts_split_by_intermediate_column(checkpoint_factory):
    config = load_checkpoint_info(checkpoint_factory("Qwen3MoeForCausalLM")).config
    local = shard_config(config, Shard(1, 2))
    assert local.moe.moe_intermediate_size == config.moe.moe_intermediate_size // 2
    assert local.moe.num_experts == config.moe.num_experts
    assert config.moe.moe_intermediate_size == 48  # the whole config is left as it was
    with pytest.raises(ValueError, match="expert intermediate size 48"):
        shard_config(config, Shard(0, 5))


# (architecture, method, group size): shapes whose row-parallel inputs split into whole groups.
QUANTIZED = {
    "int8": ("LlamaForCausalLM", "int8", 128),
    "fp8": ("Qwen2ForCausalLM", "fp8", 128),
    "int4-g32": ("LlamaForCausalLM", "int4", 32),
    "int4-g64-experts": ("Qwen3MoeForCausalLM", "int4", 64),
    "llm.int8": ("LlamaForCausalLM", "llm.int8", 128),
    "fp8-fused-by-rows": ("Phi3ForCausalLM", "fp8", 128),  # each rank's rows of each part
}


def _quantized_checkpoint(tmp_path, arch, method, group_size):
    sizes = dict(hidden_size=128, intermediate_size=256)
    if arch == "Qwen3MoeForCausalLM":
        sizes.update(moe_intermediate_size=128)
    plain = make_checkpoint(tmp_path / "plain", arch, **sizes)
    quantize_checkpoint(plain, tmp_path / "quantized", method, group_size)
    return tmp_path / "quantized"


@pytest.mark.parametrize("case", list(QUANTIZED))
def test_quantized_checkpoints_split_with_their_scales(ranks, tmp_path, case):
    path = _quantized_checkpoint(tmp_path, *QUANTIZED[case])
    whole = _logits(ParallelGroups(0, 1, "gloo"), path, None)
    assert whole["quantized"] > 0
    for rank, part in enumerate(ranks.run(_sharded, args=(path,))):
        assert part["quantized"] == whole["quantized"] // 2, rank
        if case == "llm.int8":  # activations rounded per token over each rank's inputs
            error = (part["logits"] - whole["logits"]).abs().max()
            assert error <= 0.05 * whole["logits"].abs().max(), rank
        else:
            torch.testing.assert_close(part["logits"], whole["logits"], rtol=1e-4, atol=1e-4,
                                       msg=f"rank {rank}")


def test_int4_groups_a_rank_would_cut_are_a_clear_error(tmp_path):
    path = _quantized_checkpoint(tmp_path, "LlamaForCausalLM", "int4", 64)
    config = load_checkpoint_info(path).config
    with pytest.raises(ValueError, match="o_proj: a tensor-parallel rank's 32 inputs .* groups "
                                         "of 64"):
        load_weights(path, config, torch.float32, shard=Shard(1, 4))
    # One group a row (per-channel int8) splits anywhere: each rank keeps the row's scale.
    path = _quantized_checkpoint(tmp_path / "int8", "LlamaForCausalLM", "int8", 128)
    held = load_weights(path, config, torch.float32, shard=Shard(1, 4))
    assert held["layers.0.self_attn.o_proj.qweight"].shape == (128, 32)
    assert held["layers.0.self_attn.o_proj.scales"].shape == (128, 1)


@pytest.mark.parametrize("fmt, group_size", [("int8", None), ("int8", 32), ("int4", 32),
                                             ("int4", 64), ("int4", 256), ("fp8", None)])
def test_a_narrowed_quantized_weight_is_the_same_part_of_the_weight(fmt, group_size):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0))
    q = {"int8": lambda: quantize_int8(w, group_size or 256),
         "int4": lambda: quantize_int4(w, group_size), "fp8": lambda: quantize_fp8(w)}[fmt]()
    whole = q.dequantize()
    for dim, start, length in [(0, 16, 16), (0, 0, 48), (1, 128, 128), (1, 0, 64)]:
        part = q.narrow(dim, start, length)
        expected = whole.narrow(dim, start, length)
        assert part.shape == expected.shape
        torch.testing.assert_close(part.dequantize(), expected, rtol=0, atol=0)
    if fmt == "int4" or group_size:  # 16 inputs: half a group, or half an int4 chunk
        with pytest.raises(ValueError, match="x.proj: a tensor-parallel rank's 16 inputs"):
            q.narrow(1, 16, 16, name="x.proj")
    else:  # one scale a row: any cut
        torch.testing.assert_close(q.narrow(1, 16, 16).dequantize(), whole[:, 16:32], rtol=0,
                                   atol=0)
