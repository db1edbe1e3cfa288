"""The Sampler (kvserve._C.Sampler), its random streams (kvserve._C.RequestRandom) and
SamplingParams validation. Masks are checked against kvserve.testing.reference and against
Hugging Face transformers' logits warpers; sampled tokens against the filtered distribution with
chi-square tests. Penalties against reference.apply_penalties and transformers'
RepetitionPenaltyLogitsProcessor; logit_bias against transformers' SequenceBiasLogitsProcessor;
bad words against its NoBadWordsLogitsProcessor over the output tokens;
logprobs against torch.log_softmax of the raw logits."""

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (MinPLogitsWarper,
                                                    NoBadWordsLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

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
    for t, k, p, m in itertools.product([0.25, 0.8, 1.0, 1.9], [-1, 0, 1, 3, 10, 50],
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
        (dict(top_k=-2), r"top_k must be -1 or 0 \(off\) or in \[1, 2147483647\]"),
        (dict(top_k=2**31), r"top_k must be -1 or 0 \(off\) or in \[1, 2147483647\]"),
        (dict(min_p=-0.01), r"min_p must be in \[0, 1\]"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(min_p=math.nan), r"min_p must be in \[0, 1\]"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(max_tokens=-3), "max_tokens must be >= 1"),
        (dict(n=0), r"n must be in \[1, 1024\]"),
        (dict(n=-1), r"n must be in \[1, 1024\]"),
        (dict(n=2**62), r"n must be in \[1, 1024\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=-1.0), "repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=math.nan), "repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=math.inf), "repetition_penalty must be a finite number > 0"),
        (dict(presence_penalty=2.01), r"presence_penalty must be in \[-2, 2\]"),
        (dict(presence_penalty=-2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(presence_penalty=math.nan), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=3.0), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=-2.01), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=math.nan), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(min_tokens=-1), r"min_tokens must be in \[0, max_tokens=16\]"),
        (dict(min_tokens=17), r"min_tokens must be in \[0, max_tokens=16\]"),
        (dict(min_tokens=5, max_tokens=4), r"min_tokens must be in \[0, max_tokens=4\]"),
        (dict(logprobs=-1), "logprobs must be None or >= 0"),
        (dict(stop=[""]), "stop strings must be non-empty"),
        (dict(stop=["ok", ""]), "stop strings must be non-empty"),
        (dict(stop=""), "stop strings must be non-empty"),
        (dict(stop_token_ids=[3, -1]), "stop_token_ids must be non-negative"),
        (dict(logit_bias={3: 100.5}), r"logit_bias values must be in \[-100, 100\]"),
        (dict(logit_bias={3: -101.0}), r"logit_bias values must be in \[-100, 100\]"),
        (dict(logit_bias={3: math.nan}), r"logit_bias values must be in \[-100, 100\]"),
        (dict(logit_bias={3: math.inf}), r"logit_bias values must be in \[-100, 100\]"),
        (dict(logit_bias={-1: 1.0}), "logit_bias token ids must be non-negative"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
        (dict(allowed_token_ids=[3, -2]), "allowed_token_ids must be non-negative"),
        (dict(bad_words=["ok", " \n "]), "bad_words must not be empty or blank"),
        (dict(bad_words=[""]), "bad_words must not be empty or blank"),
        (dict(bad_words=["x"] * 129), "at most 128 bad_words"),
        (dict(bad_words=["y" * 1025]), "at most 1024 bytes"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be None, -1"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens must be None, -1"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_invalid_sampling_params_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-6),
                                    dict(top_k=-1), dict(top_k=0), dict(top_k=1),
                                    dict(min_p=0.0),
                                    dict(min_p=1.0), dict(max_tokens=1), dict(n=1), dict(n=8),
                                    dict(repetition_penalty=1e-3),
                                    dict(repetition_penalty=1.0),
                                    dict(presence_penalty=-2.0), dict(presence_penalty=2.0),
                                    dict(frequency_penalty=-2.0),
                                    dict(frequency_penalty=2.0), dict(min_tokens=0),
                                    dict(min_tokens=16), dict(logprobs=0), dict(logprobs=20),
                                    dict(stop=["\n\n", "END"]), dict(stop=[]),
                                    dict(logit_bias={}), dict(logit_bias={0: -100.0, 7: 100.0}),
                                    dict(allowed_token_ids=[5]),
                                    dict(allowed_token_ids=[5, 5, 0]),
                                    dict(include_stop_str_in_output=True)], ids=str)
def test_boundary_sampling_params_are_valid(kwargs):
    params = SamplingParams(**kwargs)
    params.validate()
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_sampling_params_is_the_public_class():
    assert kvserve.SamplingParams is SamplingParams


def test_new_fields_default_off_and_keywords_only():
    params = SamplingParams()
    assert (params.n, params.repetition_penalty, params.presence_penalty,
            params.frequency_penalty, params.min_tokens, params.logprobs, params.stop,
            params.include_stop_str_in_output, params.logit_bias,
            params.allowed_token_ids, params.bad_words,
            params.bad_words_token_ids) == (1, 1.0, 0.0, 0.0, 0, None, [], False, {}, None, [], [])
    with pytest.raises(TypeError):
        SamplingParams(1.0)  # keyword-only


def test_sampling_params_keywords_and_repr():
    params = SamplingParams(stop=["\n\n", "it's"], n=2, logprobs=3, temperature=0.7, top_k=5,
                            repetition_penalty=1.1, presence_penalty=-0.5,
                            frequency_penalty=0.25, seed=9, max_tokens=30, min_tokens=4,
                            ignore_eos=True, stop_token_ids=[7, 8],
                            include_stop_str_in_output=True, logit_bias={9: -1.5, 2: 3.0},
                            bad_words=["thou"])
    assert (params.n, params.logprobs, params.stop, params.min_tokens) == (2, 3, ["\n\n", "it's"], 4)
    assert repr(params) == (
        "SamplingParams(n=2, temperature=0.7, top_k=5, top_p=1.0, min_p=0.0, "
        "repetition_penalty=1.1, presence_penalty=-0.5, frequency_penalty=0.25, seed=9, "
        "max_tokens=30, min_tokens=4, ignore_eos=True, stop=['\\n\\n', \"it's\"], "
        "stop_token_ids=[7, 8], include_stop_str_in_output=True, logprobs=3, prompt_logprobs=None, "
        "logit_bias={2: 3.0, 9: -1.5}, allowed_token_ids=None, truncate_prompt_tokens=None, "
        "bad_words=['thou'])")
    assert SamplingParams(stop="###").stop == ["###"], "a single stop string, as in the OpenAI API"
    assert "logprobs=None" in repr(SamplingParams())
    # The repr (Python's, kvserve.sampling_params) lists every field the C++ struct binds but
    # bad_words_token_ids, which the engine derives from bad_words.
    from kvserve.sampling_params import FIELDS

    bound = {name for name, value in vars(SamplingParams).items() if isinstance(value, property)}
    assert bound == set(FIELDS) | {"bad_words_token_ids"}


# ------------------------------------------------------------------------ penalties and min_tokens


def random_history(g, rows, vocab, max_len):
    """Per-row prompt and output id lists with repeats (short vocabularies repeat a lot)."""
    def ids():
        n = int(torch.randint(0, max_len + 1, (1,), generator=g))
        return torch.randint(0, vocab, (n,), generator=g).tolist()
    return [ids() for _ in range(rows)], [ids() for _ in range(rows)]


PENALTY_GRID = list(itertools.product([1.0, 0.5, 1.3, 2.0], [0.0, -2.0, 0.7, 2.0],
                                      [0.0, 1.5, -0.3]))


@pytest.mark.parametrize("vocab", [3, 50, 1000])
def test_penalties_equal_reference(vocab):
    """Every (repetition, presence, frequency) of the grid on its own row, greedy so that the
    logits left in place are exactly the penalized ones."""
    g = torch.Generator().manual_seed(vocab)
    rows = len(PENALTY_GRID)
    logits = torch.randn(rows, vocab, generator=g) * 3
    prompts, outputs = random_history(g, rows, vocab, 40)
    prompts[0], outputs[1] = [], []  # an empty prompt and an empty output
    params = [SamplingParams(temperature=0.0, repetition_penalty=rep, presence_penalty=pres,
                             frequency_penalty=freq) for rep, pres, freq in PENALTY_GRID]
    got = logits.clone()
    tokens, logprobs = Sampler().sample_rows(got, params, [RequestRandom(0)] * rows, prompts,
                                             outputs)
    want = reference.apply_penalties(logits, prompts, outputs, *zip(*PENALTY_GRID))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-6)
    assert torch.equal(tokens, want.argmax(1))
    assert logprobs == [None] * rows
    changed = (want != logits.double()).any(1)
    assert not changed[0] and changed.sum() >= rows - 4, "the grid must change most rows"


def test_repetition_penalty_equals_transformers():
    """Hugging Face applies it over input_ids = prompt + output, as vLLM does over both."""
    g = torch.Generator().manual_seed(1)
    vocab, rows = 200, 6
    logits = torch.randn(rows, vocab, generator=g) * 4
    prompts, outputs = random_history(g, rows, vocab, 60)
    penalties = [1.0, 1.2, 0.8, 2.0, 1.05, 5.0]
    params = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties]
    got = logits.clone()
    Sampler().sample_rows(got, params, [RequestRandom(0)] * rows, prompts, outputs)
    for r, penalty in enumerate(penalties):
        input_ids = torch.tensor([prompts[r] + outputs[r]], dtype=torch.long)
        hf = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits[r:r + 1].clone())[0]
        torch.testing.assert_close(got[r], hf, atol=1e-6, rtol=1e-6)
    assert not torch.equal(got, logits)


def test_presence_and_frequency_count_output_tokens_only():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 0.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = logits.clone()
    Sampler().sample_rows(got, [params], [RequestRandom(0)], [[0, 0, 1, 3]], [[1, 2, 2, 2]])
    # token 0 and 3: prompt only, untouched; 1: once (-0.75); 2: three times (-1.25)
    assert got.tolist() == [[1.0, 1.25, -2.25, 0.5, 0.0]]


@pytest.mark.parametrize("kwargs, history, expected", [
    # logits [2.0, 1.9, 1.0, -1.0]: token 0 leads until a penalty pushes it below token 1
    (dict(), ([], [0]), 0),
    (dict(repetition_penalty=1.2), ([], [0]), 1),        # 2.0 / 1.2 < 1.9
    (dict(repetition_penalty=1.2), ([0], []), 1),        # the prompt counts too
    (dict(repetition_penalty=1.04), ([0], []), 0),       # 2.0 / 1.04 > 1.9
    (dict(presence_penalty=0.2), ([0], []), 0),          # the prompt does not count
    (dict(presence_penalty=0.2), ([], [0]), 1),
    (dict(frequency_penalty=0.06), ([], [0]), 0),        # 2.0 - 0.06 > 1.9
    (dict(frequency_penalty=0.06), ([], [0, 0]), 1),     # 2.0 - 0.12 < 1.9
    (dict(presence_penalty=-2.0), ([], [2]), 2),         # negative: 1.0 + 2.0 > 2.0
    (dict(repetition_penalty=0.4), ([], [2]), 2),        # below 1: 1.0 / 0.4 > 2.0
    (dict(repetition_penalty=0.4), ([], [3]), 0),        # below 1: -1.0 * 0.4 stays negative
], ids=str)
def test_greedy_with_penalties_picks_expected_token(kwargs, history, expected):
    logits = torch.tensor([[2.0, 1.9, 1.0, -1.0]])
    params = SamplingParams(temperature=0.0, **kwargs)
    tokens, _ = Sampler().sample_rows(logits, [params], [RequestRandom(0)], [history[0]],
                                      [history[1]])
    assert tokens.tolist() == [expected]


EOS, STOP = [5, 9], [2]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos):
    vocab, min_tokens = 12, 3
    base = torch.zeros(vocab)
    base[EOS + STOP] = 10.0  # the stopping tokens are by far the most likely
    params = SamplingParams(temperature=0.0, min_tokens=min_tokens, max_tokens=8,
                            stop_token_ids=STOP, ignore_eos=ignore_eos)
    masked_ids = STOP if ignore_eos else EOS + STOP
    for generated in range(6):
        logits = base[None].clone()
        tokens, _ = Sampler().sample_rows(logits, [params], [RequestRandom(0)], [[5, 2]],
                                          [[0] * generated], EOS)
        if generated < min_tokens:
            assert logits[0, masked_ids].isneginf().all(), generated
            assert torch.equal(logits[0, [i for i in range(vocab) if i not in masked_ids]],
                               base[[i for i in range(vocab) if i not in masked_ids]])
            assert int(tokens) not in masked_ids
            if ignore_eos:
                assert int(tokens) == EOS[0], "ignore_eos: EOS is not masked specially"
        else:
            assert torch.equal(logits[0], base), f"masked after {generated} tokens"
            assert int(tokens) == min(EOS + STOP)


def test_min_tokens_mask_holds_for_sampled_rows():
    """Temperature rows never sample a masked id, even when it dominates the distribution."""
    vocab, rows = 8, 400
    logits = torch.zeros(rows, vocab)
    logits[:, EOS[0]] = 5.0
    params = [SamplingParams(temperature=1.0, min_tokens=2, seed=s) for s in range(rows)]
    randoms = [RequestRandom(s) for s in range(rows)]
    tokens, _ = Sampler().sample_rows(logits.clone(), params, randoms, None, [[1]] * rows, EOS)
    assert EOS[0] not in tokens.tolist() and len(set(tokens.tolist())) > 4
    tokens, _ = Sampler().sample_rows(logits.clone(), params, randoms, None, [[1, 1]] * rows, EOS)
    assert (tokens == EOS[0]).float().mean() > 0.8


@pytest.mark.parametrize("vocab", [3, 50, 1000])
def test_logit_bias_equals_transformers_then_penalties(vocab):
    """The bias (transformers' SequenceBiasLogitsProcessor on one-token sequences) comes before
    the penalties, whose sign rule then sees the biased logits (vLLM's order)."""
    g = torch.Generator().manual_seed(vocab)
    rows = 6
    logits = torch.randn(rows, vocab, generator=g) * 3
    prompts, outputs = random_history(g, rows, vocab, 20)
    biases = [{int(t): float(b) for t, b in zip(torch.randint(0, vocab, (n,), generator=g),
                                                  torch.empty(n).uniform_(-100, 100, generator=g))}
              for n in (0, 1, 2, vocab // 2, vocab, 3)]
    penalties = [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (1.0, 0.5, 0.2), (0.7, -1.0, 0.4),
                 (1.0, 0.0, 0.0), (2.0, 1.0, 1.0)]
    params = [SamplingParams(temperature=0.0, logit_bias=b, repetition_penalty=rep,
                             presence_penalty=pres, frequency_penalty=freq)
              for b, (rep, pres, freq) in zip(biases, penalties)]
    got = logits.clone()
    tokens, _ = Sampler().sample_rows(got, params, [RequestRandom(0)] * rows, prompts, outputs)
    biased = logits.clone()
    for r, bias in enumerate(biases):
        if bias:
            hf = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
            biased[r] = hf(torch.tensor([[0]]), logits[r:r + 1].clone())[0]
    want = reference.apply_penalties(biased, prompts, outputs, *zip(*penalties))
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-6)
    assert torch.equal(tokens, want.argmax(1))
    assert (want.argmax(1) != logits.argmax(1)).sum() >= 3, "the biases must move most argmaxes"


def bad_words_for(g, output, vocab):
    """Words that end the output (prefix met: banned), that do not, one-token ones, and ones
    longer than the output."""
    words = [[int(torch.randint(0, vocab, (1,), generator=g))] for _ in range(2)]
    for length in (2, 3):
        if len(output) >= length - 1:
            words.append(output[len(output) - (length - 1):] + [int(torch.randint(0, vocab, (1,),
                                                                                   generator=g))])
        words.append(torch.randint(0, vocab, (length,), generator=g).tolist())
    words.append([0] * (len(output) + 2))
    return words


@pytest.mark.parametrize("vocab", [3, 50, 1000])
def test_bad_words_equal_transformers_over_the_output(vocab):
    """A word's last token is masked where the output ends with its other tokens, as
    transformers' NoBadWordsLogitsProcessor masks it over input_ids = the output (vLLM looks at
    the output only); the prompt plays no part; the bias and penalties come after."""
    g = torch.Generator().manual_seed(vocab)
    rows = 8
    logits = torch.randn(rows, vocab, generator=g) * 3
    prompts, outputs = random_history(g, rows, vocab, 12)
    outputs[0] = []
    words = [bad_words_for(g, out, vocab) for out in outputs]
    params = [SamplingParams(temperature=0.0) for _ in range(rows)]
    for p, w in zip(params, words):
        p.bad_words_token_ids = w
    params[1].repetition_penalty = 1.3
    params[2].logit_bias = {w[0]: 100.0 for w in words[2]}  # a banned token stays banned
    got = logits.clone()
    tokens, _ = Sampler().sample_rows(got, params, [RequestRandom(0)] * rows, prompts, outputs)
    want = logits.clone()
    for r in range(rows):
        if outputs[r]:
            hf = NoBadWordsLogitsProcessor(words[r], eos_token_id=None)
            want[r] = hf(torch.tensor([outputs[r]]), logits[r:r + 1].clone())[0]
        else:  # nothing generated yet: only the one-token words apply
            want[r, [w[0] for w in words[r] if len(w) == 1]] = float("-inf")
    want[2] = want[2] + torch.tensor([100.0 if t in {w[0] for w in words[2]} else 0.0
                                      for t in range(vocab)])
    want = reference.apply_penalties(want, prompts, outputs, *zip(*[
        (p.repetition_penalty, 0.0, 0.0) for p in params]))
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-6)
    # A row whose every token is banned has no distribution: -1 (the engine ends it, "error").
    assert torch.equal(tokens, torch.where(want.isneginf().all(1), -1, want.argmax(1)))
    assert (got.isneginf().sum(1) >= min(2, vocab)).all()


def test_logit_bias_leaves_min_tokens_masked_and_logprobs_raw():
    vocab = 12
    logits = torch.zeros(1, vocab)
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4, logprobs=2,
                            logit_bias={EOS[0]: 100.0, 3: 50.0})
    got = logits.clone()
    tokens, logprobs = Sampler().sample_rows(got, [params], [RequestRandom(0)], [[1]], [[4]], EOS)
    assert got[0, EOS[0]].isneginf() and tokens.tolist() == [3]
    assert logprobs[0].logprob == pytest.approx(-math.log(vocab), abs=1e-5)  # the raw logits'
    tokens, _ = Sampler().sample_rows(logits.clone(), [params], [RequestRandom(0)], [[1]],
                                      [[4, 4]], EOS)
    assert tokens.tolist() == [EOS[0]]  # min_tokens reached: the +100 wins


def test_allowed_token_ids_mask_everything_else_first():
    """Only the allowed ids keep their logits (the bias and penalties then apply to those);
    sampled rows draw nothing else; logprobs stay the raw logits'."""
    g = torch.Generator().manual_seed(3)
    vocab, rows = 300, 200
    logits = torch.randn(rows, vocab, generator=g) * 3
    allowed = [7, 250, 7, 31]
    params = [SamplingParams(temperature=1.0, seed=s, allowed_token_ids=allowed, logprobs=1)
              for s in range(rows)]
    got = logits.clone()
    tokens, logprobs = Sampler().sample_rows(got, params, [RequestRandom(s) for s in range(rows)],
                                             None, None)
    assert set(tokens.tolist()) == {7, 250, 31}
    others = [i for i in range(vocab) if i not in allowed]
    assert got[:, others].isneginf().all()
    want = torch.log_softmax(logits, 1).gather(1, tokens[:, None])[:, 0]
    assert [lp.logprob for lp in logprobs] == pytest.approx(want.tolist(), abs=1e-5)
    # greedy: the best allowed one, after the bias (the allowed set is masked first)
    row = logits[:1].clone()
    best = max(allowed, key=lambda t: row[0, t])
    worst = min(allowed, key=lambda t: row[0, t])
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    assert Sampler().sample_rows(row.clone(), [greedy], [RequestRandom(0)], None,
                                 None)[0].tolist() == [best]
    biased = SamplingParams(temperature=0.0, allowed_token_ids=allowed, logit_bias={worst: 100.0})
    assert Sampler().sample_rows(row.clone(), [biased], [RequestRandom(0)], None,
                                 None)[0].tolist() == [worst]


def test_biased_sampling_matches_biased_distribution():
    """Seeded sampling with a bias and filters samples softmax(filter(logits + bias))."""
    bias = {0: 2.5, 3: -100.0, 7: 1.0, int(CHI_LOGITS.argmax()): -3.0}
    params = SamplingParams(temperature=0.9, top_p=0.95, logit_bias=bias)
    biased = CHI_LOGITS.clone()
    for t, b in bias.items():
        biased[t] += b
    num_requests, num_steps = 200, NUM_DRAWS // 200
    randoms = [RequestRandom(seed) for seed in range(num_requests)]
    sampler = Sampler()
    tokens = torch.cat([
        sampler.sample_rows(CHI_LOGITS.repeat(num_requests, 1), [params] * num_requests,
                            randoms, None, None)[0]
        for _ in range(num_steps)])
    probs = reference.sampling_probs(biased[None], *param_tensors([params]))[0].numpy()
    unbiased = reference.sampling_probs(CHI_LOGITS[None], *param_tensors([params]))[0].numpy()
    counts = np.bincount(tokens.numpy(), minlength=CHI_LOGITS.numel())
    kept = probs > 0
    assert counts[~kept].sum() == 0
    assert stats.chisquare(counts[kept], probs[kept] * len(tokens)).pvalue > P_VALUE
    assert np.abs(probs - unbiased).max() > 0.1  # the bias moves the target far


def test_penalized_sampling_matches_penalized_distribution():
    """Seeded temperature/top-k/top-p/min-p sampling after penalties samples
    softmax(filter(apply_penalties(logits)))."""
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.95, min_p=0.1,
                            repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
    prompt, output = [0, 4, 11], [0, 1, 1, 2, 9]
    penalized = reference.apply_penalties(CHI_LOGITS[None], [prompt], [output], [1.3], [0.4],
                                          [0.2]).float()
    num_requests, num_steps = 200, NUM_DRAWS // 200
    randoms = [RequestRandom(seed) for seed in range(num_requests)]
    sampler = Sampler()
    tokens = torch.cat([
        sampler.sample_rows(CHI_LOGITS.repeat(num_requests, 1), [params] * num_requests, randoms,
                            [prompt] * num_requests, [output] * num_requests)[0]
        for _ in range(num_steps)])
    probs = reference.sampling_probs(penalized, *param_tensors([params]))[0].numpy()
    unpenalized = reference.sampling_probs(CHI_LOGITS[None], *param_tensors([params]))[0].numpy()
    counts = np.bincount(tokens.numpy(), minlength=CHI_LOGITS.numel())
    kept = probs > 0
    assert counts[~kept].sum() == 0
    assert stats.chisquare(counts[kept], probs[kept] * len(tokens)).pvalue > P_VALUE
    # the penalties must move the target far, or this test could not fail
    assert np.abs(probs - unpenalized).max() > 0.1


def test_rows_without_new_fields_sample_as_before():
    """With penalties, min_tokens and logprobs off, sample_rows draws exactly the tokens of the
    history-free sample(); the recorded tokens pin the seeded streams across releases."""
    recorded = [[20, 29, 15, 43], [77, 20, 55, 21], [32, 58, 27, 1], [65, 44, 68, 57],
                [13, 90, 75, 22], [28, 53, 55, 58], [78, 24, 25, 86], [74, 30, 17, 7],
                [64, 12, 77, 50], [83, 30, 17, 63], [22, 78, 48, 69], [20, 26, 81, 71]]
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=11),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.3, min_p=0.05, seed=12),
              SamplingParams(temperature=0.6, seed=13)]

    def run(rows_form):
        g = torch.Generator().manual_seed(2024)
        randoms = [RequestRandom(p.seed) for p in params]
        out = []
        for step in range(len(recorded)):
            logits = torch.randn(4, 97, generator=g)
            if rows_form:
                history = [[1, 2, 3], [4], [], [5, 5]]
                tokens, logprobs = Sampler().sample_rows(logits, params, randoms, history,
                                                         history, [0, 1])
                assert logprobs == [None] * 4
            else:
                tokens = Sampler().sample(logits, params, randoms)
            out.append(tokens.tolist())
        return out

    assert run(False) == recorded
    assert run(True) == recorded


# ---------------------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("vocab", [4, 37, 1000])
def test_logprobs_come_from_raw_logits(vocab):
    """Top-N ids and values, the sampled token's logprob and rank equal torch.log_softmax of the
    raw logits, whatever the penalties, min_tokens mask, temperature and filters did after."""
    g = torch.Generator().manual_seed(vocab)
    rows = 8
    logits = torch.randn(rows, vocab, generator=g) * 3
    num_top = [None, 0, 1, 3, 5, vocab, vocab + 7, 2]
    params = [SamplingParams(temperature=t, top_k=k, repetition_penalty=1.5,
                             presence_penalty=0.5, min_tokens=1, stop_token_ids=[1], logprobs=n,
                             seed=r)
              for r, (t, k, n) in enumerate(zip([0.0, 1.0, 0.5, 2.0, 0.0, 1.0, 0.7, 1.5],
                                                [-1, 3, -1, 10, -1, -1, 2, -1], num_top))]
    prompts, outputs = random_history(g, rows, vocab, 10)
    outputs = [[] for _ in range(rows)]  # min_tokens=1 masks token 1 in every row
    randoms = [RequestRandom(p.seed) for p in params]
    processed = logits.clone()
    tokens, logprobs = Sampler().sample_rows(processed, params, randoms, prompts, outputs)
    want = torch.log_softmax(logits, dim=-1)
    assert not torch.equal(torch.log_softmax(processed, -1), want), "processing changed nothing"
    for r, n in enumerate(num_top):
        if n is None:
            assert logprobs[r] is None
            continue
        got, token = logprobs[r], int(tokens[r])
        assert got.token_id == token and token != 1
        assert got.logprob == pytest.approx(float(want[r, token]), abs=1e-6)
        assert got.rank == int((want[r] >= want[r, token]).sum())
        top = torch.topk(want[r], min(n, vocab))
        assert [i for i, _ in got.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in got.top]), top.values,
                                   atol=1e-6, rtol=0)
    ranks = [lp.rank for lp in logprobs if lp is not None]
    assert ranks.count(1) < len(ranks), "some sampled tokens must not be the raw argmax"


def test_logprobs_of_greedy_rows_without_processing():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0]])
    _, (got,) = Sampler().sample_rows(logits.clone(), [SamplingParams(temperature=0.0,
                                                                      logprobs=2)],
                                      [RequestRandom(0)], None, None)
    want = torch.log_softmax(logits[0], -1)
    assert got.token_id == 1 and got.rank == 2  # a tie: vLLM counts every token >= the sampled
    assert got.logprob == pytest.approx(float(want[1]))
    assert sorted(i for i, _ in got.top) == [1, 3]
    assert "TokenLogprobs(token_id=1" in repr(got)


def test_sample_rows_rejects_bad_rows():
    logits = torch.randn(2, 10)
    two, randoms = [SamplingParams()] * 2, [RequestRandom(0)] * 2
    with pytest.raises(RuntimeError, match="one SamplingParams, random stream, prompt and output"):
        Sampler().sample_rows(logits, two, randoms, [[1]], [[1], [2]])
    with pytest.raises(RuntimeError, match="one SamplingParams and one random stream per row"):
        Sampler().sample_rows(torch.randn(3, 10), two, randoms)
    with pytest.raises(RuntimeError, match="token id 10 in its history, outside the vocabulary"):
        Sampler().sample_rows(logits, [SamplingParams(repetition_penalty=1.1)] * 2, randoms,
                              [[1], [10]], [[], []])


@pytest.mark.parametrize("sequences, match", [
    ([[]], "1 to 256 tokens"),
    ([[1] * 257], "1 to 256 tokens"),
    ([[4, -1]], "bad_words_token_ids must be non-negative"),
    ([[1]] * 257, "at most 256 bad_words_token_ids"),
])
def test_bad_words_token_ids_are_checked(sequences, match):
    params = SamplingParams()
    params.bad_words_token_ids = sequences
    with pytest.raises(ValueError, match=match):
        params.validate()
