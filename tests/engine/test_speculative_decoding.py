"""Speculative decoding end to end: greedy outputs are token-identical to plain decoding (draft
model and n-gram, alone and 32 mixed requests with preemption, chunked prefill and prefix caching);
sampled outputs follow the target's exact distribution (chi-square against an enumeration with
transformers; a broken rule fails the same test); a randomized run keeps every invariant; bad
options and mismatched drafts are rejected at start."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.quantization.quantize import quantize_checkpoint
from tests.engine_loop import drain, fp32_engine
from tests.engine_loop import run_arrivals as run

transformers = pytest.importorskip("transformers")
stats = pytest.importorskip("scipy.stats")

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "shakespeare-target"
DRAFT = REPO / "models" / "shakespeare-draft"

# Speculate at any batch size (by default k shrinks with the number of running sequences).
UNLIMITED = dict(speculative_disable_batch_size=0, speculative_max_verify_tokens=0)
SPECULATION = {
    "draft": dict(speculative_model=DRAFT, num_speculative_tokens=4,
                  **UNLIMITED),
    # The draft's projections and head rounded to int8 as they load (cheaper draft steps).
    "draft-int8": dict(speculative_model=DRAFT, speculative_quantization="int8",
                       num_speculative_tokens=4, **UNLIMITED),
    # The target as its own draft: almost every draft is accepted (the bonus-token path).
    "self-draft": dict(speculative_model=TARGET, num_speculative_tokens=3,
                       **UNLIMITED),
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=5, prompt_lookup_min=1,
                  prompt_lookup_max=3, **UNLIMITED),
}
PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n",
           "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
           "KING RICHARD III:\nNow is the winter of our discontent\n"]


@pytest.fixture(scope="module")
def plain():
    return LLM(TARGET, dtype="float32")


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", sorted(SPECULATION))
def test_greedy_single_requests_equal_plain_decoding(plain, name):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [tokens(plain.generate([p], params, use_tqdm=False))[0] for p in PROMPTS]
    llm = LLM(TARGET, dtype="float32", **SPECULATION[name])
    got = [tokens(llm.generate([p], params, use_tqdm=False))[0] for p in PROMPTS]
    assert got == want
    s = llm.llm_engine.get_stats()
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens <= s.num_draft_tokens
    if name == "self-draft":
        assert s.acceptance_rate > 0.9


def mixed_requests(tokenizer, count: int = 24, seed: int = 0):
    """(prompt ids, max_tokens, arrival step): half the prompts share a 3-block prefix."""
    rng = random.Random(seed)
    shared = tokenizer.encode(PROMPTS[2] * 2)[:48]
    requests = []
    for i in range(count):
        tail = tokenizer.encode(rng.choice(PROMPTS), add_special_tokens=False)
        prompt = (shared if i % 2 else [1]) + tail[:rng.randrange(1, len(tail) + 1)]
        requests.append((prompt, rng.randrange(8, 64), rng.randrange(0, 8)))
    return requests


@pytest.fixture(scope="module")
def alone(plain):
    """Each mixed request decoded by itself without speculation."""
    e = plain.llm_engine
    return {str(i): run(e, [(prompt, n, 0)])["0"]
            for i, (prompt, n, _) in enumerate(mixed_requests(plain.tokenizer))}


@pytest.mark.parametrize("name", sorted(SPECULATION))
def test_greedy_mixed_arrivals_with_preemption_chunking_and_prefix_caching(plain, alone, name):
    # 16 blocks of 16 tokens cannot hold the peak load: sequences are preempted and recomputed.
    e = fp32_engine(TARGET, num_blocks=16, max_num_batched_tokens=40, **SPECULATION[name])
    got = run(e, mixed_requests(plain.tokenizer))
    assert got == alone
    s = e.get_stats()
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0 and s.num_accepted_tokens > 0


# ----------------------------------------------------------------- distribution exactness

VOCAB, PROMPT, NEW_TOKENS, SAMPLES = 6, [1, 3, 5], 4, 12000
FILTERS = {"temperature 1": dict(temperature=1.0),
           "top-k and top-p": dict(temperature=0.9, top_k=4, top_p=0.85)}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny-vocabulary target and an unrelated draft (no tokenizers: token ids only)."""
    from kvserve.testing.checkpoints import make_checkpoint

    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1, initializer_range=0.08, with_tokenizer=False)
    target = make_checkpoint(tmp_path_factory.mktemp("target"), seed=1, **shape)
    draft = make_checkpoint(tmp_path_factory.mktemp("draft"), seed=2, **shape)
    return target, draft


def conditionals(path: Path, sampling: dict, dtype: torch.dtype = torch.float64
                 ) -> dict[tuple, torch.Tensor]:
    """The processed next-token distribution after PROMPT + every prefix of up to NEW_TOKENS - 1
    generated tokens, from transformers' model (in `dtype`: fp32 for the models whose experts it
    multiplies in fp32 only) and its logits warpers."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    warpers = [TemperatureLogitsWarper(sampling["temperature"])]
    if sampling.get("top_k", -1) > 0:
        warpers.append(TopKLogitsWarper(sampling["top_k"]))
    if sampling.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(sampling["top_p"]))
    sequences = list(itertools.product(range(VOCAB), repeat=NEW_TOKENS - 1))
    ids = torch.tensor([PROMPT + list(s) for s in sequences])
    with torch.no_grad():
        logits = model(ids).logits
    table = {}
    for row, seq in enumerate(sequences):
        for n in range(NEW_TOKENS):
            prefix = tuple(seq[:n])
            if prefix in table:
                continue
            x = logits[row:row + 1, len(PROMPT) - 1 + n]
            for w in warpers:
                x = w(ids[row:row + 1, :len(PROMPT) + n], x)
            table[prefix] = torch.softmax(x[0], dim=-1)
    return table


def joint(table) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        prob = 1.0
        for n in range(NEW_TOKENS):
            prob *= float(table[seq[:n]][seq[n]])
        out[seq] = prob
    return out


def chi_square_pvalue(counts: dict[tuple, int], expected: dict[tuple, float], n: int) -> float:
    """Pearson's test over the joint outcomes, outcomes expected fewer than 5 times pooled."""
    observed, wanted, pool_obs, pool_exp = [], [], 0, 0.0
    assert sum(counts.values()) == n
    for seq, prob in expected.items():
        if prob * n < 5:
            pool_obs += counts.get(seq, 0)
            pool_exp += prob * n
        else:
            observed.append(counts.get(seq, 0))
            wanted.append(prob * n)
    if pool_exp > 0:
        observed.append(pool_obs)
        wanted.append(pool_exp)
    total = sum(wanted)
    return stats.chisquare(observed, [w * n / total for w in wanted]).pvalue


def engine_counts(path: Path, speculation: dict, sampling: dict) -> dict[tuple, int]:
    e = fp32_engine(path, max_model_len=32, **speculation)
    for i in range(SAMPLES):
        e.add_request(str(i), PROMPT, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True,
                                                     seed=i, **sampling))
    final = drain(e)
    s = e.get_stats()
    assert s.num_draft_tokens > SAMPLES // 2 and 0 < s.num_accepted_tokens < s.num_draft_tokens
    counts: dict[tuple, int] = {}
    for out in final.values():
        key = tuple(out.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("filters", sorted(FILTERS))
@pytest.mark.parametrize("method", ["draft", "draft-int8", "ngram"])
def test_sampled_tokens_follow_the_target_distribution(tiny_pair, method, filters):
    target, draft = tiny_pair
    speculation = (dict(speculative_model=draft, num_speculative_tokens=3)
                   if method.startswith("draft")
                   else dict(speculative_method="ngram", num_speculative_tokens=3,
                             prompt_lookup_min=1, prompt_lookup_max=2))
    if method == "draft-int8":  # the rounded draft's own distribution, still the target's output
        speculation["speculative_quantization"] = "int8"
    speculation.update(UNLIMITED)  # 12,000 requests run 256 at a time
    expected = joint(conditionals(target, FILTERS[filters]))
    counts = engine_counts(target, speculation, FILTERS[filters])
    assert chi_square_pvalue(counts, expected, SAMPLES) > 1e-4


def simulate_broken(p_table, q_table, n: int, k: int, seed: int = 0) -> dict[tuple, int]:
    """Speculative sampling with a plausible bug (on rejection, resample from p instead of the
    residual max(p - q, 0)), over the same enumerated conditionals."""
    rng = random.Random(seed)

    def draw(probs) -> int:
        return rng.choices(range(VOCAB), weights=[float(v) for v in probs])[0]

    counts: dict[tuple, int] = {}
    for _ in range(n):
        seq = [draw(p_table[()])]  # the prompt's sample is never speculative
        while len(seq) < NEW_TOKENS:
            drafts = []
            for _ in range(min(k, NEW_TOKENS - len(seq) - 1)):
                drafts.append(draw(q_table[tuple(seq + drafts)]))
            for x in drafts:
                prefix = tuple(seq)
                if rng.random() * float(q_table[prefix][x]) < float(p_table[prefix][x]):
                    seq.append(x)
                else:
                    seq.append(draw(p_table[prefix]))  # the bug
                    break
            else:
                seq.append(draw(p_table[tuple(seq)]))
        key = tuple(seq[:NEW_TOKENS])
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_a_broken_rejection_rule_fails_the_same_test(tiny_pair):
    target, draft = tiny_pair
    p_table = conditionals(target, FILTERS["temperature 1"])
    q_table = conditionals(draft, FILTERS["temperature 1"])
    counts = simulate_broken(p_table, q_table, SAMPLES, k=3)
    assert chi_square_pvalue(counts, joint(p_table), SAMPLES) < 1e-6


# ------------------------------------------------------------------------------- robustness

def test_randomized_run_keeps_invariants_and_counts_drafts(plain):
    rng = random.Random(5)
    requests = mixed_requests(plain.tokenizer, count=24, seed=3)

    def params(i: int, n: int) -> SamplingParams:
        kind = i % 4
        if kind == 0:
            return SamplingParams(temperature=0.0, max_tokens=n, logprobs=2)
        if kind == 1:
            return SamplingParams(temperature=0.9, top_p=0.9, max_tokens=n, seed=i, n=2)
        if kind == 2:
            return SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.3,
                                  min_tokens=min(5, n), max_tokens=n, seed=i)
        return SamplingParams(temperature=0.7, top_k=10, max_tokens=n, stop_token_ids=[13],
                              seed=i)

    e = fp32_engine(TARGET, num_blocks=36, max_num_batched_tokens=48,
                    speculative_model=DRAFT, num_speculative_tokens=5,
                    **UNLIMITED)
    pending = sorted((arrival, i, prompt, n) for i, (prompt, n, arrival) in enumerate(requests))
    finished, step, accepted = {}, 0, 0
    while pending or e.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i, prompt, n = pending.pop(0)
            e.add_request(str(i), prompt, params(i, n))
        if step % 7 == 3 and rng.random() < 0.5:
            e.abort_request(str(rng.randrange(len(requests))))
        for out in e.step():
            if out.finished:
                finished[out.request_id] = out
                accepted += out.metrics.num_accepted_tokens
                if int(out.request_id) % 4 == 0 and out.outputs[0].finish_reason != "abort":
                    assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
        e.scheduler.check_invariants()
        step += 1
    blocks = e.block_manager
    assert blocks.num_free_blocks() == blocks.num_usable_blocks() and blocks.num_sequences() == 0
    assert len(finished) == len(requests)
    s = e.get_stats()
    assert s.num_accepted_tokens == accepted > 0
    assert sum(s.accepted_per_position) == s.num_accepted_tokens
    assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:]))
    assert s.propose_seconds > 0 and s.verify_seconds > 0
    for out in finished.values():
        params_n = len(out.outputs)
        assert all(c.finish_reason in ("length", "stop", "abort") for c in out.outputs), out
        assert params_n in (1, 2)


def test_logprobs_with_speculation_equal_plain_logprobs(plain):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3)
    want = plain.generate(PROMPTS[:2], params, use_tqdm=False)
    llm = LLM(TARGET, dtype="float32", speculative_method="ngram", num_speculative_tokens=4)
    got = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.token_id == lb.token_id and la.rank == lb.rank
            assert abs(la.logprob - lb.logprob) < 1e-4
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
    assert llm.llm_engine.get_stats().num_accepted_tokens > 0


@pytest.mark.parametrize("name", ["draft", "self-draft", "ngram"])
def test_greedy_with_logit_bias_equals_plain_decoding(plain, name):
    # A bias moves the greedy argmax: the drafts must see it too (no raw-argmax shortcut), or
    # nearly every one is rejected; the output is plain decoding's under the same bias.
    unbiased = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = tokens(plain.generate(PROMPTS[1:3], unbiased, use_tqdm=False))
    bias = {t: -4.0 for t in {*first[0][:6], *first[1][:6]}}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logit_bias=bias)
    want = tokens(plain.generate(PROMPTS[1:3], params, use_tqdm=False))
    assert want != first
    llm = LLM(TARGET, dtype="float32", **SPECULATION[name])
    assert tokens(llm.generate(PROMPTS[1:3], params, use_tqdm=False)) == want
    s = llm.llm_engine.get_stats()
    assert s.num_accepted_tokens > 0
    if name == "self-draft":
        assert s.acceptance_rate > 0.9


@pytest.mark.parametrize("name", ["draft", "self-draft", "ngram"])
def test_greedy_with_bad_words_equals_plain_decoding(plain, name):
    # A bad word's ban depends on the tokens before it: each verified position must see the
    # drafts accepted before it, and the drafts the ban, or the output leaves plain decoding's.
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = plain.generate(PROMPTS[1:3], free, use_tqdm=False)
    words = sorted({w for o in first for w in o.outputs[0].text.split() if w.isalpha()})[:6]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, bad_words=words)
    want = tokens(plain.generate(PROMPTS[1:3], params, use_tqdm=False))
    assert want != tokens(first)
    llm = LLM(TARGET, dtype="float32", **SPECULATION[name])
    assert tokens(llm.generate(PROMPTS[1:3], params, use_tqdm=False)) == want
    s = llm.llm_engine.get_stats()
    assert s.num_accepted_tokens > 0
    if name == "self-draft":
        assert s.acceptance_rate > 0.9


@pytest.mark.parametrize("name", ["draft", "ngram"])
def test_seeded_samples_do_not_depend_on_the_batch_at_a_fixed_k(name):
    # Each request draws its drafts and verification numbers from its own stream, so at a fixed
    # k (UNLIMITED; a pool that holds every draft) its tokens are those it samples alone.
    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_k=[-1, 20][i % 2], max_tokens=24,
                              ignore_eos=True, seed=100 + i, n=1 + i % 2,
                              repetition_penalty=[1.0, 1.2][i % 2])

    def sample(requests: list[int]):
        e = fp32_engine(TARGET, **SPECULATION[name])
        for i in requests:
            e.add_request(str(i), PROMPTS[i], params(i))
        out = {int(i): [c.token_ids for c in o.outputs] for i, o in drain(e).items()}
        return out, e.get_stats().num_accepted_tokens

    alone = {i: sample([i])[0][i] for i in range(len(PROMPTS))}
    together, accepted = sample(list(range(len(PROMPTS))))
    assert together == alone and accepted > 0


def test_k_shrinks_with_the_number_of_running_sequences():
    e = fp32_engine(TARGET, speculative_method="ngram", num_speculative_tokens=4,
                    prompt_lookup_min=1, speculative_max_verify_tokens=6)
    for i in range(3):
        e.add_request(str(i), PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=30))
    e.step()  # the prompts
    while e.scheduler.num_running == 3:
        before = e.get_stats().num_draft_tokens
        e.step()
        assert e.get_stats().num_draft_tokens - before <= 3 * (6 // 3 - 1)  # k = 1
    drain(e)
    assert e.get_stats().num_drafts > 0


def test_speculation_pauses_at_the_batch_size_limit():
    e = fp32_engine(TARGET, speculative_method="ngram", num_speculative_tokens=4,
                    prompt_lookup_min=1, speculative_disable_batch_size=3)
    for i in range(3):
        e.add_request(str(i), PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=20))
    for _ in range(4):
        e.step()
    assert e.get_stats().num_drafts == 0  # three running: no speculation
    e.abort_request("0")
    e.abort_request("1")
    drain(e)
    assert e.get_stats().num_drafts > 0  # one left: it speculates


def test_bad_options_and_mismatched_drafts_are_rejected_at_start(checkpoint_factory, tmp_path):
    int8_draft = tmp_path / "draft-int8"
    quantize_checkpoint(DRAFT, int8_draft, "int8")
    cases = [
        (dict(speculative_method="bogus"), "speculative_method must be"),
        (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2),
         "prompt_lookup_min"),
        (dict(num_speculative_tokens=3), "needs speculative_model"),
        (dict(speculative_quantization="int8"), "needs speculative_model=DIR"),
        (dict(speculative_model=DRAFT, speculative_quantization="int2"),
         "speculative_quantization must be"),
        (dict(speculative_model=int8_draft, speculative_quantization="int8"),
         "quantized already"),
        (dict(speculative_method="draft_model"), "needs speculative_model"),
        (dict(speculative_model=DRAFT, speculative_method="ngram"), "cannot be used"),
        (dict(speculative_model=checkpoint_factory("LlamaForCausalLM")), "vocabulary"),
        (dict(speculative_model=checkpoint_factory("LlamaForCausalLM", vocab_size=1024)),
         "another tokenizer"),
        (dict(speculative_model=checkpoint_factory(
            "LlamaForCausalLM", vocab_size=1024, with_tokenizer=False)), "no tokenizer.json"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(TARGET, **kwargs)
    short = tmp_path / "short-draft"  # the shipped draft, told it handles 512 positions
    short.mkdir()
    for f in DRAFT.iterdir():
        (short / f.name).symlink_to(f)
    config = json.loads((DRAFT / "config.json").read_text())
    (short / "config.json").unlink()
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    with pytest.raises(ValueError, match="handles 512 positions"):
        LLM(TARGET, speculative_model=short)
    with pytest.raises(FileNotFoundError):
        LLM(TARGET, speculative_model=REPO / "no-such-draft")


def test_defaults_follow_the_documented_rule():
    from kvserve.speculative import (DEFAULT_DISABLE_BATCH_SIZE, DEFAULT_MAX_VERIFY_TOKENS,
                                     DEFAULT_NUM_SPECULATIVE_TOKENS,
                                     DEFAULT_NUM_SPECULATIVE_TOKENS_BY_METHOD)

    spec = fp32_engine(TARGET, speculative_model=DRAFT).engine.config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.disable_batch_size,
            spec.max_verify_tokens) == ("draft_model",
                                        DEFAULT_NUM_SPECULATIVE_TOKENS_BY_METHOD["draft_model"],
                                        DEFAULT_DISABLE_BATCH_SIZE, DEFAULT_MAX_VERIFY_TOKENS)
    spec = fp32_engine(TARGET, speculative_method="ngram").engine.config.speculative
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", DEFAULT_NUM_SPECULATIVE_TOKENS)
    assert not fp32_engine(TARGET).engine.config.speculative.enabled


def test_int8_draft_holds_int8_projections():
    """speculative_quantization="int8" rounds the draft's projections and head as they load:
    the draft model holds about a quarter of their fp32 bytes (its embedding stays)."""
    fp32 = LLM(TARGET, dtype="float32", speculative_model=DRAFT).llm_engine.draft_model
    int8 = LLM(TARGET, dtype="float32", speculative_model=DRAFT,
               speculative_quantization="int8").llm_engine.draft_model
    config = json.loads((DRAFT / "config.json").read_text())
    embedding = config["vocab_size"] * config["hidden_size"] * 4
    projections = fp32.weight_bytes - embedding
    assert int8.weight_bytes - embedding < 0.3 * projections
