"""GGUF files load as they are: tiny Llama models written by the gguf package (llama.cpp's own
writer, the converter's q/k row permutation applied) in F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q4_K, Q5_K and Q6_K, against transformers reading the same file (`gguf_file=`, which dequantizes
it with the gguf package): logits and greedy tokens, and the tokenizer's ids; each block type's
conversion against the gguf package's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import kvserve
from kvserve.quantization.gguf_blocks import BLOCKS, to_quantized
from kvserve.loader import load_weights
from kvserve.testing import reference
from tests.models.test_parity import NUM_GREEDY_TOKENS, PROMPTS, hf_greedy, kvserve_prompt_logits

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from kvserve.testing.checkpoints import make_checkpoint  # noqa: E402

T = gguf.GGMLQuantizationType
# K-quants need rows that are multiples of 256 inputs.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=384)
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


def random_blocks(kind: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Valid blocks of a type the gguf package cannot quantize to (K-quants): random bits, with
    fp16 scales that keep the weights ~0.1."""
    size, nbytes = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // size, nbytes), dtype=np.uint8)
    scale_at = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[kind]
    for offset in scale_at:  # d (and dmin) as small positive fp16 numbers
        values = rng.uniform(1e-4, 4e-4, size=(rows, k // size)).astype(np.float16)
        raw[..., offset:offset + 2] = values.view(np.uint8).reshape(rows, k // size, 2)
    return raw.reshape(rows, -1)


def encode(weight: torch.Tensor, kind: str, seed: int) -> tuple[np.ndarray, object]:
    """(data, raw dtype) of a weight [n, k] stored as `kind`."""
    w = weight.float().numpy()
    if kind == "F32":
        return w, T.F32
    if kind == "F16":
        return w.astype(np.float16), T.F16
    if kind in ("BF16", "Q8_0", "Q4_0", "Q4_1"):
        return gguf.quants.quantize(w, T[kind]), T[kind]
    return random_blocks(kind, w.shape[0], w.shape[1], seed), T[kind]


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py permutation of q / k rows (each head's halves
    interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary of `size` pieces: <unk>, <s>, </s>, 256 byte pieces,
    then letters and some of their pairs with a leading U+2581."""
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    pieces = ["\u2581", *letters] + [f"\u2581{c}" for c in letters] + [
        a + b for a in "etaoinsh" for b in "etaoinsh"]
    for piece in pieces:
        if len(tokens) == size:
            break
        tokens.append(piece)
        types.append(1)
    while len(tokens) < size:
        tokens.append(f"\u2581w{len(tokens)}")
        types.append(1)
    scores = [0.0] * 259 + [-float(i) for i in range(size - 259)]
    return tokens, scores, types


BYTE_LEVEL_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def byte_level_vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, types, merges) of a byte-level BPE of `size` tokens as a Llama 3 GGUF file
    holds it: trained by the tokenizers package on Python's own json sources, split the Llama 3
    way; three control tokens first."""
    import inspect
    import json
    import json.decoder
    import json.encoder

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from kvserve.loader.gguf_tokenizer import _LLAMA3_SPLIT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=BYTE_LEVEL_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [inspect.getsource(m) for m in (json, json.decoder, json.encoder)]
    tok.train_from_iterator(text, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    assert len(tokens) == size
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in BYTE_LEVEL_SPECIALS else 1 for t in tokens]
    return tokens, types, merges


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """Each RoPE frequency's divisor as llama.cpp's convert_hf_to_gguf.py writes it for Llama 3's
    rope_scaling (Meta's published formula: the factor for wavelengths above
    original_max_position_embeddings / low_freq_factor, 1 below it / high_freq_factor, a smooth
    step between)."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    context = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(plain, path, kinds: dict[str, str], tied: bool = False,
               chat_template: str | None = None, tokenizer: str = "llama") -> None:
    """plain's weights as a GGUF file; kinds: GGUF tensor type per HF module suffix
    (q_proj, down_proj, embed_tokens, lm_head, ...), F32 otherwise; tokenizer: a SentencePiece
    vocabulary ("llama") or Llama 3's byte-level BPE ("gpt2")."""
    config = transformers.AutoConfig.from_pretrained(plain)
    state = load_file(plain / "model.safetensors")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta if hasattr(config, "rope_theta") else
                              config.rope_parameters["rope_theta"])
    if tokenizer == "gpt2":
        tokens, types, merges = byte_level_vocabulary(config.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("llama-bpe")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
    else:
        tokens, scores, types = vocabulary(config.vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type") == "llama3":
        head_dim = config.hidden_size // config.num_attention_heads
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim))
    seed = 0
    for name, t in state.items():
        if tied and name == "lm_head.weight":
            continue
        module, _, kind = name.rpartition(".")  # kind: weight or bias
        suffix = module.rpartition(".")[2]
        if name.startswith("model.layers."):
            layer, rest = module.removeprefix("model.layers.").split(".", 1)
            out = f"blk.{layer}.{LAYER[rest]}.{kind}"
        else:
            out = {"model.embed_tokens.weight": "token_embd.weight",
                   "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[name]
        if suffix == "q_proj":
            t = permute(t, config.num_attention_heads)
        elif suffix == "k_proj":
            t = permute(t, config.num_key_value_heads)
        seed += 1
        if t.dim() == 1:
            writer.add_tensor(out, t.float().numpy())
            continue
        data, raw = encode(t, kinds.get(suffix, "F32"), seed)
        writer.add_tensor(out, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("plain"), "LlamaForCausalLM", **SHAPE)


def check_against_transformers(path, activation: str = "exact") -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
    assert_generates_as(kvserve.LLM(path, dtype=torch.float32, quantized_activation=activation),
                        model)


def assert_generates_as(llm, model, tolerance: float = 3e-4) -> None:
    """The prompts' logits (within `tolerance`) and greedy tokens of `llm` and a transformers
    model."""
    for prompt in PROMPTS:
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(kvserve_prompt_logits(llm, prompt), want, atol=tolerance,
                                   rtol=tolerance)
    params = kvserve.SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, NUM_GREEDY_TOKENS)


# q/k/v of one layer in different types: the fused projection is held in parts, each in its own
# layout (q and k stacked where they share one).
MIXES = {
    "f32": {},
    "f16-bf16": {"q_proj": "F16", "k_proj": "F16", "v_proj": "BF16", "o_proj": "BF16",
                 "gate_proj": "F16", "up_proj": "F16", "down_proj": "BF16"},
    "q8_0": {m: "Q8_0" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj", "lm_head", "embed_tokens")},
    "q4_0-q4_1": {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q4_1", "o_proj": "Q4_1",
                  "gate_proj": "Q4_0", "up_proj": "Q4_1", "down_proj": "Q4_0",
                  "lm_head": "Q4_0"},
    "q4_k_m": {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K",
               "gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K", "lm_head": "Q6_K",
               "embed_tokens": "Q4_K"},
    "q5_k": {m: "Q5_K" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj")},
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_gguf_generates_as_transformers_reads_it(plain, tmp_path, mix):
    path = tmp_path / f"model-{mix}.gguf"
    write_gguf(plain, path, MIXES[mix])
    check_against_transformers(path)
    info = kvserve.LLM(path).config.quantization
    assert info.scheme == ("none" if mix in ("f32", "f16-bf16") else "mixed")


def test_fused_projection_in_parts_with_a_bias(tmp_path):
    """q/k/v with biases in a Q4_K_M file: the fused projection is held in two parts (q/k in
    Q4_K, v in Q6_K), each with its rows of the bias; logits as transformers reads the file
    (within 5e-3: biases of ~1.5 make the fp32 sums of either side larger than the other tests')
    and greedy tokens equal."""
    plain = make_checkpoint(tmp_path / "plain", "LlamaForCausalLM", attention_bias=True, **SHAPE)
    path = tmp_path / "model-bias.gguf"
    write_gguf(plain, path, MIXES["q4_k_m"])
    llm = kvserve.LLM(path, dtype=torch.float32, quantized_activation="exact")
    config = llm.model.config
    weights = load_weights(path, config, torch.float32)
    assert "layers.0.self_attn.qkv_proj.qweight" not in weights
    assert weights["layers.0.self_attn.qkv_proj.parts.0.qweight"].dtype == torch.uint8  # Q4_K
    assert weights["layers.0.self_attn.qkv_proj.parts.1.qweight"].dtype == torch.int8  # Q6_K
    assert "layers.0.self_attn.qkv_proj.parts.2.qweight" not in weights
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, torch_dtype=torch.float32).eval()
    assert_generates_as(llm, model, tolerance=5e-3)


def test_q4_0_zero_is_held_once(plain, tmp_path):
    """Q4_0's zero 8, the same in every block, is kept once by the engine's layers: each Q4_0
    projection (and the head) is held at the file's 18 bytes a block, and the model generates as
    transformers reads the file (the integer kernels on a single zero:
    tests/kernels/test_quantized_linear_int8_input.py)."""
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "lm_head")
    path = tmp_path / "model-q4_0.gguf"
    write_gguf(plain, path, {m: "Q4_0" for m in projections})
    check_against_transformers(path)
    want = sum(t.numel() * 18 // 32 if name.split(".")[-2] in projections else t.numel() * 4
               for name, t in load_file(plain / "model.safetensors").items())
    llm = kvserve.LLM(path, dtype=torch.float32)
    assert want <= llm.model.weight_bytes <= want + 2 * 16  # and a 2-byte zero a projection


def test_k_quants_are_held_two_level(plain, tmp_path):
    """Q4_K and Q6_K projections are held at their integer scales and minimums under fp16 factors
    (tests/kernels/test_quantized_linear_two_level.py): 148 bytes a super-block of 256 Q4_K
    weights (the file's 144), 274 for Q6_K (int8 q; the file's 210), a fused q/k/v so too, in
    parts (q/k in Q4_K, v in Q6_K); the model generates as transformers reads the file."""
    path = tmp_path / "model-q4_k_m.gguf"
    kinds = MIXES["q4_k_m"]
    write_gguf(plain, path, kinds)
    check_against_transformers(path)
    per_256 = {"Q4_K": 148, "Q6_K": 274}
    want = embedding = 0
    for name, t in load_file(plain / "model.safetensors").items():
        module = name.split(".")[-2]
        held = t.numel() * per_256.get(kinds.get(module), 1024) // 256
        want += held
        embedding += held if module == "embed_tokens" else 0
    model = kvserve.LLM(path, dtype=torch.float32).model
    assert model.weight_bytes == want
    assert model.embedding_bytes == embedding  # Q4_K, held as the file stores it


def round_projection_inputs(model, kinds: dict[str, str], tied: bool) -> None:
    """transformers' model with each quantized projection's input rounded to int8 blocks as
    kvserve's int8-input path rounds it (reference.round_input_to_int8_blocks; groups of 32, of
    16 for Q6_K); a tied head is the embedding's type."""
    for name, module in model.named_modules():
        short = name.split(".")[-1]
        kind = kinds.get("embed_tokens" if short == "lm_head" and tied else short)
        if not isinstance(module, torch.nn.Linear) or kind is None:
            continue
        group = 16 if kind == "Q6_K" else 32

        def hook(_, args, group=group):
            x = args[0]
            rounded = reference.round_input_to_int8_blocks(x.reshape(-1, x.shape[-1]), group)
            return (rounded.reshape(x.shape).to(x.dtype),)
        module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("mix", ["q4_0-q4_1", "q4_k_m"])
@pytest.mark.parametrize("tied", [True, False])
def test_gguf_with_int8_inputs(plain, tmp_path, mix, tied):
    """The default int8-input path (a Q4_K_M file's q/k/v in parts: each rounds its input in its
    own blocks), tied head or not, against transformers' reading of the file with the same
    rounding of each projection's input."""
    path = tmp_path / "model.gguf"
    write_gguf(plain, path, MIXES[mix], tied=tied)
    llm = kvserve.LLM(path, dtype=torch.float32)
    assert llm.config.tie_word_embeddings == tied
    assert llm.config.quantization.activation == "int8"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, torch_dtype=torch.float32).eval()
    round_projection_inputs(model, MIXES[mix], tied)
    with torch.no_grad():
        want = model(torch.tensor([PROMPTS[0]])).logits[0]
    got = kvserve_prompt_logits(llm, PROMPTS[0])
    # Within 1% (measured 3e-7 to 3e-3: a few inputs round the other way after fp32 sums in
    # another order); without the rounding in transformers, 4-5%, as with any one projection's
    # input rounded in the wrong blocks.
    assert (got - want).norm() <= 1e-2 * want.norm()


def test_gguf_tokenizer_encodes_as_transformers_does(plain, tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(plain, path, {})
    ours = kvserve.LLM(path).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ("the cat sat on a mat", "aeiou then shine", "tot, a tie\nsea 42 é"):
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text)["input_ids"],
                                                                 skip_special_tokens=True)


def test_gguf_byte_level_tokenizer_encodes_as_transformers_does(plain, tmp_path):
    """Llama 3's tokenizer model (gpt2: byte-level BPE with merges, split by the llama-bpe
    expression, control tokens special, the BOS prepended) against transformers' reading."""
    path = tmp_path / "model-llama3.gguf"
    write_gguf(plain, path, {}, tokenizer="gpt2")
    llm = kvserve.LLM(path, dtype=torch.float32)
    ours = llm.tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = ("def encode(self, o):\n    return 'x' if o else None",
             "  It's 12345 items, isn't it?\r\n\n\tdone  ",
             "naïve café — 日本 🙂", "<|eot_id|>after a control token", "")
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ids[0] == 0  # <|begin_of_text|>
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == (
            text.replace("<|eot_id|>", ""))
    assert "<|eot_id|>" not in ours.decode(ours.encode("<|eot_id|>x"))
    # The model's config and weights read as the SentencePiece file's do.
    check_against_transformers(path)


def test_gguf_llama3_rope_freqs(tmp_path):
    """Llama 3.1's RoPE scaling, which a GGUF file carries as the rope_freqs tensor, read back as
    rope_scaling llama3: kvserve on the file generates as transformers on the Hugging Face
    directory it was written from."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    hf = make_checkpoint(tmp_path / "hf", "LlamaForCausalLM", rope_theta=500000.0,
                         rope_scaling=rope, **SHAPE)
    path = tmp_path / "gguf" / "model.gguf"
    path.parent.mkdir()
    write_gguf(hf, path, {})
    llm = kvserve.LLM(path, dtype=torch.float32)
    scaling = llm.config.rope_scaling
    assert scaling.rope_type == "llama3" and scaling.factor == 8.0
    assert scaling.original_max_position_embeddings == 256
    assert_generates_as(
        llm, transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval())
    from kvserve.loader.gguf_checkpoint import llama3_rope_scaling

    assert llama3_rope_scaling(np.linspace(1.0, 3.0, 32), 500000.0, 64) is None  # not a step


def test_gguf_chat_template_and_special_tokens(plain, tmp_path):
    from kvserve.server.chat_template import ChatTemplate

    path = tmp_path / "chat.gguf"
    write_gguf(plain, path, {}, chat_template="{{ bos_token }}{% for m in messages %}"
                                              "[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    template = ChatTemplate.from_model_dir(path)
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>[user] hi"
    plain_file = tmp_path / "plain.gguf"
    write_gguf(plain, plain_file, {})
    assert ChatTemplate.from_model_dir(plain_file) is None


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_block_types_mean_what_the_gguf_package_reads(kind):
    rows, k = 6, 512
    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        w = np.random.default_rng(1).normal(size=(rows, k)).astype(np.float32)
        data = gguf.quants.quantize(w, T[kind])
    else:
        data = random_blocks(kind, rows, k, 2)
    want = torch.from_numpy(gguf.quants.dequantize(data, T[kind]).reshape(rows, k))
    q = to_quantized(data, kind, rows, k)
    got = q.dequantize()
    torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=1e-5)
    # and so does its one-level form (what CUDA takes)
    torch.testing.assert_close(q.one_level().dequantize(), want,
                               atol=1e-6 * want.abs().max().item(), rtol=1e-5)
    # Q8_0 / Q4_0 keep the file's fp16 scales (and Q4_0 an fp16 zero 8 a block here, which the
    # engine's layers keep once: test_q4_0_zero_is_held_once): 34 and 20 bytes a block; the
    # K-quants their integer scales and minimums (a byte each) under the fp16 d and dmin
    if kind == "Q4_1":
        assert q.scales.dtype == q.zeros.dtype == torch.float32
        return
    two_level = kind.endswith("_K")
    assert q.scales.dtype == (torch.int8 if two_level else torch.float16)
    assert two_level == (q.super_scales is not None)
    assert q.super_scales is None or q.super_scales.dtype == torch.float16
    parts = (q.qweight, q.scales, q.zeros, q.super_scales, q.super_mins)
    nbytes = sum(t.nbytes for t in parts if t is not None)
    per_256 = {"Q8_0": 272, "Q4_0": 160, "Q4_K": 148, "Q5_K": 276, "Q6_K": 274}[kind]
    assert nbytes == rows * k // 256 * per_256


def test_flat_sub_blocks_keep_their_value():
    """A K-quant sub-block with scale 0 and a minimum is one constant value."""
    data = random_blocks("Q4_K", 1, 256, 3)
    data[0, 4] &= 0xC0  # sub-block 0's 6-bit scale = 0 (its minimum stays)
    want = torch.from_numpy(gguf.quants.dequantize(data, T.Q4_K).reshape(1, 256))
    got = to_quantized(data, "Q4_K", 1, 256).dequantize()
    assert want[0, :32].unique().numel() == 1
    torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=1e-5)


def test_unsupported_gguf_is_a_clear_error(tmp_path):
    odd = tmp_path / "odd.gguf"  # a tensor of a type kvserve does not read
    writer = gguf.GGUFWriter(str(odd), "llama")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_q.weight",
                      gguf.quants.quantize(np.ones((8, 32), np.float32), T.Q5_0), raw_dtype=T.Q5_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from kvserve.loader.gguf_checkpoint import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(odd)
    with pytest.raises(ValueError, match="is Q5_0; kvserve reads F32, F16, BF16, Q8_0"):
        checkpoint.quantized_weight("model.layers.0.self_attn.q_proj.weight")
    other = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported in GGUF"):
        kvserve.LLM(other)
