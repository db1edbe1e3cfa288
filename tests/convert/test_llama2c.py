"""`python -m kvserve convert llama2c` on llama2.c's trained stories260K, checked three independent
ways: transformers runs the converted directory like kvserve; a numpy llama2.c (run.c's forward,
reading the .bin itself) decodes like kvserve; a transcription of llama2.c's encode() tokenizes
TinyStories like the converted tokenizer.json. Plus an untied random checkpoint and bad input."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

import kvserve
from kvserve.cli import main as cli_main
from kvserve.convert import convert_llama2c
from tests.conftest import SHARED_DATA

transformers = pytest.importorskip("transformers")

DATA_DIR = SHARED_DATA
CHECKPOINT = DATA_DIR / "stories260K" / "stories260K.bin"
TOKENIZER = DATA_DIR / "stories260K" / "tok512.bin"
VALID_TEXT = DATA_DIR / "tinystories-sample" / "TinyStories-valid.txt"

PROMPTS = ["Once upon a time", "Lily and Tom went to the park.", "The little dog was sad because"]
NUM_GREEDY_TOKENS = 40
LOGIT_TOLERANCE = 1e-5  # fp32, relative to the largest |logit| (as in tests/models/test_parity.py)


def require(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"{path} is missing: put the shared data folder at {DATA_DIR} "
                    "or point KVSERVE_SHARED_DATA at it")
    return path


class Llama2cModel:
    """run.c's forward in numpy, one token at a time with a KV cache, reading the .bin itself."""

    def __init__(self, path: Path):
        raw = path.read_bytes()
        dim, hidden, L, n_heads, n_kv_heads, vocab, seq_len = struct.unpack_from("<7i", raw)
        self.n_layers, self.n_heads, self.n_kv_heads = L, n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        kv_dim = n_kv_heads * self.head_dim
        floats, offset = np.frombuffer(raw, "<f4", offset=28), 0

        def take(*shape):
            nonlocal offset
            a = floats[offset:offset + int(np.prod(shape))].reshape(shape)
            offset += a.size
            return a

        self.emb = take(abs(vocab), dim)
        self.rms_att, self.wq, self.wk = take(L, dim), take(L, dim, dim), take(L, kv_dim, dim)
        self.wv, self.wo, self.rms_ffn = take(L, kv_dim, dim), take(L, dim, dim), take(L, dim)
        self.w1, self.w2, self.w3 = take(L, hidden, dim), take(L, dim, hidden), take(L, hidden, dim)
        self.rms_final = take(dim)
        take(2, seq_len, self.head_dim // 2)  # freq_cis_real, freq_cis_imag
        self.wcls = self.emb if vocab > 0 else take(abs(vocab), dim)
        assert offset == floats.size

    @staticmethod
    def rmsnorm(x, w):
        return w * (x / np.sqrt(np.mean(x * x) + np.float32(1e-5)))

    def rope(self, vec, pos):
        """Rotates adjacent pairs (vec[i], vec[i + 1]) by pos * 10000^(-(i % hs) / hs), in place."""
        i = np.arange(0, vec.size, 2)
        freq = 1.0 / np.power(10000.0, (i % self.head_dim) / self.head_dim)
        cos, sin = np.cos(pos * freq).astype(np.float32), np.sin(pos * freq).astype(np.float32)
        v0, v1 = vec[0::2].copy(), vec[1::2].copy()
        vec[0::2], vec[1::2] = v0 * cos - v1 * sin, v0 * sin + v1 * cos

    def forward(self, token: int, cache: tuple[list, list]) -> np.ndarray:
        """The logits after `token` at position len(cache keys); appends its keys and values."""
        hs, group = self.head_dim, self.n_heads // self.n_kv_heads
        keys, values = cache
        pos = len(keys[0])
        x = self.emb[token].copy()
        for l in range(self.n_layers):
            xb = self.rmsnorm(x, self.rms_att[l])
            q, k, v = self.wq[l] @ xb, self.wk[l] @ xb, self.wv[l] @ xb
            self.rope(q, pos)
            self.rope(k, pos)
            keys[l].append(k.reshape(-1, hs))
            values[l].append(v.reshape(-1, hs))
            K, V = np.stack(keys[l]), np.stack(values[l])  # [pos + 1, n_kv_heads, hs]
            att_out = np.empty_like(q)
            for h in range(self.n_heads):
                scores = K[:, h // group] @ q[h * hs:(h + 1) * hs] / np.sqrt(np.float32(hs))
                p = np.exp(scores - scores.max())
                att_out[h * hs:(h + 1) * hs] = (p / p.sum()) @ V[:, h // group]
            x = x + self.wo[l] @ att_out
            xb = self.rmsnorm(x, self.rms_ffn[l])
            gate, up = self.w1[l] @ xb, self.w3[l] @ xb
            x = x + self.w2[l] @ (gate / (1 + np.exp(-gate)) * up)
        return self.wcls @ self.rmsnorm(x, self.rms_final)

    def new_cache(self) -> tuple[list, list]:
        return [[] for _ in range(self.n_layers)], [[] for _ in range(self.n_layers)]

    def logits(self, tokens: list[int]) -> np.ndarray:
        """[len(tokens), vocab]: the logits after each token."""
        cache = self.new_cache()
        return np.stack([self.forward(token, cache) for token in tokens])

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        cache, out = self.new_cache(), []
        logits = [self.forward(token, cache) for token in prompt][-1]
        for _ in range(num_tokens):
            out.append(int(logits.argmax()))
            logits = self.forward(out[-1], cache)
        return out


class Llama2cEncoder:
    """run.c's encode(), reading the tokenizer .bin itself."""

    def __init__(self, path: Path):
        data, offset = path.read_bytes(), 4
        self.pieces, self.scores = [], []
        while offset < len(data):
            score, n = struct.unpack_from("<fi", data, offset)
            self.pieces.append(data[offset + 8:offset + 8 + n].decode("utf-8"))
            self.scores.append(score)
            offset += 8 + n
        self.ids = {}
        for i, piece in enumerate(self.pieces):
            self.ids.setdefault(piece, i)
        # Lets encode() split long texts before each space: no merge can then cross that point.
        assert not any(" " in piece[1:] for piece in self.pieces)

    def encode(self, text: str, split_before_spaces: bool = False) -> list[int]:
        """BOS, the dummy-prefix space (for non-empty text), one token per UTF-8 character (else
        one per byte, id = byte + 3), then merges of the best-scoring pair, leftmost on ties."""
        if not text:
            return [1]
        text = " " + text
        if not split_before_spaces:
            return [1] + self._merge(text)
        starts = [0] + [i for i in range(1, len(text)) if text[i] == " "] + [len(text)]
        return [1] + [t for a, b in zip(starts, starts[1:]) for t in self._merge(text[a:b])]

    def _merge(self, text: str) -> list[int]:
        tokens = []
        for ch in text:
            tokens += [self.ids[ch]] if ch in self.ids else [b + 3 for b in ch.encode("utf-8")]
        while True:
            best_score, best_i = -1e10, -1
            for i in range(len(tokens) - 1):
                merged = self.ids.get(self.pieces[tokens[i]] + self.pieces[tokens[i + 1]])
                if merged is not None and self.scores[merged] > best_score:
                    best_score, best_i, best_id = self.scores[merged], i, merged
            if best_i < 0:
                return tokens
            tokens[best_i:best_i + 2] = [best_id]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stories260K")
    convert_llama2c(require(CHECKPOINT), require(TOKENIZER), out)
    return out


@pytest.fixture(scope="module")
def llm(converted) -> kvserve.LLM:
    return kvserve.LLM(converted, dtype="float32")


@pytest.fixture(scope="module")
def encoder() -> Llama2cEncoder:
    return Llama2cEncoder(require(TOKENIZER))


@pytest.fixture(scope="module")
def valid_text() -> str:
    return require(VALID_TEXT).read_bytes().decode("utf-8")  # keeps the CRLF line endings


def kvserve_prompt_logits(llm: kvserve.LLM, prompt: list[int]) -> torch.Tensor:
    c = llm.config
    caches = kvserve.KVCache.from_model_config(1, len(prompt), c.num_layers, c.num_kv_heads,
                                               c.head_dim, llm.dtype)
    return llm.model(torch.tensor([prompt]), caches)[0]


def assert_logits_close(ours: torch.Tensor, ref, tolerance: float = LOGIT_TOLERANCE):
    ref = torch.as_tensor(ref).float()
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err <= tolerance, f"max relative logit error {err:.2e}"


def kvserve_greedy(llm: kvserve.LLM, prompts) -> list:
    params = kvserve.SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    return llm.generate(prompts, params)


def test_config_and_tensor_names(converted):
    config = json.loads((converted / "config.json").read_text())
    expected = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=172,
                    num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=4,
                    vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, dtype="float32")
    assert {k: config[k] for k in expected} == expected
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    with safe_open(converted / "model.safetensors", "pt") as f:
        names = set(f.keys())
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                 "post_attention_layernorm"]
    assert names == {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{p}.weight" for i in range(5) for p in per_layer}


def test_transformers_runs_the_directory_like_kvserve(converted, llm):
    hf = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    for prompt, out in zip(PROMPTS, kvserve_greedy(llm, PROMPTS)):
        ids = hf_tokenizer(prompt)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            assert_logits_close(kvserve_prompt_logits(llm, ids), hf(torch.tensor([ids])).logits[0])
            seq = torch.tensor([ids])
            for _ in range(NUM_GREEDY_TOKENS):  # full forward passes: no cache, no heuristics
                seq = torch.cat([seq, hf(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert out.outputs[0].token_ids == seq[0, len(ids):].tolist()
        # The completion is what the generated tokens add to the prompt's text, leading space
        # included (decoding them alone would strip it).
        full = hf_tokenizer.decode(seq[0], skip_special_tokens=True)
        assert full.startswith(prompt) and out.outputs[0].text == full[len(prompt):]
        assert out.outputs[0].text.startswith((" ", ",", "."))


def test_numpy_llama2c_decodes_like_kvserve(llm, encoder):
    reference = Llama2cModel(require(CHECKPOINT))
    prompts = [encoder.encode(p) for p in PROMPTS]
    for prompt, text_out, ids_out in zip(prompts, kvserve_greedy(llm, PROMPTS),
                                         kvserve_greedy(llm, prompts)):
        assert text_out.prompt_token_ids == prompt  # tokenizer.json through kvserve's Tokenizer
        assert_logits_close(kvserve_prompt_logits(llm, prompt), reference.logits(prompt))
        expected = reference.greedy(prompt, NUM_GREEDY_TOKENS)
        assert ids_out.outputs[0].token_ids == expected
        assert text_out.outputs[0].token_ids == expected


def test_tokenizer_matches_llama2c_encode_on_tinystories(converted, encoder, valid_text):
    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(converted)
    lines = valid_text.split("\n")  # each line but the last ends in "\r", a byte-fallback token
    assert sum("\r" in line for line in lines) == 18
    for line in lines:
        expected = encoder.encode(line, split_before_spaces=True)
        ids = tok.encode(line).ids
        assert ids == expected and ids[0] == 1
        assert hf_tok(line)["input_ids"] == expected
        assert tok.decode(ids) == line
    assert tok.encode(valid_text).ids == encoder.encode(valid_text, split_before_spaces=True)


def test_tokenizer_matches_llama2c_encode_on_random_strings(converted, encoder):
    """Pieces glued at random, with spaces, CR/LF and characters outside the vocabulary, through
    llama2.c's literal merge loop (no splitting): covers pairs that make the same piece."""
    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    rng = random.Random(0)
    alphabet = encoder.pieces[259:] + list("  \r\n\té€😀ü")
    for _ in range(1500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        ids = tok.encode(text).ids
        assert ids == encoder.encode(text), repr(text)
        assert tok.decode(ids) == text, repr(text)


def test_untied_classifier_and_mqa(tmp_path):
    """A random llama2.c checkpoint with odd sizes, one KV head and its own classifier."""
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = 48, 40, 2, 6, 1, 512, 64
    head_dim, rng = dim // heads, np.random.default_rng(0)
    shapes = [(vocab, dim), (layers, dim), (layers, dim, dim), (layers, kv_heads * head_dim, dim),
              (layers, kv_heads * head_dim, dim), (layers, dim, dim), (layers, dim),
              (layers, hidden, dim), (layers, dim, hidden), (layers, hidden, dim), (dim,),
              (2, seq_len, head_dim // 2), (vocab, dim)]
    arrays = [0.3 * rng.normal(size=s).astype("<f4") for s in shapes]
    for norm in (1, 6, 10):  # rms_att, rms_ffn, rms_final
        arrays[norm] += 1
    path = tmp_path / "untied.bin"
    path.write_bytes(struct.pack("<7i", dim, hidden, layers, heads, kv_heads, -vocab, seq_len)
                     + b"".join(a.tobytes() for a in arrays))
    out = tmp_path / "hf"
    summary = convert_llama2c(path, require(TOKENIZER), out)
    assert not summary.config.tied
    assert summary.num_params == sum(a.size for i, a in enumerate(arrays) if i != 11)  # no freq_cis
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    prompt = [1, 400, 7, 300, 511, 259, 2, 90, 91, 92, 93]
    expected = Llama2cModel(path).logits(prompt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert_logits_close(hf(torch.tensor([prompt])).logits[0], expected)
    assert_logits_close(kvserve_prompt_logits(kvserve.LLM(out), prompt), expected)


def test_bfloat16_output(tmp_path, converted):
    convert_llama2c(require(CHECKPOINT), require(TOKENIZER), tmp_path, dtype="bfloat16")
    assert kvserve.LLM(tmp_path).dtype == torch.bfloat16  # "auto" reads config.json's dtype
    with safe_open(tmp_path / "model.safetensors", "pt") as ours, \
            safe_open(converted / "model.safetensors", "pt") as fp32:
        for name in fp32.keys():
            assert torch.equal(ours.get_tensor(name), fp32.get_tensor(name).bfloat16()), name


def test_cli_prints_a_summary(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert", "llama2c", "--checkpoint", str(require(CHECKPOINT)),
                  "--tokenizer", str(require(TOKENIZER)), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 0
    line = capsys.readouterr().out.strip()
    for part in ("260,032 params", "5 layers", "8 heads / 4 kv heads", "vocab 512",
                 str(tmp_path / "out")):
        assert part in line
    assert kvserve.LLM(tmp_path / "out").config.num_layers == 5


def _truncated(tmp_path):
    path = tmp_path / "truncated.bin"
    path.write_bytes(require(CHECKPOINT).read_bytes()[:500_000])
    return path, TOKENIZER


def _garbage(tmp_path):
    path = tmp_path / "garbage.bin"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    return path, TOKENIZER


def _truncated_tokenizer(tmp_path):
    path = tmp_path / "tok.bin"
    path.write_bytes(require(TOKENIZER).read_bytes()[:-3])
    return CHECKPOINT, path


def _other_vocab(tmp_path):
    path = tmp_path / "tok.bin"
    data = require(TOKENIZER).read_bytes()
    path.write_bytes(data + struct.pack("<fi", -999.0, 3) + b"xyz")  # 513 tokens
    return CHECKPOINT, path


BAD_INPUTS = {  # name -> (make(tmp_path) -> (checkpoint, tokenizer), error, message fragment)
    "truncated checkpoint": (_truncated, ValueError, "truncated"),
    "garbage checkpoint": (_garbage, ValueError, "not a llama2.c checkpoint"),
    "missing checkpoint": (lambda p: (p / "missing.bin", TOKENIZER), FileNotFoundError,
                           "does not exist"),
    "missing tokenizer": (lambda p: (CHECKPOINT, p / "missing.bin"), FileNotFoundError,
                          "does not exist"),
    "truncated tokenizer": (_truncated_tokenizer, ValueError, "truncated"),
    "tokenizer of another vocabulary": (_other_vocab, ValueError, "513 tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_before_writing(tmp_path, capsys, case):
    require(CHECKPOINT)
    require(TOKENIZER)
    make, error, fragment = BAD_INPUTS[case]
    checkpoint, tokenizer = make(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(error, match=fragment):
        convert_llama2c(checkpoint, tokenizer, out)
    assert not out.exists()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert", "llama2c", "--checkpoint", str(checkpoint), "--tokenizer",
                  str(tokenizer), "--out", str(out)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("kvserve: error:")
