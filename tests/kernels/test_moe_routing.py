"""moe_routing against kvserve.testing.reference and against the routers of transformers itself:
softmax top-k (Mixtral, Qwen3-MoE), DeepSeek-V2's group-limited greedy, DeepSeek-V3's sigmoid
with correction bias and group top-2 sums; awkward expert counts, every logits dtype, ties, NaN
logits, strided rows, and the errors bad arguments raise."""

import math

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant

ops = torch.ops.kvserve

# (num_experts, top_k, scoring_func, n_group, topk_group, bias, renormalize, scale)
ROUTERS = {
    "mixtral": (8, 2, "softmax", 1, 1, False, True, 1.0),
    "qwen3-moe": (60, 4, "softmax", 1, 1, False, False, 1.0),
    "one-expert": (1, 1, "softmax", 1, 1, False, True, 1.0),
    "all-of-33": (33, 33, "softmax", 1, 1, False, True, 1.0),
    "v2-greedy": (18, 3, "softmax", 1, 1, False, False, 16.0),
    "v2-groups": (18, 3, "softmax", 3, 2, False, False, 16.0),
    "v2-one-group": (20, 5, "softmax", 4, 1, False, True, 1.0),
    "v3": (24, 5, "sigmoid", 4, 2, True, True, 2.5),
    "v3-every-candidate": (12, 6, "sigmoid", 6, 3, True, True, 1.0),
    "sigmoid-no-groups": (70, 7, "sigmoid", 1, 1, True, False, 1.0),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOKENS = [1, 5, 130]  # a decode step, a few, more than one thread's share


def make(tokens, num_experts, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, num_experts, generator=g) * 2).to(dtype)
    correction = torch.randn(num_experts, generator=g) * 0.3 if bias else None
    return logits, correction


def assert_same_routing(got, want, logits, correction, scoring_func):
    """ids equal, except that two experts whose choices agree to rounding may trade places;
    weights equal to fp32 rounding."""
    (weights, ids), (want_weights, want_ids) = got, want
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == want_ids.shape and weights.shape == want_weights.shape
    if not torch.equal(ids, want_ids):
        x = logits.float()
        scores = x.sigmoid() if scoring_func == "sigmoid" else x.softmax(-1)
        choice = scores if correction is None else scores + correction
        differ = ids != want_ids
        torch.testing.assert_close(choice.gather(1, ids)[differ],
                                   choice.gather(1, want_ids)[differ], atol=1e-6, rtol=1e-6)
        return
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("router", list(ROUTERS))
def test_matches_reference(router, tokens, dtype):
    num_experts, k, scoring, n_group, topk_group, bias, renormalize, scale = ROUTERS[router]
    logits, correction = make(tokens, num_experts, bias, dtype)
    args = (correction, k, scoring, n_group, topk_group, renormalize, scale)
    got = ops.moe_routing(logits, *args)
    assert_same_routing(got, reference.moe_routing(logits, *args), logits, correction, scoring)
    ids = got[1]
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "an expert chosen twice"


def test_ties_go_to_the_lower_id():
    # Every expert scores the same, and in the second row experts 1 and 3 tie for first.
    logits = torch.tensor([[0.0] * 6, [0.0, 2.0, 1.0, 2.0, 0.0, 1.0]])
    weights, ids = ops.moe_routing(logits, None, 3, "softmax", 1, 1, True, 1.0)
    assert ids.tolist() == [[0, 1, 2], [1, 3, 2]]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3))
    # Groups {0,1} {2,3} {4,5} tie on their best score: the lower groups stay.
    logits = torch.tensor([[1.0, 0.0, 1.0, 0.5, 1.0, 0.9]])
    _, ids = ops.moe_routing(logits, None, 3, "softmax", 3, 2, False, 1.0)
    assert ids.tolist() == [[0, 2, 3]]
    want = reference.moe_routing(logits, None, 3, "softmax", 3, 2, False, 1.0)[1]
    assert torch.equal(ids, want)


def test_groups_rank_by_best_one_or_best_two():
    """Expert 0 is the best alone, but group {0, 1} has the lower top-2 sum: V2-style routing
    (softmax, best one) keeps it, V3-style routing (sigmoid, best two) drops it."""
    logits = torch.tensor([[4.0, -4.0, 3.0, 3.0, 0.0, 0.0]])
    _, v2 = ops.moe_routing(logits, None, 2, "softmax", 3, 1, False, 1.0)
    assert v2.tolist() == [[0, 1]]
    zero = torch.zeros(6)
    weights, v3 = ops.moe_routing(logits, zero, 2, "sigmoid", 3, 1, False, 1.0)
    assert v3.tolist() == [[2, 3]]
    torch.testing.assert_close(weights, torch.full((1, 2), 1 / (1 + math.exp(-3.0))))


def test_bias_chooses_but_does_not_weigh():
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0])
    weights, ids = ops.moe_routing(logits, bias, 1, "sigmoid", 1, 1, False, 3.0)
    assert ids.tolist() == [[2]]
    torch.testing.assert_close(weights, torch.tensor([[3.0 / (1 + math.e)]]))


def test_renormalize_and_scale():
    logits, _ = make(9, 16, False, torch.float32)
    weights, _ = ops.moe_routing(logits, None, 4, "softmax", 1, 1, True, 2.5)
    torch.testing.assert_close(weights.sum(-1), torch.full((9,), 2.5))


def test_strided_logits_rows():
    logits, _ = make(7, 20, False, torch.float32)
    wide = torch.cat([logits, torch.full((7, 3), float("nan"))], dim=1)
    got = ops.moe_routing(wide[:, :20], None, 3, "softmax", 4, 2, True, 1.0)
    want = ops.moe_routing(logits, None, 3, "softmax", 4, 2, True, 1.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_nan_logits_still_give_valid_experts():
    logits, _ = make(4, 12, False, torch.float32)
    logits[0] = float("nan")
    logits[1, 5] = float("nan")
    for scoring, bias in (("softmax", None), ("sigmoid", torch.zeros(12))):
        _, ids = ops.moe_routing(logits, bias, 4, scoring, 3, 2, True, 1.0)
        assert ((ids >= 0) & (ids < 12)).all()
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all()
    # A NaN expert loses to every number (sigmoid keeps NaN; the other experts stay finite).
    _, ids = ops.moe_routing(logits[1:2], torch.zeros(12), 11, "sigmoid", 1, 1, False, 1.0)
    assert 5 not in ids.tolist()[0]


def test_no_tokens():
    weights, ids = ops.moe_routing(torch.zeros(0, 8), None, 2, "softmax", 1, 1, True, 1.0)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("arguments, match", [
    (dict(scoring_func="relu"), "scoring_func must be 'softmax' or 'sigmoid'"),
    (dict(n_group=3), "n_group \\(3\\) must be >= 1 and divide the 8 experts"),
    (dict(n_group=0), "n_group \\(0\\)"),
    (dict(n_group=4, topk_group=5), "topk_group \\(5\\) must be in \\[1, n_group = 4\\]"),
    (dict(top_k=9), "top_k \\(9\\) must be in \\[1, 8\\]"),
    (dict(top_k=0), "top_k \\(0\\)"),
    (dict(n_group=4, topk_group=1, top_k=3), "top_k \\(3\\) must be in \\[1, 2\\]"),
    (dict(scoring_func="sigmoid", n_group=8, topk_group=2), "best two experts; a group has 1"),
    (dict(correction_bias=torch.zeros(7)), "correction_bias must be \\[8\\]"),
    (dict(correction_bias=torch.zeros(8, dtype=torch.float64)), "correction_bias must be Float"),
    (dict(router_logits=torch.zeros(3, 8, dtype=torch.float64)), "float32, bfloat16 or float16"),
    (dict(router_logits=torch.zeros(3, 8, 1)), "router_logits must have 2 dimensions"),
    (dict(router_logits=torch.zeros(3, 0)), "router_logits has no experts"),
    (dict(router_logits=torch.zeros(8, 3).T), "contiguous in its last dimension"),
])
def test_rejects_bad_arguments(arguments, match):
    values = dict(router_logits=torch.zeros(3, 8), correction_bias=None, top_k=2,
                  scoring_func="softmax", n_group=1, topk_group=1, renormalize=True,
                  routed_scaling_factor=1.0)
    values.update(arguments)
    with pytest.raises(RuntimeError, match=match):
        ops.moe_routing(*values.values())


# --------------------------------------------------------- against the routers of transformers


def hf_router(architecture):
    """(transformers router module, its config, moe_routing arguments but the logits)."""
    from transformers import AutoConfig

    from kvserve.testing.checkpoints import TINY_CONFIGS
    settings = dict(TINY_CONFIGS[architecture])
    config = AutoConfig.for_model(settings.pop("model_type"), hidden_size=32, **settings)
    if architecture == "MixtralForCausalLM":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as Router
        args = (None, config.num_experts_per_tok, "softmax", 1, 1, True, 1.0)
    elif architecture == "Qwen3MoeForCausalLM":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Router
        args = (None, config.num_experts_per_tok, "softmax", 1, 1, config.norm_topk_prob, 1.0)
    elif architecture == "DeepseekV2ForCausalLM":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2TopkRouter as Router)
        config.topk_method, config.n_group, config.topk_group = "group_limited_greedy", 4, 2
        args = (None, config.num_experts_per_tok, "softmax", 4, 2, False,
                config.routed_scaling_factor)
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as Router)
        args = (None, config.num_experts_per_tok, "sigmoid", config.n_group, config.topk_group,
                config.norm_topk_prob, config.routed_scaling_factor)
    router = Router(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hasattr(router, "e_score_correction_bias"):
            bias = torch.randn(router.weight.size(0), generator=g) * 0.3
            router.e_score_correction_bias.copy_(bias)
            args = (router.e_score_correction_bias.float(),) + args[1:]
    return router, args


@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "Qwen3MoeForCausalLM",
                                          "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_matches_transformers(architecture):
    router, args = hf_router(architecture)
    hidden = torch.randn(40, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = ops.moe_routing(logits.float().contiguous(), *args)
    # DeepSeek's routers leave their top-k unsorted: compare per expert id.
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.float().gather(1, hf_order),
                               atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------ every CPU capability variant


def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for dtype in DTYPES:
        for router in ("qwen3-moe", "v2-groups", "v3", "sigmoid-no-groups"):
            num_experts, k, scoring, n_group, topk_group, bias, renormalize, scale = ROUTERS[router]
            logits, correction = make(17, num_experts, bias, dtype)
            args = (correction, k, scoring, n_group, topk_group, renormalize, scale)
            assert_same_routing(ops.moe_routing(logits, *args),
                                reference.moe_routing(logits, *args), logits, correction, scoring)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)


# --------------------------------------------- CUDA: against the reference and the CPU op


def check_cuda(logits, args, scoring):
    """The op on the GPU against the reference and against the CPU op on the same logits."""
    correction = args[0]
    cuda_args = (None if correction is None else correction.cuda(),) + args[1:]
    got = ops.moe_routing(logits.cuda(), *cuda_args)
    assert got[0].is_cuda and got[1].is_cuda
    got = (got[0].cpu(), got[1].cpu())
    assert_same_routing(got, reference.moe_routing(logits, *args), logits, correction, scoring)
    assert_same_routing(got, ops.moe_routing(logits, *args), logits, correction, scoring)
    assert (got[1].sort(-1).values.diff(dim=-1) > 0).all(), "an expert chosen twice"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("router", list(ROUTERS))
def test_cuda_matches_reference_and_cpu(router, tokens, dtype):
    num_experts, k, scoring, n_group, topk_group, bias, renormalize, scale = ROUTERS[router]
    logits, correction = make(tokens, num_experts, bias, dtype)
    check_cuda(logits, (correction, k, scoring, n_group, topk_group, renormalize, scale), scoring)


@pytest.mark.cuda
@pytest.mark.parametrize("num_experts", [2048, 8192])
def test_cuda_many_experts(num_experts):
    """Fewer warps per block, then more than 48 KiB of shared memory for one warp."""
    logits, correction = make(37, num_experts, True, torch.float32)
    check_cuda(logits, (correction, 8, "sigmoid", 8, 4, True, 2.5), "sigmoid")


@pytest.mark.cuda
def test_cuda_strided_logits_rows():
    logits, _ = make(7, 20, False, torch.float32)
    wide = torch.cat([logits, torch.full((7, 3), float("nan"))], dim=1).cuda()
    got = ops.moe_routing(wide[:, :20], None, 3, "softmax", 4, 2, True, 1.0)
    want = ops.moe_routing(logits.cuda(), None, 3, "softmax", 4, 2, True, 1.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.cuda
def test_cuda_bad_arguments():
    with pytest.raises(RuntimeError, match="correction_bias must be Float"):
        ops.moe_routing(torch.zeros(3, 8, device="cuda"),
                        torch.zeros(8, dtype=torch.float64, device="cuda"), 2, "softmax", 1, 1,
                        True, 1.0)
