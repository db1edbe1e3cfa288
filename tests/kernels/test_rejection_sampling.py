"""rejection_sample: against the pure-torch reference, against transformers' own speculative
sampling routine on the same uniform numbers, and statistically (the emitted first token is
distributed as the target's p, whatever q is; a deliberately broken rule is caught)."""

from __future__ import annotations

import inspect
from unittest import mock

import pytest
import torch
from scipy import stats

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference

from tests.kernels.capability import CAPABILITIES, check_variant

ops = torch.ops.kvserve


def random_probs(rows: int, vocab: int, gen: torch.Generator, sparsity: float = 0.3,
                 sharpness: float = 2.0) -> torch.Tensor:
    """Rows of a distribution with some exact zeros (as filters leave) and uneven mass."""
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * sharpness
    mask = torch.rand(rows, vocab, generator=gen) < sparsity
    mask[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] = False
    return torch.softmax(logits.masked_fill(mask, -float("inf")), dim=-1).float()


def case(ks: list[int], vocab: int, seed: int, point_mass: bool = False, agree: float = 0.5):
    """B sequences with ks[b] drafts: target probs, draft probs, drafts drawn from q (or from p
    half of the time, so that some get accepted), cu and uniforms."""
    gen = torch.Generator().manual_seed(seed)
    num_drafts, batch = sum(ks), len(ks)
    cu = [0]
    for k in ks:
        cu.append(cu[-1] + k)
    target = random_probs(num_drafts + batch, vocab, gen)
    draft = None if point_mass else random_probs(num_drafts, vocab, gen)
    ids = []
    for b, k in enumerate(ks):
        for j in range(k):
            source = target[cu[b] + b + j] if torch.rand(1, generator=gen) < agree else (
                draft[cu[b] + j] if draft is not None else torch.ones(vocab))
            ids.append(int(torch.multinomial(source.double(), 1, generator=gen)))
    uniform = torch.rand(num_drafts + batch, generator=gen)
    return target, draft, ids, cu, uniform


def run(target, draft, ids, cu, uniform):
    empty = torch.empty(0, target.size(1))
    tokens, accepted = ops.rejection_sample(target, empty if draft is None else draft,
                                            torch.tensor(ids, dtype=torch.long),
                                            torch.tensor(cu, dtype=torch.long), uniform)
    return tokens, accepted


@pytest.mark.parametrize("vocab", [1, 2, 7, 33, 1000])
@pytest.mark.parametrize("ks", [[0], [1], [3, 0, 5], [8, 8], [2, 1, 0, 4, 1, 7, 3]])
@pytest.mark.parametrize("point_mass", [False, True])
def test_matches_the_reference(vocab, ks, point_mass):
    for seed in range(3):
        target, draft, ids, cu, uniform = case(ks, vocab, seed, point_mass)
        tokens, accepted = run(target, draft, ids, cu, uniform)
        want_tokens, want_accepted = reference.rejection_sample(target, draft, ids, cu, uniform)
        assert accepted.tolist() == want_accepted
        for b, want in enumerate(want_tokens):
            row = tokens[b].tolist()
            assert row[:len(want)] == want and all(t == -1 for t in row[len(want):])


def test_rows_without_a_distribution_end_the_sequence_with_minus_one():
    target, draft, ids, cu, uniform = case([3, 2], 11, 0)
    target[1] = 0.0            # sequence 0: its second draft position has no distribution
    target[3 + 2] = float("nan")  # sequence 1 (rows 4..6): its bonus row
    uniform[:] = 0.0           # accept whatever has p > 0
    tokens, accepted = run(target, draft, ids, cu, uniform)
    want_tokens, want_accepted = reference.rejection_sample(target, draft, ids, cu, uniform)
    assert accepted.tolist() == want_accepted
    for b in range(2):
        want = want_tokens[b]
        assert tokens[b].tolist()[:len(want)] == want and want[-1] == -1


def test_matches_transformers_speculative_sampling_on_the_same_uniforms():
    """transformers' _speculative_sampling (one sequence) with torch.rand_like and
    torch.multinomial replaced by the same uniform numbers."""
    utils = pytest.importorskip("transformers.generation.utils")
    # Some versions (5.17) also ask whether the candidate ended the sequence (then no bonus token).
    done = ({"is_done_candidate": False}
            if "is_done_candidate" in inspect.signature(utils._speculative_sampling).parameters
            else {})
    for seed in range(40):
        k, vocab = 1 + seed % 6, 50
        target, draft, ids, cu, uniform = case([k], vocab, seed, agree=0.6)
        tokens, accepted = run(target, draft, ids, cu, uniform)

        def fixed_multinomial(p, num_samples):
            return torch.tensor([[reference._draw(p[0].double(), float(uniform[k]))]])

        with mock.patch.object(utils.torch, "rand_like", lambda x: uniform[:k].to(x.dtype)), \
                mock.patch.object(utils.torch, "multinomial", fixed_multinomial):
            want, n_matches = utils._speculative_sampling(
                torch.tensor([ids]), draft.double().log()[None], k, target.double().log()[None],
                **done)
        assert int(accepted[0]) == int(n_matches)
        assert tokens[0].tolist()[:int(n_matches) + 1] == want[0].tolist()


def first_token_counts(target, draft, draw_from_q, n, rule):
    """Counts of the first emitted token over n runs with fresh drafts x ~ q and uniforms."""
    gen = torch.Generator().manual_seed(1234)
    vocab = target.size(1)
    ids = torch.multinomial(draw_from_q.double().expand(n, vocab), 1, replacement=True,
                            generator=gen).squeeze(1)
    batch_target = target.repeat(n, 1)  # rows 2i (draft position), 2i + 1 (bonus)
    uniform = torch.rand(2 * n, generator=gen)
    cu = torch.arange(n + 1, dtype=torch.long)
    first = rule(batch_target, draft.repeat(n, 1), ids, cu, uniform)
    return torch.bincount(first, minlength=vocab)


def kernel_rule(target, draft, ids, cu, uniform):
    tokens, _ = ops.rejection_sample(target, draft, ids, cu, uniform)
    return tokens[:, 0]


def broken_rule(target, draft, ids, cu, uniform):
    """A plausible bug: on rejection, resample from p instead of the residual max(p - q, 0)."""
    out = []
    for i in range(ids.numel()):
        p, q, x = target[2 * i].double(), draft[i].double(), int(ids[i])
        if float(uniform[2 * i]) * float(q[x]) < float(p[x]):
            out.append(x)
        else:
            out.append(reference._draw(p, float(uniform[2 * i + 1])))
    return torch.tensor(out)


def test_first_token_follows_the_target_and_a_broken_rule_does_not():
    gen = torch.Generator().manual_seed(7)
    vocab, n = 6, 20000
    p = random_probs(1, vocab, gen, sparsity=0.0)
    q = random_probs(1, vocab, gen, sparsity=0.0)
    target = torch.cat([p, random_probs(1, vocab, gen)])  # the bonus row is never the first token
    expected = p[0].double() / p[0].double().sum() * n
    counts = first_token_counts(target, q, q[0], n, kernel_rule)
    assert stats.chisquare(counts.double(), expected).pvalue > 1e-3
    bad = first_token_counts(target, q, q[0], n, broken_rule)
    assert stats.chisquare(bad.double(), expected).pvalue < 1e-6


def capability_checks():
    for ks, vocab, point_mass in (([3, 0, 5], 33, False), ([2, 4], 7, True)):
        target, draft, ids, cu, uniform = case(ks, vocab, 5, point_mass)
        tokens, accepted = run(target, draft, ids, cu, uniform)
        want_tokens, want_accepted = reference.rejection_sample(target, draft, ids, cu, uniform)
        assert accepted.tolist() == want_accepted
        for b, want in enumerate(want_tokens):
            assert tokens[b].tolist()[:len(want)] == want


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)


@pytest.mark.cpu_only  # checked where the host holds cu_num_drafts; on the GPU it is clamped
def test_bad_cu_num_drafts_raise():
    target, draft, ids, _, uniform = case([2, 1], 9, 0)
    with pytest.raises(RuntimeError, match="cu_num_drafts must run from 0"):
        run(target, draft, ids, [0, 2, 2], uniform)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        run(target, draft, ids, [0, 4, 3], uniform)


def test_bad_arguments_raise():
    target, draft, ids, cu, uniform = case([2, 1], 9, 0)
    with pytest.raises(RuntimeError, match="target_probs needs"):
        run(target[:-1], draft, ids, cu, uniform[:-1])
    with pytest.raises(RuntimeError, match="draft_probs must be"):
        run(target, draft[:, :5], ids, cu, uniform)
    with pytest.raises(RuntimeError, match="uniform needs"):
        run(target, draft, ids, cu, uniform[:2])


# --------------------------------------------- CUDA: against the reference and the CPU op


def run_cuda(target, draft, ids, cu, uniform, cu_device):
    """run() on the GPU; cu_num_drafts on `cu_device` (on the host the tokens are exactly
    [B, max k_b + 1] wide, on the GPU [B, N + 1]: reading it there would synchronise)."""
    empty = torch.empty(0, target.size(1))
    tokens, accepted = ops.rejection_sample(
        target.cuda(), (empty if draft is None else draft).cuda(),
        torch.tensor(ids, dtype=torch.long, device="cuda"),
        torch.tensor(cu, dtype=torch.long, device=cu_device), uniform.cuda())
    assert tokens.is_cuda and accepted.is_cuda
    width = (max(b - a for a, b in zip(cu, cu[1:])) if cu_device == "cpu" else len(ids)) + 1
    assert tokens.shape == (len(cu) - 1, width)
    return tokens.cpu(), accepted.cpu()


@pytest.mark.cuda
@pytest.mark.parametrize("cu_device", ["cpu", "cuda"])
@pytest.mark.parametrize("vocab", [1, 2, 7, 33, 1000])
@pytest.mark.parametrize("ks", [[0], [1], [3, 0, 5], [8, 8], [2, 1, 0, 4, 1, 7, 3]])
@pytest.mark.parametrize("point_mass", [False, True])
def test_cuda_matches_the_reference_and_cpu(vocab, ks, point_mass, cu_device):
    for seed in range(3):
        target, draft, ids, cu, uniform = case(ks, vocab, seed, point_mass)
        tokens, accepted = run_cuda(target, draft, ids, cu, uniform, cu_device)
        want_tokens, want_accepted = reference.rejection_sample(target, draft, ids, cu, uniform)
        assert accepted.tolist() == want_accepted
        for b, want in enumerate(want_tokens):
            row = tokens[b].tolist()
            assert row[:len(want)] == want and all(t == -1 for t in row[len(want):])
        cpu_tokens, cpu_accepted = run(target, draft, ids, cu, uniform)
        assert torch.equal(accepted, cpu_accepted)
        assert torch.equal(tokens[:, :cpu_tokens.size(1)], cpu_tokens)


@pytest.mark.cuda
def test_cuda_rows_without_a_distribution():
    target, draft, ids, cu, uniform = case([3, 2], 11, 0)
    target[1] = 0.0
    target[3 + 2] = float("nan")
    uniform[:] = 0.0
    tokens, accepted = run_cuda(target, draft, ids, cu, uniform, "cpu")
    assert torch.equal(tokens, run(target, draft, ids, cu, uniform)[0])


@pytest.mark.cuda
def test_cuda_bad_cu_num_drafts_on_the_device_stay_in_bounds():
    """Unchecked on the device: wrong tokens maybe, but no read or write out of bounds."""
    target, draft, ids, _, uniform = case([3, 2], 11, 0)
    for cu in ([0, 7, 5], [-4, 1 << 40, 2], [5, 0, 5], [0, 2, -(1 << 40)]):
        tokens, accepted = run_cuda(target, draft, ids, cu, uniform, "cuda")
        torch.cuda.synchronize()
        assert ((accepted >= 0) & (accepted <= len(ids))).all()
        assert ((tokens >= -1) & (tokens < 11)).all()


@pytest.mark.cuda
def test_cuda_bad_arguments():
    target, draft, ids, cu, uniform = case([2, 1], 9, 0)
    with pytest.raises(RuntimeError, match="cu_num_drafts must run from 0"):
        run_cuda(target, draft, ids, [0, 2, 2], uniform, "cpu")
    with pytest.raises(RuntimeError, match="uniform must be Float"):
        run_cuda(target, draft, ids, cu, uniform.double(), "cuda")
