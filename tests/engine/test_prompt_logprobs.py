"""SamplingParams(prompt_logprobs=N): every prompt token after the first scored under the tokens
before it, against transformers' log_softmax, through chunked prefill, preemption, prefix caching,
n samples and streamed ("delta") outputs; and the bounds on N."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvserve import SamplingParams
from tests.engine_loop import drain
from tests.engine_loop import fp32_engine as engine

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    return checkpoint_factory("LlamaForCausalLM")


@pytest.fixture(scope="module")
def reference(path):
    """log_softmax of transformers' fp64-rounded logits at every position of a prompt."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def score(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0]
        return torch.log_softmax(logits.double(), -1)

    return score


def prompt_of(length: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (length,), generator=g).tolist()


def check(entries, prompt: list[int], expected: torch.Tensor, num_top: int) -> None:
    """entries: [None, TokenLogprobs per prompt token after the first]."""
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        lp, row = entries[p], expected[p - 1]
        assert lp.token_id == prompt[p]
        assert lp.logprob == pytest.approx(row[prompt[p]].item(), abs=1e-4)
        assert lp.rank == int((row >= row[prompt[p]] - 1e-6).sum())
        top = row.topk(num_top)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [512, 7], ids=["one-prefill", "chunked-prefill"])
def test_prompt_logprobs_match_transformers(path, reference, budget):
    prompt = prompt_of(45)
    e = engine(path, max_num_batched_tokens=budget, max_num_seqs=4)
    e.add_request("a", prompt, SamplingParams(max_tokens=3, prompt_logprobs=4, **GREEDY))
    out = drain(e)["a"]
    check(out.prompt_logprobs, prompt, reference(prompt), 4)


def test_requests_without_them_have_none_and_a_one_token_prompt_has_only_the_leading_none(path):
    e = engine(path)
    e.add_request("plain", prompt_of(9), SamplingParams(max_tokens=2, **GREEDY))
    e.add_request("one", [5], SamplingParams(max_tokens=2, prompt_logprobs=0, **GREEDY))
    final = drain(e)
    assert final["plain"].prompt_logprobs is None
    assert final["one"].prompt_logprobs == [None]


def test_a_cached_prefix_is_computed_again_for_them_and_still_serves_the_others(path, reference):
    """A request that scores its prompt reads no cached prefix (vLLM's rule): its entries come
    from its own forward; a plain request after it still hits the cache."""
    prompt = prompt_of(40, seed=1)
    e = engine(path, block_size=8, enable_prefix_caching=True)
    e.add_request("warm", prompt, SamplingParams(max_tokens=1, **GREEDY))
    drain(e)
    e.add_request("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=2, **GREEDY))
    scored = drain(e)["scored"]
    assert scored.num_cached_tokens == 0
    check(scored.prompt_logprobs, prompt, reference(prompt), 2)
    e.add_request("again", prompt, SamplingParams(max_tokens=1, **GREEDY))
    assert drain(e)["again"].num_cached_tokens == 32


def test_preempted_requests_score_each_token_once(path, reference):
    """A pool too small for all of them at once: preempted sequences are recomputed, and their
    prompt entries are neither lost nor repeated."""
    prompts = [prompt_of(30 + 3 * i, seed=10 + i) for i in range(5)]
    e = engine(path, block_size=4, num_blocks=40, max_num_batched_tokens=16)
    for i, prompt in enumerate(prompts):
        e.add_request(str(i), prompt, SamplingParams(max_tokens=20, prompt_logprobs=1, **GREEDY))
    final = drain(e)
    assert e.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        check(final[str(i)].prompt_logprobs, prompt, reference(prompt), 1)


def test_n_samples_share_one_scoring_and_delta_outputs_carry_it_once(path, reference):
    prompt = prompt_of(21, seed=2)
    e = engine(path, max_num_batched_tokens=8)
    e.add_request("n", prompt, SamplingParams(n=3, max_tokens=4, seed=0, prompt_logprobs=0),
                  output_kind="delta")
    carried = []
    while e.has_unfinished_requests():
        for out in e.step():
            if out.prompt_logprobs is not None:
                carried.append(out.prompt_logprobs)
    assert len(carried) == 1
    check(carried[0], prompt, reference(prompt), 0)


@pytest.mark.parametrize("value, message", [
    (-1, "prompt_logprobs must be None or >= 0"),
    (10**6, "prompt_logprobs must be at most"),
])
def test_bad_prompt_logprobs_are_refused_and_the_engine_keeps_serving(path, value, message):
    e = engine(path)
    with pytest.raises(ValueError, match=message):
        e.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=2, prompt_logprobs=value)
                      if value >= 0 else SamplingParams(max_tokens=2, prompt_logprobs=value))
    e.add_request("good", [1, 2, 3], SamplingParams(max_tokens=2, **GREEDY))
    assert len(drain(e)["good"].outputs[0].token_ids) == 2
