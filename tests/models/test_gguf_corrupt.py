"""Corrupt GGUF files are a ValueError naming the file and what is wrong, quickly and in bounded
memory: a metadata array whose count a flipped bit made huge (the gguf package alone would
append parts until memory runs out), a string value whose type became "array", a tensor
offset that points into another tensor's bytes, a token that is not UTF-8, a BOS or
unknown-token id outside the vocabulary; and bit flips anywhere in the header never crash or hang the loader."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

import kvserve
from tests.models.test_gguf import MIXES, SHAPE, write_gguf

gguf = pytest.importorskip("gguf")
from kvserve.loader.gguf_bounds import check_metadata_bounds  # noqa: E402
from kvserve.server.chat_template import ChatTemplate  # noqa: E402
from kvserve.testing.checkpoints import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    path = root / "good.gguf"
    write_gguf(make_checkpoint(root / "plain", "LlamaForCausalLM", **SHAPE), path,
               MIXES["q4_0-q4_1"])
    return path


def field_offset(path, key: str) -> int:
    """Where the field `key` starts: its key's length, the key, then its type."""
    return int(gguf.GGUFReader(str(path)).fields[key].offset)


def damaged(good, tmp_path, edits: dict[int, bytes], name: str = "bad.gguf"):
    data = bytearray(good.read_bytes())
    for offset, value in edits.items():
        data[offset:offset + len(value)] = value
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


def test_good_file_loads(good):
    check_metadata_bounds(good)
    kvserve.LLM(good)


def load_in_bounded_process(path) -> str:
    """What loading `path` prints in a process with 6 GiB of address space and 5 minutes:
    "refused: <message>", or a MemoryError's traceback where a regression lets the gguf
    package run away."""
    code = ("import resource, kvserve, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
            f"try:\n    kvserve.LLM({str(path)!r})\n"
            "except ValueError as e:\n    print('refused:', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    return done.stdout + done.stderr[-2000:]


def test_huge_array_count_is_refused_before_the_gguf_package_reads_it(good, tmp_path):
    key = "tokenizer.ggml.token_type"
    # key length, key, value type (array), item type (int32), then the count
    count_at = field_offset(good, key) + 8 + len(key) + 4 + 4
    path = damaged(good, tmp_path, {count_at + 5: b"\x01"})  # the count's sixth byte: +2^40
    with pytest.raises(ValueError, match=r"'tokenizer.ggml.token_type' \(\d+ items\) declares "
                                         r"\d+ bytes .* truncated or corrupt"):
        check_metadata_bounds(path)
    assert "refused:" in load_in_bounded_process(path)


def test_strings_turned_into_arrays_are_refused(good, tmp_path):
    """The token list's item type flipped from string (8) to array (9): each token's bytes read
    as an array header. The gguf package alone runs out of memory on this file."""
    key = "tokenizer.ggml.tokens"
    path = damaged(good, tmp_path, {field_offset(good, key) + 8 + len(key) + 4: b"\x09"})
    out = load_in_bounded_process(path)
    assert "refused:" in out and "'tokenizer.ggml.tokens'" in out and "corrupt" in out, out


def test_overlapping_tensors_are_refused(good, tmp_path):
    reader = gguf.GGUFReader(str(good))
    tensor = next(t for t in reader.tensors if t.name == "blk.1.attn_v.weight")
    # name length, name, n_dims, dims, type, then the offset into the data section
    at = (int(tensor.field.offset) + 8 + len(tensor.name) + 4 + 8 * len(tensor.shape) + 4)
    path = damaged(good, tmp_path, {at: (0).to_bytes(8, "little")})
    with pytest.raises(ValueError, match="overlaps tensor 'blk.1.attn_v.weight' .* corrupt"):
        kvserve.LLM(path)


def test_token_that_is_not_utf8_is_refused(good, tmp_path):
    data = good.read_bytes()
    at = data.index(b"\xe2\x96\x81e")  # the first piece with U+2581 (3 bytes in UTF-8)
    path = damaged(good, tmp_path, {at: b"\xff"})
    with pytest.raises(ValueError, match="metadata 'tokenizer.ggml.tokens' cannot be read"):
        kvserve.LLM(path)


@pytest.mark.parametrize("key, message", [
    ("tokenizer.ggml.bos_token_id", r"'bos_token_id' must be a token id in \[0, vocab_size=384\)"),
    ("tokenizer.ggml.unknown_token_id", "the unknown token id 1000000 is outside the vocabulary "
                                        "of 384 tokens"),
])
def test_special_token_outside_the_vocabulary_is_refused(good, tmp_path, key, message):
    value_at = field_offset(good, key) + 8 + len(key) + 4
    path = damaged(good, tmp_path, {value_at: (10**6).to_bytes(4, "little")})
    with pytest.raises(ValueError, match=message):
        kvserve.LLM(path)
    # The server reads the special tokens again for the chat template.
    with pytest.raises(ValueError, match=f"{key.split('.')[-1].split('_')[0]} token id 1000000 "
                                         "is outside the vocabulary of 384 tokens"):
        ChatTemplate.from_model_dir(path)


def test_bit_flips_in_the_header_never_crash_or_hang(good, tmp_path):
    """60 files with 1-3 flipped bits in the header, loaded in a process with bounded memory and
    time: each is a ValueError naming the file, or a model that loads (a flip in a name or a
    score)."""
    data = good.read_bytes()
    header = min(int(t.data_offset) for t in gguf.GGUFReader(str(good)).tensors)
    rng = random.Random(0)
    paths = []
    for i in range(60):
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(header)] ^= 1 << rng.randrange(8)
        paths.append(tmp_path / f"flip-{i}.gguf")
        paths[-1].write_bytes(bytes(flipped))
    code = ("import resource, sys, kvserve\n"
            "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n"
            "        kvserve.LLM(path)\n"
            "        print('loaded')\n"
            "    except ValueError as e:\n"
            "        print('refused' if path in str(e) else f'unnamed: {e}')\n")
    done = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True,
                          text=True, timeout=600)
    outcomes = done.stdout.split()
    assert done.returncode == 0 and len(outcomes) == len(paths), done.stderr[-2000:]
    assert set(outcomes) <= {"loaded", "refused"}, done.stdout
    assert outcomes.count("refused") > 20  # most flips in a header break something
