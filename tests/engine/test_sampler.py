"""The Sampler (kvserve._C.Sampler), its random streams (kvserve._C.RequestRandom) and
SamplingParams validation. Masks are checked against kvserve.testing.reference and against
Hugging Face transformers' logits warpers; sampled tokens against the filtered distribution with
chi-square tests."""

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

import kvserve
from kvserve import SamplingParams
from kvserve._C import RequestRandom, Sampler
from kvserve.testing import reference

ops = torch.ops.kvserve
NUM_DRAWS = 20_000
P_VALUE = 1e-3  # seeded draws: a pass is deterministic; a real bias gives p-values far below this


def hf_filter(logits, params):
    """Hugging Face's warpers on one row [vocab]: temperature, top-k, top-p, min-p, in order."""
    scores, ids = logits[None].clone(), torch.zeros(1, 0, dtype=torch.long)
    warpers = [TemperatureLogitsWarper(float(params.temperature))]
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(params.min_p))
    for warper in warpers:
        scores = warper(ids, scores)
    return scores[0]


def param_tensors(params):
    """The per-row parameter tensors of the ops and the reference."""
    return (torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.long),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([p.min_p for p in params], dtype=torch.float32))


PARAM_GRID = [
    SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    for t, k, p, m in itertools.product([0.25, 0.8, 1.0, 1.9], [-1, 1, 3, 10, 50],
                                        [1.0, 0.95, 0.7, 0.3, 0.05], [0.0, 0.02, 0.2, 0.9])
]


@pytest.mark.parametrize("vocab", [5, 50, 1000])
def test_masks_equal_reference_and_hugging_face(vocab):
    """Every (temperature, top_k, top_p, min_p) of the grid, each on its own random row."""
    g = torch.Generator().manual_seed(vocab)
    rows = len(PARAM_GRID)
    logits = torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g).mul(6)
    filtered = logits.clone()
    randoms = [RequestRandom(r) for r in range(rows)]
    tokens = Sampler().sample(filtered, PARAM_GRID, randoms)  # filters the logits in place
    kept = ~filtered.isneginf()
    want = reference.sampling_filter_logits(logits, *param_tensors(PARAM_GRID))
    assert torch.equal(kept, ~want.isneginf()), "masks differ from the reference in rows " + str(
        torch.nonzero((kept != ~want.isneginf()).any(1)).flatten().tolist())
    for r, params in enumerate(PARAM_GRID):
        hf = hf_filter(logits[r], params)
        assert torch.equal(kept[r], ~hf.isneginf()), f"row {r} {params}: differs from transformers"
        torch.testing.assert_close(filtered[r][kept[r]], hf[kept[r]], atol=0, rtol=0)
    assert kept[torch.arange(rows), tokens].all(), "sampled a removed token"
    # The grid must exercise the filters, or this test could not fail.
    assert (kept.sum(1) == 1).any() and (kept.sum(1) == vocab).any()
    assert kept.sum(1).float().mean() < 0.6 * vocab


def test_greedy_is_argmax_and_draws_no_random_number():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie: the first index wins
    stream, fresh = RequestRandom(11), RequestRandom(11)
    greedy = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5)] * 64
    tokens = Sampler().sample(logits.clone(), greedy, [stream] * 64)
    assert tokens.dtype == torch.long and tokens.device.type == "cpu"
    assert torch.equal(tokens, logits.argmax(dim=1)) and tokens[0] == 5
    assert stream.next_uniform() == fresh.next_uniform(), "greedy rows consumed random numbers"


# A small vocabulary where each filter removes something: top-k drops the last 4 tokens, top-p
# and min-p then drop more of the tail.
CHI_LOGITS = torch.tensor([3.0, 2.6, 2.2, 2.1, 1.5, 1.0, 0.7, 0.2, -0.5, -1.0, -2.0, -3.0])
CHI_PARAMS = SamplingParams(temperature=0.8, top_k=8, top_p=0.95, min_p=0.1)


def chi_square_pvalues(tokens, params):
    """(p-value against the filtered distribution, p-value against the unfiltered softmax at
    temperature 1, the wrong target) of the token counts; removed tokens must never appear."""
    probs = reference.sampling_probs(CHI_LOGITS[None], *param_tensors([params]))[0].numpy()
    counts = np.bincount(tokens.numpy(), minlength=CHI_LOGITS.numel())
    kept = probs > 0
    assert counts[~kept].sum() == 0, f"sampled removed tokens: {counts}"
    wrong = torch.softmax(CHI_LOGITS.double(), 0).numpy()[kept]
    wrong = wrong / wrong.sum()
    return (stats.chisquare(counts[kept], probs[kept] * len(tokens)).pvalue,
            stats.chisquare(counts[kept], wrong * len(tokens)).pvalue)


def test_chi_square_setup_uses_every_filter():
    tensors = param_tensors([CHI_PARAMS])

    def kept(k, p, m):
        probs = reference.sampling_probs(CHI_LOGITS[None], tensors[0], torch.tensor([k]),
                                         torch.tensor([p]), torch.tensor([m]))
        return int((probs > 0).sum())

    assert kept(-1, 1.0, 0.0) == 12
    assert kept(8, 1.0, 0.0) == 8
    assert kept(8, 0.95, 0.0) < 8
    assert kept(8, 0.95, 0.1) < kept(8, 0.95, 0.0)
    assert kept(8, 0.95, 0.1) >= 3


def test_op_sampling_matches_filtered_distribution():
    uniform = torch.from_numpy(np.random.default_rng(1234).random(NUM_DRAWS, dtype=np.float32))
    params = param_tensors([CHI_PARAMS] * NUM_DRAWS)
    logits = CHI_LOGITS.repeat(NUM_DRAWS, 1)
    ops.sampling_filter_logits(logits, *params)
    tokens = ops.sampling_from_logits(logits, params[0], uniform)
    p_value, p_wrong = chi_square_pvalues(tokens, CHI_PARAMS)
    assert p_value > P_VALUE
    assert p_wrong < 1e-9, "the test cannot tell the filtered distribution from a wrong one"


def test_sampler_matches_filtered_distribution():
    """200 seeded requests, 100 steps each: every stream and every step samples the target."""
    num_requests, num_steps = 200, NUM_DRAWS // 200
    randoms = [RequestRandom(seed) for seed in range(num_requests)]
    params = [CHI_PARAMS] * num_requests
    sampler = Sampler()
    tokens = torch.cat([sampler.sample(CHI_LOGITS.repeat(num_requests, 1), params, randoms)
                        for _ in range(num_steps)])
    p_value, p_wrong = chi_square_pvalues(tokens, CHI_PARAMS)
    assert p_value > P_VALUE
    assert p_wrong < 1e-9


def test_request_random_is_reproducible_and_uniform():
    a, b, other = RequestRandom(42), RequestRandom(42), RequestRandom(43)
    draws = [a.next_uniform() for _ in range(5000)]
    assert draws == [b.next_uniform() for _ in range(5000)]
    assert draws != [other.next_uniform() for _ in range(5000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert stats.kstest(draws, "uniform").pvalue > P_VALUE
    first, second = RequestRandom(), RequestRandom()  # seeded from std::random_device
    assert [first.next_uniform() for _ in range(4)] != [second.next_uniform() for _ in range(4)]


def test_seeded_sampler_reproduces_tokens():
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(4, 100, generator=g) for _ in range(30)]
    params = [SamplingParams(temperature=1.2, top_k=40, seed=s) for s in (1, 2, 3, 4)]

    def run():
        randoms = [RequestRandom(p.seed) for p in params]
        return torch.stack([Sampler().sample(x.clone(), params, randoms) for x in steps])

    first = run()
    assert torch.equal(first, run())
    assert len(set(first[:, 0].tolist())) > 5, "a seeded stream should still vary across steps"


def test_same_seed_same_token_whatever_the_batch():
    """A seeded row samples the same tokens alone, and in batches of other rows (greedy rows,
    other seeds, other parameters) at any position."""
    g = torch.Generator().manual_seed(5)
    num_steps, vocab = 25, 64
    target = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    target_logits = [torch.randn(vocab, generator=g) for _ in range(num_steps)]
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=5, seed=1),
              SamplingParams(temperature=0.5, min_p=0.1, seed=2), SamplingParams(temperature=1.0)]

    def run(batch_params, position):
        target_random = RequestRandom(target.seed)
        randoms = [RequestRandom(p.seed) for p in batch_params]
        tokens = []
        for step in range(num_steps):
            rows = [torch.randn(vocab, generator=g) for _ in batch_params]
            rows.insert(position, target_logits[step])
            params = batch_params[:position] + [target] + batch_params[position:]
            streams = randoms[:position] + [target_random] + randoms[position:]
            tokens.append(int(Sampler().sample(torch.stack(rows), params, streams)[position]))
        return tokens

    alone = run([], 0)
    assert len(set(alone)) > 3
    assert run(others, 0) == alone
    assert run(others, 2) == alone
    assert run(others[:1] * 3, 3) == alone
    assert run(others[1:] * 5, 7) == alone


def test_sampler_rejects_mismatched_rows():
    with pytest.raises(RuntimeError, match="one SamplingParams and one random stream per row"):
        Sampler().sample(torch.randn(3, 10), [SamplingParams()] * 2, [RequestRandom(0)] * 3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(temperature=math.nan), "temperature must be a finite number >= 0"),
        (dict(temperature=math.inf), "temperature must be a finite number >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
        (dict(top_p=-0.5), r"top_p must be in \(0, 1\]"),
        (dict(top_p=math.nan), r"top_p must be in \(0, 1\]"),
        (dict(top_k=0), r"top_k must be -1 \(off\) or >= 1"),
        (dict(top_k=-2), r"top_k must be -1 \(off\) or >= 1"),
        (dict(min_p=-0.01), r"min_p must be in \[0, 1\]"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(min_p=math.nan), r"min_p must be in \[0, 1\]"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(max_tokens=-3), "max_tokens must be >= 1"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_invalid_sampling_params_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-6),
                                    dict(top_k=-1), dict(top_k=1), dict(min_p=0.0),
                                    dict(min_p=1.0), dict(max_tokens=1)], ids=str)
def test_boundary_sampling_params_are_valid(kwargs):
    params = SamplingParams(**kwargs)
    params.validate()
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_sampling_params_is_the_public_class():
    assert kvserve.SamplingParams is SamplingParams
