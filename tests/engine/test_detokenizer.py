"""Deferred detokenization: IncrementalDetokenizer.add_all gives the text that add() gives one token
at a time, and LLM.generate (final-only steps, text built when a request finishes) returns the text
that LLMEngine streams. Checked on the shipped byte-level BPE and on a SentencePiece-style
tokenizer with byte fallback (llama2.c's, converted), over random token ids that include bytes
which do not form valid UTF-8 on their own."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import kvserve
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.conftest import SHARED_DATA

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "shakespeare-target"
LLAMA2C_TOKENIZER = SHARED_DATA / "stories260K" / "tok512.bin"


def shipped_tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_model_dir(TARGET)


def llama2c_tokenizer(tmp_path_factory) -> Tokenizer:
    if not LLAMA2C_TOKENIZER.is_file():
        pytest.skip(f"{LLAMA2C_TOKENIZER} is missing: point KVSERVE_SHARED_DATA at the shared data")
    from kvserve.convert.llama2c_tokenizer import build_tokenizer, read_llama2c_tokenizer

    out = tmp_path_factory.mktemp("llama2c_tok")
    build_tokenizer(read_llama2c_tokenizer(LLAMA2C_TOKENIZER)).save(str(out / "tokenizer.json"))
    return Tokenizer.from_model_dir(out)


@pytest.fixture(scope="module", params=[shipped_tokenizer, llama2c_tokenizer],
                ids=["byte-level-bpe", "sentencepiece-byte-fallback"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    return request.param(tmp_path_factory)


def one_at_a_time(tok: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tok, prompt)
    for t in ids:
        detok.add([t])
    return detok.text


@pytest.mark.parametrize("seed", range(40))
def test_add_all_matches_token_by_token(tokenizer, seed):
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    # Half the cases draw from the whole vocabulary (bytes included); half from ordinary pieces.
    low = 0 if seed % 2 else min(300, vocab // 2)
    prompt = [rng.randrange(low, vocab) for _ in range(rng.randint(1, 12))]
    ids = [rng.randrange(low, vocab) for _ in range(rng.randint(1, 60))]
    want = one_at_a_time(tokenizer, prompt, ids)

    detok = IncrementalDetokenizer(tokenizer, prompt)
    split = rng.randint(0, len(ids))
    for t in ids[:split]:  # streamed for a while, then the rest at once
        detok.add([t])
    detok.add_all(ids[split:])
    assert detok.text == want


def test_add_all_uses_one_decode_for_clean_text():
    tok = Tokenizer.from_model_dir(TARGET)
    ids = tok.encode("ROMEO:\nBut soft, what light through yonder window breaks?",
                     add_special_tokens=False)
    calls = []
    real_decode = tok._tok.decode

    def counting(*args, **kwargs):
        calls.append(1)
        return real_decode(*args, **kwargs)

    tok._tok.decode = counting
    detok = IncrementalDetokenizer(tok, ids[:3])
    detok.add_all(ids[3:])
    assert len(calls) == 2  # the shown prefix and the whole window, not two per token
    tok._tok.decode = real_decode
    assert detok.text == one_at_a_time(tok, ids[:3], ids[3:])


def test_generate_text_equals_streamed_text():
    prompts = ["ROMEO:", "First Citizen:\nWe are", "To be", "KING RICHARD III:\nNow is the"]
    params = [kvserve.SamplingParams(temperature=1.2, max_tokens=48, seed=s, n=1 + s % 2)
              for s in range(len(prompts))]
    llm = kvserve.LLM(TARGET, dtype="float32", log_memory_plan=False)
    generated = llm.generate(prompts, params, use_tqdm=False)

    engine = kvserve.LLMEngine(TARGET, dtype="float32", log_memory_plan=False)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    streamed: dict[tuple[str, int], str] = {}
    final: dict[tuple[str, int], str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                streamed[out.request_id, c.index] = streamed.get((out.request_id, c.index), "") + c.delta_text
                final[out.request_id, c.index] = c.text
    for i, out in enumerate(generated):
        for c in out.outputs:
            assert c.text == final[str(i), c.index] == streamed[str(i), c.index]
            assert len(c.token_ids) == 48


def incomplete_byte_token(tok: Tokenizer) -> int:
    """A token that decodes to U+FFFD alone: one byte of a multi-byte UTF-8 character."""
    for t in range(tok.vocab_size):
        if tok.decode([t]) == "\ufffd":
            return t
    pytest.skip("this tokenizer has no lone byte token")


def test_flush_releases_held_back_text_at_the_end(tokenizer):
    """A sample that ends inside a multi-byte character (or on a literal U+FFFD) keeps that
    text, as a decode of the whole output shows it; before, it was held back and dropped."""
    byte = incomplete_byte_token(tokenizer)
    clean = tokenizer.encode("Romeo", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1])
    for t in clean + [byte]:
        detok.add([t])
    assert not detok.text.endswith("\ufffd")  # held: the next token may complete it
    assert detok.flush() == detok.last_delta and detok.text.endswith("\ufffd")
    assert detok.text == tokenizer.decode_continuation([1], clean + [byte])
    assert detok.flush() == ""  # nothing more


def test_a_run_of_incomplete_bytes_is_not_held_forever(tokenizer):
    """Each held token widens the window every step decodes: past a few it is released."""
    byte = incomplete_byte_token(tokenizer)
    detok = IncrementalDetokenizer(tokenizer, [1])
    for i in range(40):
        detok.add([byte])
        assert len(detok._ids) - detok._read_offset <= 9, i
    assert detok.text.count("\ufffd") >= 30
    assert len(detok._ids) <= 4 * 6 + 10  # the ids list stays as short as the window
