"""Quantized checkpoints end to end: `kvserve quantize` (int8 / fp8 as compressed-tensors, int4 in
AWQ's gemm layout), and GPTQ / compressed-tensors pack-quantized directories made here, generate
token-exactly with transformers running the same model on the weights the files mean, read back
by this file's own unpacking (explicit bit loops after each format's description) or by the
compressed-tensors package."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvserve
from kvserve.quantization.quantize import quantize_checkpoint
from tests.models.test_parity import NUM_GREEDY_TOKENS, PROMPTS, hf_greedy, kvserve_prompt_logits

transformers = pytest.importorskip("transformers")
from kvserve.testing.checkpoints import make_checkpoint  # noqa: E402

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble j of an AWQ int32 holds output 8c + AWQ_ORDER[j]


def nibble(word: int, j: int) -> int:
    return (int(word) >> (4 * j)) & 0xF


def awq_dequantize(t: dict[str, torch.Tensor], module: str, group: int) -> torch.Tensor:
    qweight, qzeros, scales = (t[f"{module}.{x}"] for x in ("qweight", "qzeros", "scales"))
    k, n = qweight.shape[0], qweight.shape[1] * 8
    w = torch.empty(n, k)
    for c in range(n // 8):
        for j in range(8):
            o = 8 * c + AWQ_ORDER[j]
            q = torch.tensor([nibble(x, j) for x in qweight[:, c].tolist()], dtype=torch.float32)
            z = torch.tensor([nibble(x, j) for x in qzeros[:, c].tolist()], dtype=torch.float32)
            s = scales[:, o].float()
            w[o] = (q - z.repeat_interleave(group)) * s.repeat_interleave(group)
    return w


def gptq_dequantize(t: dict[str, torch.Tensor], module: str, group: int) -> torch.Tensor:
    qweight, qzeros, scales = (t[f"{module}.{x}"] for x in ("qweight", "qzeros", "scales"))
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    q = torch.tensor([[nibble(qweight[i // 8, o], i % 8) for o in range(n)] for i in range(k)])
    z = torch.tensor([[nibble(qzeros[g, o // 8], o % 8) + 1 for o in range(n)]
                      for g in range(k // group)])
    g_of = torch.arange(k) // group
    return ((q - z[g_of]) * scales.float()[g_of]).T.contiguous()


def reference_model(original, weights: dict[str, torch.Tensor]):
    """transformers' model of `original` with the given linear weights (by module name)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(original).eval()
    state = model.state_dict()
    for module, w in weights.items():
        assert state[module + ".weight"].shape == w.shape, module
        state[module + ".weight"] = w
    model.load_state_dict(state)
    return model


def assert_same_generation(quantized_dir, model) -> None:
    llm = kvserve.LLM(quantized_dir, dtype=torch.float32, quantized_activation="exact")
    for prompt in PROMPTS:
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(kvserve_prompt_logits(llm, prompt), want, atol=2e-4, rtol=2e-4)
    params = kvserve.SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, NUM_GREEDY_TOKENS)


def write_directory(original, out, tensors: dict[str, torch.Tensor], qc: dict) -> None:
    """A checkpoint directory: `tensors`, original's config with `qc`, original's tokenizer."""
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((original / "config.json").read_text())
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_bytes((original / "tokenizer.json").read_bytes())


def linear_modules(tensors: dict[str, torch.Tensor], suffix: str) -> list[str]:
    return sorted(name.removesuffix(suffix) for name in tensors if name.endswith(suffix))


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("plain"), "LlamaForCausalLM",
                           attention_bias=True)


def meant_weights(t: dict[str, torch.Tensor], method: str) -> dict[str, torch.Tensor]:
    """The weights a `kvserve quantize` file means, by module: int4 (AWQ, groups of 32) or the
    compressed-tensors int8 / fp8 ones."""
    if method == "int4":
        return {m: awq_dequantize(t, m, 32) for m in linear_modules(t, ".qweight")}
    modules = linear_modules(t, ".weight_scale")
    assert t[modules[0] + ".weight"].dtype == (torch.int8 if method == "int8"
                                               else torch.float8_e4m3fn)
    return {m: t[m + ".weight"].float() * t[m + ".weight_scale"].float() for m in modules}


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_quantize_then_generate_matches_transformers_on_the_meaning(original, tmp_path, method):
    out = tmp_path / method
    quantize_checkpoint(original, out, method, group_size=32)
    t = load_file(out / "model.safetensors")
    weights = meant_weights(t, method)
    assert len(weights) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    assert "lm_head.weight" in t and "model.embed_tokens.weight" in t  # kept plain
    assert_same_generation(out, reference_model(original, weights))
    # The quantized model is smaller and reports so.
    plain = kvserve.LLM(original, dtype=torch.float32).model.weight_bytes
    assert kvserve.LLM(out, dtype=torch.float32).model.weight_bytes < plain


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_falcon_h1_multipliers_fold_into_quantized_projections(tmp_path, method):
    """FalconH1's multipliers are folded into its projections at load (fold_falcon_h1):
    quantized ones through their scales, which must give transformers' model on the weights
    the file means."""
    original = make_checkpoint(tmp_path / "plain", "FalconH1ForCausalLM")
    out = tmp_path / method
    quantize_checkpoint(original, out, method, group_size=32)
    weights = meant_weights(load_file(out / "model.safetensors"), method)
    quantized = {m.rpartition(".")[2] for m in weights}
    assert quantized >= {"q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"}
    # int4 keeps the mixer's projections plain: in_proj's 350 rows are not a multiple of 8,
    # out_proj's 120 columns not of the group.
    assert {"in_proj", "out_proj"} <= quantized or method == "int4"
    assert_same_generation(out, reference_model(original, weights))


def test_mamba_mixer_projections_quantize(tmp_path):
    """Mamba's four mixer projections quantized (x_proj's and dt_proj's small ranks too): the
    generation of transformers' model on the weights the file means."""
    original = make_checkpoint(tmp_path / "plain", "MambaForCausalLM")
    out = tmp_path / "int8"
    quantize_checkpoint(original, out, "int8", group_size=32)
    weights = meant_weights(load_file(out / "model.safetensors"), "int8")
    assert {m.rpartition(".")[2] for m in weights} == {"in_proj", "x_proj", "dt_proj", "out_proj"}
    assert_same_generation(out, reference_model(original, weights))


@pytest.mark.parametrize("architecture, experts", [
    ("GptOssForCausalLM", ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    ("GraniteMoeHybridForCausalLM", ["block_sparse_moe.input_linear",
                                     "block_sparse_moe.output_linear"])])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_stacked_experts_stay_plain_beside_quantized_projections(tmp_path, architecture,
                                                                 experts, method):
    """Experts stored stacked over all experts (gpt-oss, Granite 4) are read plain only:
    `kvserve quantize` quantizes the other projections, leaves those tensors as they are and
    names them in the config's list of modules not converted, and the result generates as
    transformers does on the weights the file means."""
    original = make_checkpoint(tmp_path / "plain", architecture)
    out = tmp_path / method
    qc = quantize_checkpoint(original, out, method, group_size=32)
    layers = json.loads((original / "config.json").read_text())["num_hidden_layers"]
    stacked = [f"model.layers.{i}.{e}" for i in range(layers) for e in experts]
    assert set(stacked) <= set(qc.get("ignore") or qc.get("modules_to_not_convert"))
    t, plain = load_file(out / "model.safetensors"), load_file(original / "model.safetensors")
    for name, tensor in plain.items():
        if name.startswith(tuple(stacked)):
            assert torch.equal(t[name], tensor), name
    weights = meant_weights(t, method)
    assert {m.rpartition(".")[2] for m in weights} >= {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert_same_generation(out, reference_model(original, weights))


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_fused_projection_checkpoints_quantize_by_rows(tmp_path, method):
    """Phi-3 keeps q/k/v and gate/up fused: kvserve quantizes them whole (a scale per row) and
    reads each part's rows of the quantized tensor and of its scales; the result generates as
    transformers does on the weights the file means."""
    original = make_checkpoint(tmp_path / "plain", "Phi3ForCausalLM")
    out = tmp_path / method
    quantize_checkpoint(original, out, method)
    weights = meant_weights(load_file(out / "model.safetensors"), method)
    assert {m.rpartition(".")[2] for m in weights} == {"qkv_proj", "o_proj", "gate_up_proj",
                                                     "down_proj"}
    assert_same_generation(out, reference_model(original, weights))


def test_fused_projection_checkpoints_refuse_int4(tmp_path):
    """int4 formats pack a fused projection's outputs in columns, which kvserve does not split:
    it neither writes nor reads them (rather than failing on a missing q_proj)."""
    original = make_checkpoint(tmp_path / "plain", "Phi3ForCausalLM")
    with pytest.raises(ValueError, match="int4 packs outputs in columns"):
        quantize_checkpoint(original, tmp_path / "int4", "int4", group_size=32)
    config = json.loads((original / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                     "desc_act": False}
    (original / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="from plain or 8-bit weights only"):
        kvserve.LLM(original)


def test_compressed_tensors_read_by_its_own_package(original, tmp_path):
    """transformers + compressed-tensors decompress kvserve's fp8 / int8 directories themselves."""
    pytest.importorskip("compressed_tensors")
    for method in ("int8", "fp8"):
        out = tmp_path / method
        quantize_checkpoint(original, out, method)
        qc = transformers.CompressedTensorsConfig(run_compressed=False)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            out, quantization_config=qc, dtype=torch.float32).eval()
        assert_same_generation(out, model)


def test_gptq_directory_loads(original, tmp_path):
    """A GPTQ checkpoint (4 bits, desc_act false, zeros stored minus one), packed here."""
    from kvserve.quantization.formats import pack_int32
    from kvserve.quantization.weights import quantize_int4, unpack_int4

    t = load_file(original / "model.safetensors")
    out = tmp_path / "gptq"
    out.mkdir()
    group, weights = 32, {}
    for name in [n for n in t if n.endswith("_proj.weight")]:
        module = name.removesuffix(".weight")
        q = quantize_int4(t.pop(name), group)
        ints = unpack_int4(q.qweight)                                   # [n, k]
        t[module + ".qweight"] = _pack_along_inputs(ints)
        t[module + ".qzeros"] = pack_int32((q.zeros - 1).to(torch.uint8).T.contiguous())
        t[module + ".scales"] = q.scales.T.contiguous().half()
        t[module + ".g_idx"] = (torch.arange(ints.shape[1]) // group).to(torch.int32)
        weights[module] = gptq_dequantize(t, module, group)
    write_directory(original, out, t, {"quant_method": "gptq", "bits": 4, "group_size": group,
                                       "desc_act": False, "sym": False,
                                       "checkpoint_format": "gptq"})
    assert_same_generation(out, reference_model(original, weights))


def _pack_along_inputs(ints: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight [k / 8, n]: nibble j of row r holds input 8r + j (explicit loop)."""
    n, k = ints.shape
    out = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        out |= ints[:, j::8].T.long() << (4 * j)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def test_compressed_tensors_pack_quantized_loads(original, tmp_path):
    """W4A16 (symmetric int4 per group) packed by the compressed-tensors package itself."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    t = load_file(original / "model.safetensors")
    out = tmp_path / "w4a16"
    out.mkdir()
    group, weights = 32, {}
    for name in [n for n in t if n.endswith("_proj.weight")]:
        module = name.removesuffix(".weight")
        w = t.pop(name)
        n, k = w.shape
        wg = w.view(n, k // group, group)
        scale = wg.abs().amax(dim=2) / 7.5
        q = torch.round(wg / scale[:, :, None]).clamp(-8, 7).to(torch.int8).view(n, k)
        t[module + ".weight_packed"] = helpers.pack_to_int32(q, 4)
        t[module + ".weight_scale"] = scale
        t[module + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        weights[module] = (q.view(n, k // group, group).float() * scale[:, :, None]).view(n, k)
    write_directory(original, out, t, {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": group,
            "symmetric": True}}}, "ignore": ["lm_head"]})
    assert_same_generation(out, reference_model(original, weights))


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "4-bit NF4 / FP4"),
    ({"quant_method": "awq", "version": "gemv", "bits": 4}, "AWQ version 'gemv'"),
    ({"quant_method": "gptq", "bits": 4, "desc_act": True}, "desc_act True"),
])
def test_unsupported_quantization_is_a_clear_error(original, tmp_path, qc, match):
    out = tmp_path / "bad"
    out.mkdir()
    for f in original.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((original / "config.json").read_text())
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match) as e:
        kvserve.LLM(out)
    assert "kvserve loads awq" in str(e.value)


def test_int4_keeps_layers_it_cannot_hold_plain(original, tmp_path):
    """Groups of 96 divide the 96 hidden inputs but not the MLP's 160: down_proj stays plain, and
    the config says so."""
    out = tmp_path / "g96"
    qc = quantize_checkpoint(original, out, "int4", group_size=96)
    assert qc["modules_to_not_convert"] == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    t = load_file(out / "model.safetensors")
    assert "model.layers.0.mlp.down_proj.weight" in t and "model.layers.0.mlp.up_proj.qweight" in t
    weights = {m: awq_dequantize(t, m, 96) for m in linear_modules(t, ".qweight")}
    assert_same_generation(out, reference_model(original, weights))


def test_quantize_rejects_what_it_cannot_write(original, tmp_path):
    with pytest.raises(ValueError, match="--method must be one of"):
        quantize_checkpoint(original, tmp_path / "x", "int3")
    with pytest.raises(ValueError, match="positive multiple of 32"):
        quantize_checkpoint(original, tmp_path / "y", "int4", group_size=48)
    quantize_checkpoint(original, tmp_path / "z", "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(tmp_path / "z", tmp_path / "w", "int8")


def test_model_card_states_the_method_and_perplexity(original, tmp_path):
    from kvserve.perplexity import evaluate_perplexity

    text = tmp_path / "eval.txt"
    text.write_text("ROMEO: what light through yonder window breaks? " * 40)
    quantize_checkpoint(original, tmp_path / "int8", "int8", eval_text=text, eval_tokens=300)
    card = (tmp_path / "int8" / "README.md").read_text()
    assert "--method int8" in card and "compressed-tensors" in card
    line = next(x for x in card.splitlines() if x.startswith("- Perplexity on the first"))
    ppl = {}
    for name, path in (("quantized", tmp_path / "int8"), ("original", original)):
        llm = kvserve.LLM(path)
        ids = llm.tokenizer.encode(text.read_text())[:300]
        ppl[name] = evaluate_perplexity(llm, ids).perplexity
    assert f"{ppl['quantized']:.4f} quantized, {ppl['original']:.4f} original" in line
    quantize_checkpoint(original, tmp_path / "fp8", "fp8")
    assert "not measured" in (tmp_path / "fp8" / "README.md").read_text()


def meaning_of(t: dict[str, torch.Tensor], method: str) -> dict[str, torch.Tensor]:
    """The dequantized weight of every quantized module of a `quantize` output."""
    if method == "int4":
        return {m: awq_dequantize(t, m, 32) for m in linear_modules(t, ".qweight")}
    return {m: t[m + ".weight"].float() * t[m + ".weight_scale"].float()
            for m in linear_modules(t, ".weight_scale")}


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_lm_head_quantized_too_matches_transformers_on_the_meaning(original, tmp_path, method):
    out = tmp_path / method
    quantize_checkpoint(original, out, method, group_size=32, lm_head=True)
    weights = meaning_of(load_file(out / "model.safetensors"), method)
    assert "lm_head" in weights and len(weights) == 2 * 7 + 1
    assert_same_generation(out, reference_model(original, weights))
    head_plain = tmp_path / (method + "-head-plain")
    quantize_checkpoint(original, head_plain, method, group_size=32)
    held = {p: kvserve.LLM(p, dtype=torch.float32).model.weight_bytes for p in (out, head_plain)}
    assert held[out] < held[head_plain]
    assert "--lm-head" in (out / "README.md").read_text()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc.get("lm_head") is True if method == "int4" else "lm_head" not in qc["ignore"]


def test_lm_head_of_a_tied_model_is_untied(tmp_path):
    tied = make_checkpoint(tmp_path / "tied", "LlamaForCausalLM", tie_word_embeddings=True)
    out = tmp_path / "int8"
    quantize_checkpoint(tied, out, "int8", lm_head=True)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    t = load_file(out / "model.safetensors")
    embedding = load_file(tied / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(t["model.embed_tokens.weight"], embedding)  # the lookup stays exact
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tied, tie_word_embeddings=False).eval()
    state = model.state_dict()
    state.update({m + ".weight": w for m, w in meaning_of(t, "int8").items()})
    state["model.embed_tokens.weight"] = embedding
    model.load_state_dict(state)
    assert_same_generation(out, model)


def test_lm_head_takes_weight_only_methods(original, tmp_path):
    with pytest.raises(ValueError, match="--lm-head takes --method int8, fp8, int4, awq"):
        quantize_checkpoint(original, tmp_path / "w8a8", "w8a8", lm_head=True)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_embeddings_quantized_too_read_by_compressed_tensors(tmp_path, method, tied):
    """--embeddings: compressed-tensors targets Embedding too; transformers + compressed-tensors
    decompress the same directory (a tied head is that embedding); kvserve holds it quantized."""
    pytest.importorskip("compressed_tensors")
    source = make_checkpoint(tmp_path / "plain", "LlamaForCausalLM", tie_word_embeddings=tied)
    out = tmp_path / method
    quantize_checkpoint(source, out, method, embeddings=True)
    t = load_file(out / "model.safetensors")
    assert t["model.embed_tokens.weight"].dtype == (torch.int8 if method == "int8"
                                                    else torch.float8_e4m3fn)
    assert ("lm_head.weight" in t) != tied
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert config["quantization_config"]["config_groups"]["group_0"]["targets"] == [
        "Linear", "Embedding"]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False),
        dtype=torch.float32).eval()
    plain = load_file(source / "model.safetensors")["model.embed_tokens.weight"]
    assert not torch.equal(model.model.embed_tokens.weight, plain)  # the rounded rows
    assert_same_generation(out, model)
    held = {p: kvserve.LLM(p, dtype=torch.float32).model.weight_bytes
            for p in (out, source)}
    rows = plain.numel() * (4 - 1)  # fp32 rows become one byte each (and a scale per row)
    assert held[out] < held[source] - rows
    card = (out / "README.md").read_text()
    assert "--embeddings" in card and "input embedding is quantized too" in card


def test_embeddings_take_compressed_tensors_methods(original, tmp_path):
    with pytest.raises(ValueError, match="--embeddings takes --method int8, fp8"):
        quantize_checkpoint(original, tmp_path / "int4", "int4", embeddings=True)


def test_int4_embedding_of_compressed_tensors_loads(original, tmp_path):
    """An int4 embedding (asymmetric, groups of 32) that a compressed-tensors group targets by
    name: each lookup dequantizes its rows, as transformers' model on the same values."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    t = load_file(original / "model.safetensors")
    out = tmp_path / "w4a16-embedding"
    out.mkdir()
    group, weights = 32, {}
    for name in [n for n in t if n.endswith("_proj.weight")] + ["model.embed_tokens.weight"]:
        module = name.removesuffix(".weight")
        w = t.pop(name)
        n, k = w.shape
        wg = w.view(n, k // group, group)
        low, high = wg.amin(dim=2), wg.amax(dim=2)
        scale = (high - low) / 15
        zero = torch.round(-low / scale).clamp(0, 15)
        q = (torch.round(wg / scale[:, :, None]) + zero[:, :, None]).clamp(0, 15) - 8
        t[module + ".weight_packed"] = helpers.pack_to_int32(q.to(torch.int8).view(n, k), 4)
        t[module + ".weight_scale"] = scale
        t[module + ".weight_zero_point"] = helpers.pack_to_int32(
            (zero - 8).to(torch.int8), 4, packed_dim=0)
        t[module + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        weights[module] = ((q - (zero - 8)[:, :, None]) * scale[:, :, None]).view(n, k)
    write_directory(original, out, t, {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear", "re:.*embed_tokens$"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": group,
            "symmetric": False}}}, "ignore": ["lm_head"]})
    assert_same_generation(out, reference_model(original, weights))


def write_mxfp4_checkpoint(plain, out):
    """The plain gpt-oss checkpoint with its experts in MXFP4, as the released ones store them:
    <proj>_blocks [experts, out, in / 32, 16] and <proj>_scales [experts, out, in / 32] (the
    plain tensors are [experts, in, out]), and quantization_config mxfp4."""
    from kvserve.quantization import mxfp4

    out.mkdir()
    for f in plain.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(plain / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(tensors.pop(name).transpose(1, 2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_gpt_oss_mxfp4_experts_match_transformers_dequantization(tmp_path):
    """gpt-oss's MXFP4 experts, dequantized at load, give transformers' model on its own
    dequantization of the same file: logits and greedy tokens; the weights cost what plain
    weights of the model's dtype do."""
    plain = make_checkpoint(tmp_path / "plain", "GptOssForCausalLM", intermediate_size=64)
    path = write_mxfp4_checkpoint(plain, tmp_path / "mxfp4")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    llm = kvserve.LLM(path, dtype=torch.float32)
    for prompt in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
        ours = kvserve_prompt_logits(llm, prompt)
        assert (ours - want).abs().max() / want.abs().max() < 1e-5
    params = kvserve.SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NUM_GREEDY_TOKENS)
    # Rounded to FP4, the experts differ from the plain model's: the file was read as MXFP4.
    plain_llm = kvserve.LLM(plain, dtype=torch.float32)
    assert not torch.equal(kvserve_prompt_logits(plain_llm, PROMPTS[0]),
                           kvserve_prompt_logits(llm, PROMPTS[0]))
    assert llm.model.weight_bytes == plain_llm.model.weight_bytes


def test_mxfp4_round_trip_and_refusals(tmp_path):
    from kvserve.quantization import mxfp4

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 64, generator=g) * torch.logspace(-3, 3, 5)[None, :, None]
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    back = mxfp4.dequantize(blocks, scales, torch.float32)
    # A block's scale s < top / 3 (top scaled into (3, 6]); E2M1's widest gap, 4 to 6, rounds
    # within s.
    top = w.abs().unflatten(-1, (2, 32)).amax(-1, keepdim=True)
    assert ((back - w).abs().unflatten(-1, (2, 32)) <= top / 3).all()
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(back), torch.float32), back)
    with pytest.raises(ValueError, match="do not match scales"):
        mxfp4.dequantize(blocks, scales[..., :1], torch.float32)
    llama = make_checkpoint(tmp_path / "llama", "LlamaForCausalLM")
    config = json.loads((llama / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MXFP4 weights as gpt-oss's experts only"):
        kvserve.LLM(llama)
