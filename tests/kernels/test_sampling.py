"""sampling_filter_logits and sampling_from_logits against kvserve.testing.reference.
The Sampler built on them, its statistics and Hugging Face parity: tests/engine/test_sampler.py."""


import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant

ops = torch.ops.kvserve

# Logits are fp32 only. Kept logits differ from the fp64 reference by the rounding of x / t.
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-6)}
VOCAB_SIZES = [1, 2, 7, 16, 33, 100, 1000]
TEMPERATURES = [0.0, 0.3, 0.7, 1.0, 1.7]
TOP_K = [-1, 0, 1, 2, 5, 31, 5000]
TOP_P = [1.0, 0.99, 0.9, 0.5, 0.1, 1e-6]
MIN_P = [0.0, 0.01, 0.1, 0.5, 1.0]


def random_params(rows, seed=0):
    """Per-row (temperature, top_k, top_p, min_p) tensors drawn from the lists above; every
    option appears alone in the first rows and in random combinations after them."""
    g = torch.Generator().manual_seed(seed)

    def pick(values, dtype, off):
        column = torch.tensor(values, dtype=dtype)[torch.randint(len(values), (rows,), generator=g)]
        column[:4] = off
        return column

    temperature = pick(TEMPERATURES, torch.float32, 1.0)
    top_k = pick(TOP_K, torch.long, -1)
    top_p, min_p = pick(TOP_P, torch.float32, 1.0), pick(MIN_P, torch.float32, 0.0)
    top_k[1], top_p[2], min_p[3] = 3, 0.8, 0.2
    return temperature, top_k, top_p, min_p


def random_logits(rows, vocab, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    if ties:  # a few distinct values, so top-k and min-p thresholds fall on ties
        return torch.randint(0, 6, (rows, vocab), generator=g).float() * 0.75
    return torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g).mul(5)


def check_filter(logits, params):
    want = reference.sampling_filter_logits(logits, *params)
    got = logits.clone()
    ops.sampling_filter_logits(got, *params)
    removed = got.isneginf()
    differ = torch.nonzero((removed != want.isneginf()).any(dim=1)).flatten().tolist()
    assert not differ, f"masks differ from the reference in rows {differ}"
    torch.testing.assert_close(got.double()[~removed], want[~removed], **TOLERANCES[torch.float32])
    assert (~removed).any(dim=1).all(), "a row lost every token"
    greedy = params[0] == 0
    assert torch.equal(got[greedy], logits[greedy]), "greedy rows must stay untouched"
    return got


@pytest.mark.parametrize("vocab", VOCAB_SIZES)
def test_filter_logits(vocab):
    rows = 200
    check_filter(random_logits(rows, vocab, seed=vocab), random_params(rows, seed=vocab))


@pytest.mark.parametrize("vocab", [7, 17, 37, 100])
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.1])
def test_filter_logits_keeps_ties(vocab, temperature):
    """top-k keeps every token equal to the k-th largest, top-p every token tied with the
    smallest it keeps, and min-p compares ties alike, wherever the tokens sit in the row (vector
    body or scalar tail of the kernel)."""
    rows = 60
    logits = random_logits(rows, vocab, seed=vocab, ties=True)
    temperature_t, top_k, top_p, min_p = random_params(rows, seed=vocab + 1)
    temperature_t.fill_(temperature)
    top_k[top_k <= 0] = 4
    top_k[::2] = -1  # top-p alone on half the rows
    filtered = check_filter(logits, (temperature_t, top_k, top_p, min_p))
    kept = ~filtered.isneginf()
    for r in range(rows):  # tied logits share one fate
        for value in logits[r].unique():
            assert kept[r][logits[r] == value].unique().numel() == 1, f"row {r} split a tie"


def test_filter_large_vocab():
    logits = random_logits(8, 32003, seed=5)
    check_filter(logits, random_params(8, seed=5))


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_filter_real_vocab(ties):
    """A real model's vocabulary (Qwen's 151,936), where the thresholds are found through every
    level of the key histograms; coarse logits put thousands of tokens in one tie."""
    logits = random_logits(6, 151936, seed=11)
    if ties:
        logits = (logits * 4).round() / 4
    temperature, top_k, top_p, min_p = random_params(6, seed=11)
    top_k[4:] = torch.tensor([40, -1])
    top_p[4:] = torch.tensor([0.95, 0.7])
    check_filter(logits, (temperature, top_k, top_p, min_p))


def test_filter_strided_rows():
    """Rows of a wider buffer (row stride != vocab): the padding columns are never touched."""
    full = random_logits(40, 57, seed=9)
    params = random_params(40, seed=9)
    want = reference.sampling_filter_logits(full[:, :50], *params)
    ops.sampling_filter_logits(full[:, :50], *params)
    assert torch.equal(full[:, :50].isneginf(), want.isneginf())
    assert torch.equal(full[:, 50:], random_logits(40, 57, seed=9)[:, 50:])


def random_uniform(rows, seed=0):
    """One uniform number per row, the first three at both ends of [0, 1) and in the middle."""
    uniform = torch.rand(rows, generator=torch.Generator().manual_seed(seed))
    uniform[:3] = torch.tensor([0.0, 0.5, 1.0 - 2 ** -24])
    return uniform


def inverse_cdf(probs, uniform):
    """The first token whose cumulative probability exceeds u, per row (fp64)."""
    cdf = probs.cumsum(dim=1)
    index = (cdf <= uniform.double()[:, None]).sum(dim=1)
    return torch.minimum(index, (probs > 0).long().cumsum(1).argmax(1))


@pytest.mark.parametrize("vocab", [1, 7, 33, 1000])
def test_sample_from_logits(vocab):
    rows = 300
    logits, params = random_logits(rows, vocab, seed=vocab), random_params(rows, seed=vocab)
    uniform = random_uniform(rows, seed=vocab)
    filtered = logits.clone()
    ops.sampling_filter_logits(filtered, *params)
    tokens = ops.sampling_from_logits(filtered, params[0], uniform)
    assert tokens.dtype == torch.long and tokens.shape == (rows,)
    want = inverse_cdf(reference.sampling_probs(logits, *params), uniform)
    assert torch.equal(tokens, want), f"rows {torch.nonzero(tokens != want).flatten().tolist()}"
    assert not filtered.gather(1, tokens[:, None]).isneginf().any(), "sampled a removed token"


def test_greedy_is_first_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [-1.0, -2.0, -1.0, -5.0], [2.0, 2.0, 2.0, 2.0]])
    tokens = ops.sampling_from_logits(logits, torch.zeros(3), torch.full((3,), 0.99))
    assert tokens.tolist() == [1, 0, 0]
    logits = random_logits(50, 1000, seed=2)
    assert torch.equal(ops.sampling_from_logits(logits, torch.zeros(50), torch.rand(50)),
                       logits.argmax(dim=1))


def test_batched_equals_per_row():
    logits, params = random_logits(30, 77, seed=4), random_params(30, seed=4)
    uniform = torch.rand(30, generator=torch.Generator().manual_seed(4))
    batched = logits.clone()
    ops.sampling_filter_logits(batched, *params)
    tokens = ops.sampling_from_logits(batched, params[0], uniform)
    for r in range(30):
        row = logits[r:r + 1].clone()
        row_params = [p[r:r + 1].clone() for p in params]
        ops.sampling_filter_logits(row, *row_params)
        assert torch.equal(row, batched[r:r + 1])
        assert ops.sampling_from_logits(row, row_params[0], uniform[r:r + 1]).item() == tokens[r]


def degenerate_rows(vocab):
    """[rows, vocab] logits that are no distribution, and one valid row at the end: all -inf, a
    NaN (at the first, last and a middle token), a +inf, NaN and -inf only."""
    inf, nan = float("inf"), float("nan")
    rows = [torch.full((vocab,), -inf)]
    for at in sorted({0, vocab // 2, vocab - 1}):
        row = torch.randn(vocab)
        row[at] = nan
        rows.append(row)
        row = torch.randn(vocab)
        row[at] = inf
        rows.append(row)
    row = torch.full((vocab,), -inf)
    row[vocab // 2] = nan
    rows.append(row)
    rows.append(torch.randn(vocab))
    return torch.stack(rows)


@pytest.mark.parametrize("vocab", [1, 7, 33, 1000])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("top_k, top_p, min_p", [(-1, 1.0, 0.0), (3, 0.5, 0.1), (1, 1e-6, 1.0)])
def test_degenerate_rows_give_minus_one(vocab, temperature, top_k, top_p, min_p):
    """A row with no distribution is left alone by the filter (no sort ever sees NaN) and draws
    -1; the valid row beside them samples as usual. Before the fix, an all -inf row with top_p < 1
    read past its sort order and crashed, and a NaN row drew token 0."""
    logits = degenerate_rows(vocab)
    rows = logits.size(0)
    params = (torch.full((rows,), temperature), torch.full((rows,), top_k, dtype=torch.long),
              torch.full((rows,), top_p), torch.full((rows,), min_p))
    filtered = logits.clone()
    ops.sampling_filter_logits(filtered, *params)
    divided = logits / temperature if temperature else logits
    assert torch.equal(filtered[:-1].isnan(), divided[:-1].isnan())
    tokens = ops.sampling_from_logits(filtered, params[0], torch.full((rows,), 0.5))
    assert tokens[:-1].tolist() == [-1] * (rows - 1)
    assert 0 <= tokens[-1] < vocab


def filter_args(rows=3, vocab=8, logits_dtype=torch.float32, k_dtype=torch.long, p_rows=None):
    return (torch.randn(rows, vocab, dtype=logits_dtype), torch.ones(rows),
            torch.full((rows,), -1, dtype=k_dtype), torch.ones(p_rows or rows), torch.zeros(rows))


@pytest.mark.parametrize(
    "args, match",
    [
        (filter_args(logits_dtype=torch.bfloat16), "logits must be float32"),
        (filter_args(k_dtype=torch.int32), "top_k must be Long"),
        (filter_args(p_rows=2), "top_p must have one entry per row"),
        ((torch.randn(8), torch.ones(1), torch.ones(1, dtype=torch.long), torch.ones(1),
          torch.zeros(1)), "logits must have 2 dimensions"),
        ((torch.randn(8, 3).t(), torch.ones(3), torch.ones(3, dtype=torch.long), torch.ones(3),
          torch.zeros(3)), "contiguous in its last dimension"),
    ],
    ids=["logits-dtype", "top-k-dtype", "top-p-rows", "logits-1d", "logits-strided"],
)
def test_filter_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        ops.sampling_filter_logits(*args)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(3, 8, dtype=torch.float16), torch.ones(3), torch.rand(3)), "float32"),
        ((torch.randn(3, 0), torch.ones(3), torch.rand(3)), "empty vocabulary"),
        ((torch.randn(3, 8), torch.ones(2), torch.rand(3)), "temperature must have one entry"),
        ((torch.randn(3, 8), torch.ones(3), torch.rand(3).double()), "uniform must be Float"),
    ],
    ids=["logits-dtype", "empty-vocab", "temperature-rows", "uniform-dtype"],
)
def test_sample_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        ops.sampling_from_logits(*args)


# ------------------------------------------------------------------ every CPU capability variant



def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for vocab in (7, 33, 1000):
        test_filter_logits(vocab)
        test_sample_from_logits(vocab)
    test_filter_logits_keeps_ties(37, 1.1)
    for vocab in (7, 33):
        test_degenerate_rows_give_minus_one(vocab, 0.7, 3, 0.5, 0.1)
        test_degenerate_rows_give_minus_one(vocab, 0.0, -1, 1.0, 0.0)




@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)


# ------------------------------------------------------------ CUDA against the CPU op and reference
# The tests above also run on CUDA through tests/kernels/cuda_ops.py, at small vocabularies. These
# run both ops on the same inputs, with vocabularies on either side of the launcher's switch to
# large blocks (4096) and of real models.

CUDA_VOCAB_SIZES = VOCAB_SIZES + [4095, 4096, 32003, 151936]


def filter_on_cpu_and_cuda(logits, params, pad=0):
    """The filtered logits of the CPU op and of the CUDA op, both on the CPU. On the GPU the rows
    sit in a buffer `pad` columns wider, whose padding must stay untouched."""
    on_cpu = logits.clone()
    torch.ops.kvserve.sampling_filter_logits(on_cpu, *params)
    rows, vocab = logits.shape
    wide = torch.cat([logits, torch.full((rows, pad), 7.0)], dim=1).cuda()
    torch.ops.kvserve.sampling_filter_logits(wide[:, :vocab], *[p.cuda() for p in params])
    assert (wide[:, vocab:] == 7.0).all(), "the filter wrote outside its rows"
    return on_cpu, wide[:, :vocab].cpu()


def draw_on_cpu_and_cuda(filtered, temperature, uniform):
    """The tokens the CPU op and the CUDA op draw from the same filtered logits and uniforms."""
    on_cpu = torch.ops.kvserve.sampling_from_logits(filtered, temperature, uniform)
    on_cuda = torch.ops.kvserve.sampling_from_logits(filtered.cuda(), temperature.cuda(),
                                                     uniform.cuda())
    return on_cpu, on_cuda.cpu()


def rows_differing(a, b):
    return torch.nonzero((a != b).reshape(a.size(0), -1).any(dim=1)).flatten().tolist()


@pytest.mark.cuda
@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("vocab", CUDA_VOCAB_SIZES)
def test_cuda_matches_cpu_and_reference(vocab, pad):
    """The same -inf pattern as the reference and the CPU, the same kept values (one IEEE division
    each), the same greedy tokens and the same tokens for the same uniforms."""
    rows = 200 if vocab < 10000 else 24
    logits, params = random_logits(rows, vocab, seed=vocab), random_params(rows, seed=vocab)
    on_cpu, on_cuda = filter_on_cpu_and_cuda(logits, params, pad)
    want = reference.sampling_filter_logits(logits, *params)
    differ = rows_differing(on_cuda.isneginf(), want.isneginf())
    assert not differ, f"masks differ from the reference in rows {differ}"
    assert torch.equal(on_cuda, on_cpu), f"rows {rows_differing(on_cuda, on_cpu)} differ"
    uniform = random_uniform(rows, seed=vocab)
    tokens_cpu, tokens_cuda = draw_on_cpu_and_cuda(on_cpu, params[0], uniform)
    assert torch.equal(tokens_cuda, tokens_cpu), f"rows {rows_differing(tokens_cuda, tokens_cpu)}"
    greedy = params[0] == 0
    assert torch.equal(tokens_cuda[greedy], logits[greedy].argmax(dim=1))
    sampled = inverse_cdf(reference.sampling_probs(logits, *params), uniform)
    assert torch.equal(tokens_cuda, sampled), f"rows {rows_differing(tokens_cuda, sampled)}"


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [7, 37, 1000, 5000])
def test_cuda_keeps_whole_ties(vocab):
    """On tied logits the GPU keeps what the CPU keeps, every token tied at a threshold (top-p's
    too). Greedy draws take the first tied maximum; sampled draws match the CPU's."""
    rows = 60
    logits = random_logits(rows, vocab, seed=vocab, ties=True)
    params = random_params(rows, seed=vocab + 1)
    on_cpu, on_cuda = filter_on_cpu_and_cuda(logits, params)
    kept_cpu, kept_cuda = ~on_cpu.isneginf(), ~on_cuda.isneginf()
    assert torch.equal(kept_cuda, kept_cpu), f"rows {rows_differing(kept_cuda, kept_cpu)}"
    for r in range(rows):
        for value in logits[r].unique():
            assert kept_cuda[r][logits[r] == value].unique().numel() == 1, f"row {r} split a tie"
    uniform = random_uniform(rows, seed=vocab)
    tokens_cpu, tokens_cuda = draw_on_cpu_and_cuda(on_cpu, params[0], uniform)
    assert torch.equal(tokens_cuda, tokens_cpu), f"rows {rows_differing(tokens_cuda, tokens_cpu)}"


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [7, 5000])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_cuda_degenerate_rows(vocab, temperature):
    """Rows that are no distribution stay as the CPU leaves them and draw -1 on the GPU too."""
    logits = degenerate_rows(vocab)
    rows = logits.size(0)
    params = (torch.full((rows,), temperature), torch.full((rows,), 3, dtype=torch.long),
              torch.full((rows,), 0.5), torch.full((rows,), 0.1))
    on_cpu, on_cuda = filter_on_cpu_and_cuda(logits, params)
    torch.testing.assert_close(on_cuda, on_cpu, rtol=0, atol=0, equal_nan=True)
    tokens_cpu, tokens_cuda = draw_on_cpu_and_cuda(on_cpu, params[0], torch.full((rows,), 0.5))
    assert tokens_cuda[:-1].tolist() == [-1] * (rows - 1)
    assert torch.equal(tokens_cuda, tokens_cpu)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "k_dtype, left_on_cpu, match",
    [(torch.int32, None, "top_k must be Long"), (torch.long, 1, "temperature is on cpu")],
    ids=["top-k-dtype", "temperature-on-cpu"],
)
def test_cuda_rejects_bad_arguments(k_dtype, left_on_cpu, match):
    """The CPU launcher's checks, and every per-row tensor on the logits' device."""
    args = [t if i == left_on_cpu else t.cuda()
            for i, t in enumerate(filter_args(k_dtype=k_dtype))]
    with pytest.raises(RuntimeError, match=match):
        torch.ops.kvserve.sampling_filter_logits(*args)
