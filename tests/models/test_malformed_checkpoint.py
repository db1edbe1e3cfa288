"""A corpus of malformed checkpoints: each must raise a clear ValueError (FileNotFoundError for a
missing file) that names the file and the field or tensor at fault; never a crash, a hang, an
error from deep inside the C++ core, or a silent success.

Valid tiny checkpoints come from transformers (``checkpoint_factory``); each test damages a copy.
"""

from __future__ import annotations

import faulthandler
import json
import random
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvserve

DELETE = object()  # edit_config: remove the field
GREEDY = kvserve.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [1, 40, 41, 42, 43]
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(autouse=True)
def no_hang():
    """A load that hangs fails the run (with tracebacks) instead of blocking it."""
    faulthandler.dump_traceback_later(300, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def llama(checkpoint_factory, tmp_path):
    """A damageable copy of a tiny Llama: vocab 384, hidden 96, 4 heads and 2 KV heads of
    head_dim 24, intermediate 160, 2 layers, untied lm_head."""
    return copy(checkpoint_factory("LlamaForCausalLM"), tmp_path / "llama")


@pytest.fixture
def narrow(checkpoint_factory, tmp_path):
    """Like `llama` but head_dim 16, so that no projection is square (q_proj is [64, 96])."""
    return copy(checkpoint_factory("LlamaForCausalLM", head_dim=16), tmp_path / "narrow")


@pytest.fixture
def sharded(checkpoint_factory, tmp_path):
    """A tiny Llama split over several shards with model.safetensors.index.json."""
    path = copy(checkpoint_factory("LlamaForCausalLM", max_shard_size="60KB"), tmp_path / "sharded")
    assert len(set(weight_map(path).values())) > 2
    return path


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(path, name="config.json", **changes):
    config = json.loads((path / name).read_text())
    for key, value in changes.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    (path / name).write_text(json.dumps(config))


def weight_map(path) -> dict[str, str]:
    return json.loads((path / INDEX).read_text())["weight_map"]


def split_safetensors(file) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join_safetensors(file, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_tensors(file, edit) -> None:
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def expect_error(path, fragments, kind=ValueError, api=kvserve.LLM):
    """Loading `path` raises exactly `kind`, whose message holds every fragment."""
    with pytest.raises(Exception) as info:
        api(path)
    message = str(info.value)
    assert type(info.value) is kind, f"{type(info.value).__name__}: {message}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    return message


def greedy(llm) -> list[int]:
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


# ---------------------------------------------------------------------------- config.json
POSITIVE_INTS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings"]
REQUIRED = [f for f in POSITIVE_INTS if f != "num_key_value_heads"]
NOT_INTEGERS = ["64", 64.5, True, False, None, [64], {"value": 64}, float("nan"), float("inf")]

CONFIG_CASES = [
    *[({f: v}, f"'{f}' must be a positive integer") for f in POSITIVE_INTS for v in (0, -1, -64)],
    *[({f: v}, f"'{f}' must be a positive integer") for f in POSITIVE_INTS for v in NOT_INTEGERS
      if not (f == "num_key_value_heads" and v is None)],  # null there means "no GQA"
    *[({f: DELETE}, f"missing required field '{f}'") for f in REQUIRED],
    ({"num_key_value_heads": 3}, "(3) must divide num_attention_heads (4)"),
    ({"num_key_value_heads": 8}, "(8) must divide num_attention_heads (4)"),
    ({"hidden_size": 98, "head_dim": DELETE}, "'hidden_size' (98) must be a multiple of"),
    ({"head_dim": 23}, "head_dim is 23, but rotary embeddings need an even head_dim"),
    ({"hidden_size": 100, "head_dim": DELETE},
     "head_dim (hidden_size / num_attention_heads) is 25"),
    ({"head_dim": 0}, "'head_dim' must be a positive integer"),
    ({"head_dim": 24.5}, "'head_dim' must be a positive integer"),
    # Absurd sizes fail before anything is sized from them.
    ({"vocab_size": 10**12}, "'vocab_size' is 1000000000000, more than kvserve accepts"),
    ({"hidden_size": 10**9}, "'hidden_size' is 1000000000, more than kvserve accepts"),
    ({"intermediate_size": 10**9}, "'intermediate_size' is 1000000000"),
    ({"num_hidden_layers": 10**6}, "'num_hidden_layers' is 1000000"),
    ({"num_attention_heads": 2**20}, "'num_attention_heads' is 1048576"),
    ({"max_position_embeddings": 10**12}, "'max_position_embeddings' is 1000000000000"),
    ({"max_position_embeddings": 1e300}, "'max_position_embeddings' is 1000000000000000052504760"),
    ({"head_dim": 2**20}, "'head_dim' is 1048576"),
    *[({"rms_norm_eps": v}, "'rms_norm_eps' must be a finite number > 0")
      for v in (0, -1e-6, float("nan"), float("inf"), "1e-6", True)],
    *[({"rope_parameters": {"rope_type": "default", "rope_theta": v}},
       "'rope_parameters.rope_theta' must be a finite number > 1")
      for v in (-10000.0, 0, 1, float("nan"), float("-inf"), "10000")],
    ({"rope_parameters": DELETE, "rope_theta": float("nan")}, "'rope_theta' must be a finite"),
    ({"rope_parameters": DELETE, "rope_theta": -1}, "'rope_theta' must be a finite"),
    ({"rope_parameters": "linear"}, "'rope_parameters' must be a JSON object"),
    ({"rope_parameters": DELETE, "rope_scaling": [2.0]}, "'rope_scaling' must be a JSON object"),
    ({"rope_parameters": DELETE, "rope_scaling": {"type": "linear"}},
     "needs a 'rope_scaling.factor'"),
    ({"rope_parameters": DELETE, "rope_scaling": {"type": "linear", "factor": 0.5}},
     "'rope_scaling.factor' must be >= 1"),
    ({"rope_parameters": DELETE, "rope_scaling": {"type": "linear", "factor": "2"}},
     "'rope_scaling.factor' must be a finite number"),
    ({"rope_parameters": {"rope_type": "linear", "factor": float("nan")}},
     "'rope_parameters.factor' must be a finite number"),
    ({"rope_parameters": {"rope_type": "linear", "factor": -2.0}},
     "'rope_parameters.factor' must be a finite number"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}},
     "'rope_parameters.short_factor' must list positive numbers"),
    ({"rope_parameters": {"rope_type": 7}}, "rope type 7 is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                          "high_freq_factor": 1.0}},
     "'rope_parameters.high_freq_factor' (1) must be greater than low_freq_factor (4)"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0}},
     "'rope_parameters.low_freq_factor' must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                          "original_max_position_embeddings": -32}},
     "'rope_parameters.original_max_position_embeddings' must be a positive integer"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": "32"}},
     "'rope_parameters.original_max_position_embeddings' must be a positive integer"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": -32}},
     "'rope_parameters.beta_fast' must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0}},
     "'rope_parameters.attention_factor' must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "'rope_parameters.partial_rotary_factor' is 0.5; LlamaForCausalLM rotates whole heads"),
    ({"partial_rotary_factor": 0.75}, "'partial_rotary_factor' is 0.75; LlamaForCausalLM rotates"),
    ({"partial_rotary_factor": 0}, "'partial_rotary_factor' must be a finite number > 0"),
    ({"partial_rotary_factor": "half"}, "'partial_rotary_factor' must be a finite number > 0"),
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
    ({"architectures": []}, "'architectures' must be a non-empty list"),
    ({"architectures": "LlamaForCausalLM"}, "'architectures' must be a non-empty list"),
    ({"architectures": [["LlamaForCausalLM"]]}, "unsupported architecture [\"LlamaForCausalLM\"]"),
    ({"architectures": DELETE}, "missing 'architectures'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
    ({"attention_bias": 1}, "'attention_bias' must be true or false"),
    ({"mlp_bias": "false"}, "'mlp_bias' must be true or false"),
    ({"sliding_window": -1}, "'sliding_window' must be an integer >= 0"),
    ({"sliding_window": "4096"}, "'sliding_window' must be an integer >= 0"),
    ({"sliding_window": 8, "layer_types": ["full_attention"]}, "'layer_types' must list"),
    ({"sliding_window": 8, "layer_types": ["full_attention", "local"]}, "'layer_types' must list"),
    ({"layer_types": ["sliding_attention"] * 2}, "'layer_types' has sliding_attention layers"),
    *[({"eos_token_id": v}, "'eos_token_id' must be a token id in [0, vocab_size=384)")
      for v in (384, -1, 10**6, "2", 2.0, True, [2, "x"], [2, 999])],
    ({"bos_token_id": 384}, "'bos_token_id' must be a token id in [0, vocab_size=384)"),
    ({"dtype": "int8"}, "'dtype' is 'int8'"),
    ({"dtype": 5}, "'dtype' is 5"),
    ({"dtype": DELETE, "torch_dtype": "garbage"}, "'torch_dtype' is 'garbage'"),
]


@pytest.mark.parametrize("changes, fragment", CONFIG_CASES)
def test_bad_config_field(llama, changes, fragment):
    edit_config(llama, **changes)
    expect_error(llama, ["config.json", fragment])


# The fields of the families beyond Llama's (the state-space families' are in
# test_malformed_state_models.py): Granite's multipliers, SmolLM3's NoPE layers (3 layers).
FAMILY_CASES = [
    ("GraniteForCausalLM", {"residual_multiplier": 0}, "'residual_multiplier' must be a finite"),
    ("GraniteForCausalLM", {"attention_multiplier": -0.1}, "'attention_multiplier' must be a "
                                                           "finite number > 0"),
    ("GraniteForCausalLM", {"logits_scaling": "8"}, "'logits_scaling' must be a finite number"),
    ("Glm4MoeForCausalLM", {"use_qk_norm": "yes"}, "'use_qk_norm' must be true or false"),
    ("Glm4MoeForCausalLM", {"n_group": 3}, "'n_group' (3) must divide the 8 experts"),
    ("Olmo2ForCausalLM", {"hidden_act": "gelu"}, "'hidden_act' is 'gelu'; only silu"),
    ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]},
     "'no_rope_layers' must list 1 (RoPE) or 0 (none) for each of the 3 layers"),
    ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 2, 1]}, "'no_rope_layers' must list"),
    ("SmolLM3ForCausalLM", {"no_rope_layers": [True, False, True]}, "'no_rope_layers' must list"),
    ("SmolLM3ForCausalLM", {"no_rope_layers": None, "no_rope_layer_interval": 0},
     "'no_rope_layer_interval' must be a positive integer"),
    ("Phi3ForCausalLM", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 11,
                                             "long_factor": [1.0] * 12,
                                             "original_max_position_embeddings": 64}},
     "'rope_parameters.short_factor' lists 11 factors; the 24 rotated dims of a head need 12"),
    ("Phi3ForCausalLM", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 12,
                                             "long_factor": [1.0] * 11 + [-2.0],
                                             "original_max_position_embeddings": 64}},
     "'rope_parameters.long_factor' must list positive numbers"),
    ("Phi3ForCausalLM", {"rope_parameters": {"rope_type": "su", "short_factor": [1.0] * 12,
                                             "long_factor": "1.0"}},
     "'rope_parameters.long_factor' must list positive numbers"),
    ("Phi3ForCausalLM", {"original_max_position_embeddings": DELETE,
                         "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 12,
                                             "long_factor": [1.0] * 12}},
     "missing required field 'original_max_position_embeddings'"),
    # The fused projections of another shape than the config's heads and MLP make.
    ("Phi3ForCausalLM", {"num_key_value_heads": 4},
     "tensor 'model.layers.0.self_attn.qkv_proj.weight' has shape [192, 96]; the config's "
     "self_attn.q_proj + self_attn.k_proj + self_attn.v_proj make 288 rows"),
    ("Phi3ForCausalLM", {"intermediate_size": 100},
     "tensor 'model.layers.0.mlp.gate_up_proj.weight' has shape [320, 96]; the config's "
     "mlp.gate_proj + mlp.up_proj make 200 rows"),
    ("GptOssForCausalLM", {"swiglu_limit": 0}, "'swiglu_limit' must be a finite number > 0"),
    ("GptOssForCausalLM", {"swiglu_alpha": "1.7"}, "'swiglu_alpha' must be a finite number"),
    ("GptOssForCausalLM", {"num_local_experts": DELETE},
     "missing required field 'num_local_experts'"),
    ("GptOssForCausalLM", {"num_experts_per_tok": 5},
     "'num_experts_per_tok' (5) exceeds the number of experts (4)"),
    # Experts that config.json announces and the weights lack.
    ("GptOssForCausalLM", {"num_local_experts": 6}, "model.layers.0.mlp.experts.gate_up_proj"),
    ("Cohere2ForCausalLM", {"logit_scale": 0}, "'logit_scale' must be a finite number > 0"),
    ("Cohere2ForCausalLM", {"layer_norm_eps": -1e-5}, "'layer_norm_eps' must be a finite number"),
    ("Cohere2ForCausalLM", {"hidden_act": "gelu"}, "'hidden_act' is 'gelu'; only silu"),
    ("Cohere2ForCausalLM", {"layer_types": ["sliding_attention"] * 3},
     "'layer_types' must list one of ('full_attention', 'sliding_attention') per layer"),
    ("Cohere2ForCausalLM", {"layer_types": None, "sliding_window_pattern": 0},
     "'sliding_window_pattern' must be a positive integer"),
    ("Cohere2ForCausalLM", {"num_attention_heads": 5, "num_key_value_heads": 5},
     "'hidden_size' (96) must be a multiple of num_attention_heads (5)"),
]


def expect_family_error(checkpoint, tmp_path, changes, fragment):
    """A copy of `checkpoint` with config.json changed fails to load with `fragment` in its
    message (and the file's name, unless the fragment names a tensor)."""
    path = copy(checkpoint, tmp_path / "model")
    edit_config(path, **changes)
    weights = ("mlp.experts", "block_sparse", "mixer.", "tensor '")
    expect_error(path, [fragment] if any(w in fragment for w in weights)
                 else ["config.json", fragment])


@pytest.mark.parametrize("architecture, changes, fragment", FAMILY_CASES)
def test_bad_family_config_field(checkpoint_factory, tmp_path, architecture, changes,
                                      fragment):
    expect_family_error(checkpoint_factory(architecture), tmp_path, changes, fragment)


@pytest.mark.parametrize("text, fragment", [
    ("{ not json", "is not valid JSON"),
    ("", "is not valid JSON"),
    ('{"vocab_size": 384,', "is not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),  # deeper than the parser recurses
    (b"\xff\xfe{}", "is not valid JSON"),
    ("[]", "must hold a JSON object, got list"),
    ("42", "must hold a JSON object, got int"),
    ("null", "must hold a JSON object, got NoneType"),
    ('"LlamaForCausalLM"', "must hold a JSON object, got str"),
])
def test_config_that_is_not_a_json_object(llama, text, fragment):
    target = llama / "config.json"
    target.write_bytes(text if isinstance(text, bytes) else text.encode())
    expect_error(llama, ["config.json", fragment])


def test_config_json_that_is_a_directory(llama):
    (llama / "config.json").unlink()
    (llama / "config.json").mkdir()
    expect_error(llama, ["config.json", "is not a regular file"])


def test_missing_config_and_weights(llama, tmp_path):
    (llama / WEIGHTS).unlink()
    expect_error(llama, [str(llama), "no *.safetensors weights"], FileNotFoundError)
    (llama / "config.json").unlink()
    expect_error(llama, ["config.json", "does not exist"], FileNotFoundError)
    expect_error(tmp_path / "nowhere", ["nowhere", "does not exist"], FileNotFoundError)


@pytest.mark.parametrize("changes, fragment", [
    ({"eos_token_id": 500}, "'eos_token_id' must be a token id in [0, vocab_size=384)"),
    ({"eos_token_id": [2, None]}, "'eos_token_id' must be a token id"),
])
def test_bad_generation_config(llama, changes, fragment):
    edit_config(llama, "generation_config.json", **changes)
    expect_error(llama, ["generation_config.json", fragment])


def test_invalid_generation_config_json(llama):
    (llama / "generation_config.json").write_text("{")
    expect_error(llama, ["generation_config.json", "is not valid JSON"])


@pytest.mark.parametrize("changes", [
    {"head_dim": None},                          # derived: 96 / 4 = 24
    {"hidden_size": 96.0, "vocab_size": 384.0},  # integral floats are integers
    {"rope_parameters": DELETE, "rope_theta": 10000.0},
    {"rope_parameters": None},
    {"rope_parameters": {"rope_type": "default", "rope_theta": None}},
    {"sliding_window": 0},
    {"eos_token_id": [2, 3]},
    {"rms_norm_eps": DELETE, "dtype": "torch.float32"},
])
def test_unusual_but_valid_configs_still_load(llama, changes):
    edit_config(llama, **changes)
    assert len(greedy(kvserve.LLM(llama))) == GREEDY.max_tokens


@pytest.mark.parametrize("value", [None, DELETE])
def test_absent_num_key_value_heads_means_no_gqa(llama, value):
    from kvserve.config import load_checkpoint_info

    edit_config(llama, num_key_value_heads=value)
    assert load_checkpoint_info(llama).config.num_kv_heads == 4
    expect_error(llama, [WEIGHTS, "num_key_value_heads*head_dim=96"])  # the weights have 2


# ---------------------------------------------------------------- config.json against the weights
@pytest.mark.parametrize("changes, fragments", [
    ({"vocab_size": 2**20}, ["model.embed_tokens.weight", "[384, 96]", "vocab_size=1048576"]),
    ({"vocab_size": 383}, ["model.embed_tokens.weight", "vocab_size=383", "lm_head.weight"]),
    ({"hidden_size": 4096}, ["model.embed_tokens.weight", "hidden_size=4096"]),
    ({"intermediate_size": 100_000}, ["mlp.gate_proj.weight", "intermediate_size=100000"]),
    ({"num_attention_heads": 8}, ["self_attn.q_proj.weight", "num_attention_heads*head_dim=192"]),
    ({"num_key_value_heads": 4}, ["self_attn.k_proj.weight", "num_key_value_heads*head_dim=96"]),
    ({"head_dim": 32}, ["self_attn.q_proj.weight", "num_attention_heads*head_dim=128"]),
    ({"num_hidden_layers": 3}, ["num_hidden_layers is 3", "holds 2 layers"]),
    ({"num_hidden_layers": 1}, ["num_hidden_layers is 1", "holds 2 layers"]),
    ({"attention_bias": True}, ["has no tensor 'model.layers.0.self_attn.q_proj.bias'"]),
    ({"mlp_bias": True}, ["has no tensor 'model.layers.1.mlp.down_proj.bias'"]),
])
def test_config_that_disagrees_with_the_weights(llama, changes, fragments):
    edit_config(llama, **changes)
    expect_error(llama, ["config.json" if "num_hidden_layers" in changes else WEIGHTS, *fragments])


# ------------------------------------------------------------------- safetensors: raw bytes
def truncation_points(header_bytes: int, size: int) -> dict[str, int]:
    data = header_bytes + 8
    return {"empty": 0, "in-length-1": 1, "in-length-7": 7, "length-only": 8,
            "in-json-start": 9, "in-json-middle": 8 + header_bytes // 2, "in-json-end": data - 1,
            "header-only": data, "in-data-start": data + 3, "in-data-middle": (data + size) // 2,
            "in-data-last-byte": size - 1}


@pytest.mark.parametrize("where", list(truncation_points(1000, 10**6)))
def test_truncated_safetensors(narrow, where):
    file = narrow / WEIGHTS
    raw = file.read_bytes()
    (header_bytes,) = struct.unpack("<Q", raw[:8])
    cut = truncation_points(header_bytes, len(raw))[where]
    file.write_bytes(raw[:cut])
    fragments = [WEIGHTS, "is not a valid safetensors file"]
    if cut < 8:
        fragments.append(f"it has {cut} bytes, fewer than the 8-byte header length")
    elif cut < 8 + header_bytes:
        fragments.append(f"header length ({header_bytes} bytes) runs past the end of the file")
    else:  # the first tensor, in file order, whose bytes are cut off is named
        header = json.loads(raw[8:8 + header_bytes])
        header.pop("__metadata__", None)
        ends = sorted((e["data_offsets"][1], name) for name, e in header.items())
        first_cut = next(name for end, name in ends if end > cut - 8 - header_bytes)
        fragments += [f"tensor '{first_cut}' ends at byte", "it is truncated"]
    expect_error(narrow, fragments)


@pytest.mark.parametrize("length, fragment", [
    (lambda size: size, "runs past the end of the file"),
    (lambda size: 2**64 - 1, "runs past the end of the file"),
    (lambda size: 0, "its header is not valid JSON"),
    (lambda size: 1, "its header is not valid JSON"),
])
def test_bad_header_length(narrow, length, fragment):
    file = narrow / WEIGHTS
    raw = file.read_bytes()
    file.write_bytes(struct.pack("<Q", length(len(raw))) + raw[8:])
    expect_error(narrow, [WEIGHTS, fragment])


@pytest.mark.parametrize("header, fragment", [
    (b"garbage!", "its header is not valid JSON"),
    (b"\xff" * 16, "its header is not valid JSON"),
    (b"[1, 2, 3]", "its header must be a JSON object, got list"),
    (b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "a": 1}',
     "key 'a' appears twice"),
    (b'{"a": "F32"}', "header entry of tensor 'a' is not a JSON object"),
    (b'{"__metadata__": {"format": 1}}', "'__metadata__' must map strings to strings"),
])
def test_garbage_safetensors_header(narrow, header, fragment):
    (narrow / WEIGHTS).write_bytes(struct.pack("<Q", len(header)) + header)
    expect_error(narrow, [WEIGHTS, "is not a valid safetensors file", fragment])


@pytest.mark.parametrize("seed", range(16))
def test_bit_flipped_safetensors_header(narrow, seed):
    """One flipped bit anywhere in the header (outside the free-form metadata) is caught."""
    file = narrow / WEIGHTS
    raw = bytearray(file.read_bytes())
    (header_bytes,) = struct.unpack("<Q", raw[:8])
    metadata = raw.find(b'"__metadata__"')
    metadata_end = raw.find(b"}", metadata) + 1
    rng = random.Random(seed)
    position = rng.randrange(8 + header_bytes)
    while metadata <= position < metadata_end:
        position = rng.randrange(8 + header_bytes)
    raw[position] ^= 1 << rng.randrange(8)
    file.write_bytes(bytes(raw))
    expect_error(narrow, [WEIGHTS])


LAYER = "model.layers.1."


def set_entry(name, **fields):
    def edit(header, data):
        header[name].update(fields)
        return header, data
    return edit


def shift_entry(name, delta):
    def edit(header, data):
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin + delta, end + delta]
        return header, data
    return edit


def copy_offsets(src, dst):
    def edit(header, data):
        header[dst]["data_offsets"] = list(header[src]["data_offsets"])
        return header, data
    return edit


def last_tensor(header):
    return max((e["data_offsets"][1], n) for n, e in header.items() if n != "__metadata__")[1]


@pytest.mark.parametrize("edit, fragments", [
    (set_entry("model.norm.weight", dtype="F99"), ["tensor 'model.norm.weight' has unknown dtype"]),
    (set_entry("model.norm.weight", dtype=None), ["tensor 'model.norm.weight' has unknown dtype"]),
    (set_entry("model.norm.weight", shape=[95]),
     ["tensor 'model.norm.weight'", "(384 bytes), but shape [95] of F32 needs 380 bytes"]),
    (set_entry("model.norm.weight", shape=[-96]), ["tensor 'model.norm.weight' has shape [-96]"]),
    (set_entry("model.norm.weight", shape="96"), ["tensor 'model.norm.weight' has shape '96'"]),
    (set_entry("model.norm.weight", shape=[10**12, 10**12]),
     ["tensor 'model.norm.weight'", "needs 4e+24 bytes"]),
    (set_entry("model.norm.weight", data_offsets=[384, 0]), ["has data_offsets [384, 0]"]),
    (set_entry("model.norm.weight", data_offsets=[0]), ["has data_offsets [0]"]),
    (set_entry("model.norm.weight", data_offsets=[-4, 380]), ["has data_offsets [-4, 380]"]),
    (set_entry("model.norm.weight", data_offsets=[0.0, 384.0]), ["has data_offsets [0.0, 384.0]"]),
    (copy_offsets(LAYER + "input_layernorm.weight", LAYER + "post_attention_layernorm.weight"),
     ["overlaps the tensor before it"]),
    (lambda h, d: shift_entry(last_tensor(h), 4)(h, d), ["ends at byte", "it is truncated"]),
    (lambda h, d: shift_entry(last_tensor(h), -4)(h, d), ["overlaps the tensor before it"]),
    (lambda h, d: (h, d + b"\0" * 4), ["its tensors end at byte", "bytes of data"]),
    (lambda h, d: ({k: v for k, v in h.items() if k != last_tensor(h)}, d),
     ["its tensors end at byte"]),
])
def test_inconsistent_safetensors_entries(narrow, edit, fragments):
    file = narrow / WEIGHTS
    header, data = edit(*split_safetensors(file))
    join_safetensors(file, header, data)
    expect_error(narrow, [WEIGHTS, "is not a valid safetensors file", *fragments])


# -------------------------------------------------------- safetensors: well-formed but wrong
def retype(name, dtype):
    def edit(tensors):
        tensors[name] = (tensors[name] * 10).to(dtype)
    return edit


def reshape(name, transform):
    def edit(tensors):
        tensors[name] = transform(tensors[name]).contiguous()
    return edit


def drop(name):
    def edit(tensors):
        del tensors[name]
    return edit


def add(name, shape):
    def edit(tensors):
        tensors[name] = torch.zeros(shape)
    return edit


@pytest.mark.parametrize("edit, fragments", [
    *[(retype(LAYER + "mlp.up_proj.weight", dtype), [f"has dtype {name}"])
      for dtype, name in [(torch.int8, "I8"), (torch.uint8, "U8"), (torch.bool, "BOOL"),
                          (torch.int32, "I32"), (torch.int64, "I64"),
                          (torch.float8_e4m3fn, "F8_E4M3"), (torch.float8_e5m2, "F8_E5M2")]],
    (retype("model.norm.weight", torch.int16), ["tensor 'model.norm.weight' has dtype I16"]),
    (reshape("model.layers.0.self_attn.q_proj.weight", lambda t: t.T),
     ["'model.layers.0.self_attn.q_proj.weight' has shape [96, 64]",
      "implies [num_attention_heads*head_dim=64, hidden_size=96]"]),
    (reshape(LAYER + "self_attn.k_proj.weight", lambda t: t[:16]),
     ["has shape [16, 96]", "[num_key_value_heads*head_dim=32, hidden_size=96]"]),
    (reshape("model.embed_tokens.weight", lambda t: t[:300]),
     ["'model.embed_tokens.weight' has shape [300, 96]",
      "implies [vocab_size=384, hidden_size=96]"]),
    (reshape("lm_head.weight", lambda t: torch.cat([t, t[:16]])),
     ["'lm_head.weight' has shape [400, 96]", "vocab_size=384"]),
    (reshape(LAYER + "mlp.down_proj.weight", lambda t: t.T),
     ["has shape [160, 96]", "[hidden_size=96, intermediate_size=160]"]),
    (reshape("model.norm.weight", lambda t: t[None]), ["'model.norm.weight' has shape [1, 96]"]),
    (reshape("model.norm.weight", lambda t: t[0]), ["'model.norm.weight' has shape []"]),
    (drop(LAYER + "mlp.down_proj.weight"), [f"has no tensor '{LAYER}mlp.down_proj.weight'"]),
    (drop("model.norm.weight"), ["has no tensor 'model.norm.weight'"]),
    (drop("model.embed_tokens.weight"), ["has no tensor 'model.embed_tokens.weight'"]),
    (drop("lm_head.weight"), ["has no tensor 'lm_head.weight'", "tie_word_embeddings"]),
    (drop("model.layers.0.input_layernorm.weight"),
     ["has no tensor 'model.layers.0.input_layernorm.weight'"]),
    (add("model.layers.2.mlp.down_proj.weight", (96, 160)),
     ["'model.layers.2.mlp.down_proj.weight' is not part of the model"]),
    (add(LAYER + "self_attn.q_proj.bias", (64,)),
     [f"'{LAYER}self_attn.q_proj.bias' is not part of the model", "attention_bias"]),
])
def test_wrong_tensors(narrow, edit, fragments):
    edit_tensors(narrow / WEIGHTS, edit)
    expect_error(narrow, [WEIGHTS, *fragments])


def rename_layer(old: str, new: str, part: str = ""):
    def edit(tensors):
        for name in [n for n in tensors if n.startswith(old + part)]:
            tensors[name.replace(old, new)] = tensors.pop(name)
    return edit


def test_every_problem_is_listed(narrow):
    edit_tensors(narrow / WEIGHTS, rename_layer("model.layers.1.", "model.layers.7.", "mlp."))
    message = expect_error(narrow, ["config.json", "(6 problems)"])
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.safetensors has no tensor 'model.layers.1.mlp.{proj}.weight'" in message
        assert f"tensor 'model.layers.7.mlp.{proj}.weight' is not part of the model" in message


def test_a_long_list_of_problems_is_cut_short(narrow):
    edit_tensors(narrow / WEIGHTS, rename_layer("model.layers.1.", "model.layers.7."))
    message = expect_error(narrow, ["config.json", "(18 problems)", "... and 10 more"])
    assert message.count("\n") == 9  # a heading, 8 problems and the count of the rest


@pytest.mark.parametrize("arch, name", [
    ("Qwen2ForCausalLM", "model.layers.1.self_attn.v_proj.bias"),
    ("Qwen3ForCausalLM", "model.layers.0.self_attn.k_norm.weight"),
])
def test_missing_architecture_specific_tensor(checkpoint_factory, tmp_path, arch, name):
    path = copy(checkpoint_factory(arch), tmp_path / "model")
    edit_tensors(path / WEIGHTS, drop(name))
    expect_error(path, [WEIGHTS, f"has no tensor '{name}'"])


# ------------------------------------------------------------------------ sharded checkpoints
def test_index_names_a_missing_shard(sharded):
    shard = sorted(set(weight_map(sharded).values()))[1]
    (sharded / shard).unlink()
    expect_error(sharded, [INDEX, f"to shard {shard}", "does not exist"], FileNotFoundError)


@pytest.mark.parametrize("text, fragment", [
    ("{ not json", "is not valid JSON"),
    ("[]", "non-empty 'weight_map'"),
    ('{"metadata": {}}', "non-empty 'weight_map'"),
    ('{"weight_map": {}}', "non-empty 'weight_map'"),
    ('{"weight_map": ["model.safetensors"]}', "non-empty 'weight_map'"),
    ('{"weight_map": {"model.norm.weight": 3}}', "maps tensor 'model.norm.weight' to 3"),
    ('{"weight_map": {"model.norm.weight": "../model.safetensors"}}', "'../model.safetensors'"),
    ('{"weight_map": {"model.norm.weight": "/etc/passwd"}}', "'/etc/passwd'"),
])
def test_invalid_index(sharded, text, fragment):
    (sharded / INDEX).write_text(text)
    expect_error(sharded, [INDEX, fragment])


def test_index_maps_a_tensor_to_a_shard_that_lacks_it(sharded):
    index = json.loads((sharded / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (sharded / INDEX).write_text(json.dumps(index))
    expect_error(sharded, [INDEX, f"maps tensor '{name}' to {shards[1]}", "has no such tensor"])


def test_index_without_a_tensor(sharded):
    index = json.loads((sharded / INDEX).read_text())
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (sharded / INDEX).write_text(json.dumps(index))
    expect_error(sharded, [INDEX, "has no tensor 'model.layers.1.mlp.down_proj.weight'"])


def test_truncated_shard(sharded):
    shard = sharded / sorted(set(weight_map(sharded).values()))[-1]
    shard.write_bytes(shard.read_bytes()[:-10])
    expect_error(sharded, [shard.name, "is not a valid safetensors file", "it is truncated"])


def test_shards_without_an_index_must_not_repeat_a_tensor(sharded):
    (sharded / INDEX).unlink()
    shards = sorted(sharded.glob("*.safetensors"))
    shutil.copy(shards[0], sharded / "model-extra.safetensors")
    expect_error(sharded, ["model-extra.safetensors", "is in both"])


def test_shards_without_an_index_still_load(sharded, checkpoint_factory):
    (sharded / INDEX).unlink()
    single = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"))
    assert greedy(kvserve.LLM(sharded)) == greedy(single)


# -------------------------------------------------------------- the API boundary and recovery
@pytest.mark.parametrize("damage, fragments", [
    (lambda p: edit_config(p, hidden_size=-1), ["config.json", "'hidden_size'"]),
    (lambda p: edit_config(p, vocab_size=10**12), ["config.json", "'vocab_size'"]),
    (lambda p: (p / WEIGHTS).write_bytes((p / WEIGHTS).read_bytes()[:100]), [WEIGHTS]),
    (lambda p: edit_tensors(p / WEIGHTS, drop("model.norm.weight")),
     [WEIGHTS, "'model.norm.weight'"]),
])
def test_llm_engine_reports_the_same_errors(llama, damage, fragments):
    damage(llama)
    expect_error(llama, fragments, api=lambda path: kvserve.LLMEngine(path, log_memory_plan=False))


def test_a_failed_load_breaks_nothing_else(checkpoint_factory, tmp_path):
    good = checkpoint_factory("LlamaForCausalLM")
    llm = kvserve.LLM(good)
    before = greedy(llm)
    bad = copy(good, tmp_path / "bad")
    edit_config(bad, num_key_value_heads=3)
    expect_error(bad, ["config.json"])
    edit_config(bad, num_key_value_heads=2)
    edit_tensors(bad / WEIGHTS, reshape("model.layers.0.mlp.up_proj.weight", lambda t: t[:7]))
    expect_error(bad, [WEIGHTS])
    (bad / WEIGHTS).write_bytes((bad / WEIGHTS).read_bytes()[:5000])
    expect_error(bad, [WEIGHTS])
    assert greedy(llm) == before                      # the loaded model still serves
    assert greedy(kvserve.LLM(good)) == before        # and a new one loads and agrees


@pytest.fixture
def deepseek(checkpoint_factory, tmp_path):
    """A damageable copy of the tiny DeepSeek-V2 (MLA + MoE, layer 0 dense)."""
    return copy(checkpoint_factory("DeepseekV2ForCausalLM"), tmp_path / "deepseek")


@pytest.mark.parametrize("changes, fragment", [
    ({"kv_lora_rank": 0}, "'kv_lora_rank' must be a positive integer"),
    ({"qk_rope_head_dim": 7}, "'qk_rope_head_dim' is 7; rotary embeddings need it even"),
    ({"num_experts_per_tok": 9}, "'num_experts_per_tok' (9) exceeds the number of experts (8)"),
    ({"moe_layer_freq": 2}, "'moe_layer_freq' must be 1"),
    ({"topk_method": "noaux_tc"}, "'topk_method' is 'noaux_tc'"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1},
     "'n_group' (3) must divide the 8 experts"),
    ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1,
      "num_experts_per_tok": 3},
     "'topk_group' (1) groups of 2 experts leave fewer than num_experts_per_tok (3)"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "n_group": 8,
      "topk_group": 2}, "'n_group' (8) leaves one expert per group"),
    ({"n_routed_experts": "eight"}, "'n_routed_experts' must be"),
])
def test_bad_mla_and_moe_fields(deepseek, changes, fragment):
    edit_config(deepseek, **changes)
    expect_error(deepseek, ["config.json", fragment])


def test_moe_weights_that_disagree_with_the_config(deepseek):
    """One expert fewer in the config than in the weights: every surplus tensor is named."""
    edit_config(deepseek, n_routed_experts=4, num_experts_per_tok=2)
    expect_error(deepseek, ["model.layers.1.mlp.gate.weight", "shape [8, 96]",
                            "num_experts=4"])


def test_model_config_checks_layer_kinds_and_mlp_activations(checkpoint_factory):
    """ModelConfig's own checks, the backstop behind config.json's reader: a layer kind past 3
    (an MLP alone), an MLP without a gate but relu2's, a gated one with relu2."""
    from kvserve.config import load_checkpoint_info

    def invalid(**changes):
        c = load_checkpoint_info(checkpoint_factory("NemotronHForCausalLM")).config
        for name, value in changes.items():
            if name == "layers":
                s = c.ssm
                s.layers = value
                c.ssm = s
            else:
                setattr(c, name, value)
        with pytest.raises(ValueError) as e:
            c.validate()
        return str(e.value)

    assert "holds 0 (attention), 1 (mixer), 2 (both) or 3 (an MLP alone)" in invalid(
        layers=[1, 4, 0, 1, 3])
    assert "an MLP without a gate takes relu2, got silu" in invalid(hidden_act="silu")
    assert "hidden_act must be silu or gelu_pytorch_tanh, got relu2" in invalid(gated_mlp=True)
