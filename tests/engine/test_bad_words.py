"""vLLM's bad_words end to end on the shipped model: the engine tokenizes each word alone and after
a space; greedy generation never completes one and equals transformers' generate with the same
bad_words_ids; the caller's SamplingParams stay as given; a model without a tokenizer and bad
values are a ValueError before anything runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import kvserve
from kvserve import SamplingParams

transformers = pytest.importorskip("transformers")

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "shakespeare-target"
PROMPTS = ["ROMEO:\nBut soft, what light", "JULIET:\nO Romeo, Romeo!", "First Citizen:\n"]


@pytest.fixture(scope="module")
def llm():
    return kvserve.LLM(SHIPPED, dtype="float32", max_model_len=256)


def contains(ids: list[int], sequence: list[int]) -> bool:
    return any(ids[i:i + len(sequence)] == sequence for i in range(len(ids) - len(sequence) + 1))


def output_words(llm, params, count: int) -> list[str]:
    """Words of at least three letters the unconstrained greedy outputs write."""
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    words = []
    for word in " ".join(texts).split():
        word = word.strip(".,;:!?'\"")
        if len(word) >= 3 and word.isalpha() and word not in words:
            words.append(word)
    return words[:count]


def test_each_word_alone_and_after_a_space(llm):
    tokenizer = llm.get_tokenizer()
    for word in ["thee", "  Romeo", "wherefore art"]:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        want = [alone] + ([spaced] if len(spaced) == len(alone) and spaced[0] != alone[0]
                          else [])
        assert llm.llm_engine._bad_words_token_ids((word,)) == want


def test_greedy_output_never_completes_a_bad_word_and_equals_transformers(llm):
    free = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    words = output_words(llm, free, 4)
    assert len(words) == 4
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, bad_words=words)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert params.bad_words_token_ids == []  # the caller's object is left as given
    banned = llm.llm_engine._bad_words_token_ids(tuple(words))
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free, use_tqdm=False)]
    assert any(contains(ids, seq) for ids in before for seq in banned), "the ban must bite"
    reference = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert not any(contains(ids, seq) for seq in banned)
        prompt = torch.tensor([out.prompt_token_ids])
        # transformers also reads the prompt; these prompts do not end with any word's prefix.
        assert not any(contains(out.prompt_token_ids[1 - len(seq):] + ids[:len(seq) - 1], seq)
                       for seq in banned if len(seq) > 1)
        want = reference.generate(prompt, max_new_tokens=32, do_sample=False,
                                  bad_words_ids=banned, eos_token_id=None, pad_token_id=0)
        assert ids == want[0, prompt.shape[1]:].tolist()


def test_bad_words_over_http_fields_and_limits(llm, tmp_path):
    with pytest.raises(ValueError, match="bad_words must not be empty or blank"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(ValueError, match="at most 128 bad_words"):
        SamplingParams(bad_words=[f"w{i}" for i in range(129)])
    model = tmp_path / "model"
    shutil.copytree(SHIPPED, model)
    (model / "tokenizer.json").unlink()
    bare = kvserve.LLM(model, dtype="float32", max_model_len=64)
    steps = bare.llm_engine.get_stats().num_steps
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        bare.generate([[1, 2, 3]], SamplingParams(max_tokens=2, bad_words=["x"]), use_tqdm=False)
    assert bare.llm_engine.get_stats().num_steps == steps
    # Token sequences beyond the vocabulary (set directly, as a C++ caller would) are refused.
    params = SamplingParams(max_tokens=2)
    params.bad_words_token_ids = [[3, 10**6]]
    with pytest.raises(ValueError, match="bad word token id 1000000 is outside the vocabulary"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    # bad_words without their tokens reach the C++ engine only from a C++ caller: refused.
    params = SamplingParams(max_tokens=2, bad_words=["x"])
    with pytest.raises(ValueError, match="LLMEngine.add_request tokenizes them"):
        llm.llm_engine.engine.add_request("raw", [1, 2, 3], params)
