"""LLM(model, tensor_parallel_size=2) on a CPU machine (Gloo, one thread per rank): the engine's
process is rank 0 and starts rank 1 itself; its greedy tokens and log-probabilities equal one
rank's (fp32), and its tokens transformers' greedy ones, over mixed batches with chunked prefill
and prefix caching, for GQA with one KV head and an odd vocabulary, biases (Qwen2), tied
embeddings with sliding windows (Gemma 2), a mixture of experts (Qwen3-MoE), latent attention
with experts (DeepSeek-V3: heads split, the latent cache replicated) and an int8 checkpoint; LoRA
adapters split with their projections; speculative heads (an EAGLE-3 head on rank 0, MTP modules
split over both ranks) and n-gram drafts through split states drafting what they draft on one
rank. Requests arriving over the steps and preempted get the tokens they get alone. The plain
cases run with asynchronous scheduling too (the workers get each step's fed tokens over the
device group), which also samples, with penalties and n > 1, what one synchronous rank
samples. A worker that dies gives the caller an error, not a hang;
what cannot be split is refused before any process starts."""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.config import load_checkpoint_info
from kvserve.loader import load_weights
from kvserve.loader.mtp_weights import load_mtp_weights
from kvserve.loader.sharding import Shard
from kvserve.quantization.quantize import quantize_checkpoint
from kvserve.testing.checkpoints import make_checkpoint, make_eagle3_head
from kvserve.testing.hf_reference import load_hf_model

PROMPTS = [[1, 17, 5, 99, 42, 7, 300, 12, 8, 3, 250, 64, 9, 10], [7, 300, 12],
           [1, 17, 5, 99, 42, 7, 300, 12, 8, 3, 250, 64, 77]]  # shares a prefix with the first
CASES = {
    "llama-one-kv-head": ("LlamaForCausalLM", dict(num_key_value_heads=1, vocab_size=383)),
    "qwen2-biases": ("Qwen2ForCausalLM", {}),
    "gemma2-tied-sliding": ("Gemma2ForCausalLM", {}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {}),
    "llama-int8": ("LlamaForCausalLM", dict(quantize="int8")),  # quantize_checkpoint's method
    # the LM head and the embedding quantized too, their vocabulary split with a zero row
    # padding the last rank
    "llama-int8-head-embeddings": ("LlamaForCausalLM", dict(quantize="int8", lm_head=True,
                                                            embeddings=True, vocab_size=383)),
    "deepseek-v3-mla-moe": ("DeepseekV3ForCausalLM", {}),
}
# Chunks of 8 tokens and 4-token blocks: prompts prefill over several steps beside decodes,
# and the third prompt reuses the first one's cached blocks.
OPTIONS = dict(dtype="float32", max_num_batched_tokens=8, block_size=4, max_model_len=64,
               num_blocks=96, enable_prefix_caching=True)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _generate(llm: LLM) -> list:
    """The samples, and the second prompt's scored tokens (prompt_logprobs: every rank computes
    its share of the logits of each prompt position; the other two prompts share a prefix)."""
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)
    scored = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, prompt_logprobs=2)
    outputs = llm.generate(PROMPTS, [params, scored, params], use_tqdm=False)
    return [o.outputs[0] for o in outputs] + [outputs[1].prompt_logprobs[1:]]


SCHEDULING = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@SCHEDULING
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_generate_what_one_does(tmp_path, case, async_scheduling):
    arch, overrides = CASES[case]
    method = overrides.get("quantize")
    path = make_checkpoint(tmp_path / "plain", arch, **{k: v for k, v in overrides.items()
                                                         if k not in ("quantize", "lm_head",
                                                                      "embeddings")})
    if method:
        path = tmp_path / method
        quantize_checkpoint(tmp_path / "plain", path, method,
                            lm_head=overrides.get("lm_head", False),
                            embeddings=overrides.get("embeddings", False))
    # A quantized model's inputs rounded to int8 (the CPU's default) would flip a rounding
    # wherever the ranks' partial sums differ from one rank's in the last bit: compare the
    # sharded weights on the exact path.
    options = OPTIONS | (dict(quantized_activation="exact") if method else {})
    want = _generate(LLM(path, **options))
    llm = LLM(path, tensor_parallel_size=2, distributed_timeout=60.0,
              async_scheduling=async_scheduling, **options)
    try:
        got = _generate(llm)
        assert (llm.llm_engine.get_stats().num_async_steps > 0) == async_scheduling
        # Both ranks' pools hold the blocks rank 0 agreed.
        assert llm.kv_cache.num_blocks == 96
        assert llm.llm_engine.block_manager.prefix_cache_hits() > 0
        # Rank 0 holds about half of the projections, the embedding and the LM head (key /
        # value heads may be replicated, the vocabulary padded).
        info = load_checkpoint_info(path)
        whole = load_weights(path, info.config, torch.float32)
        split = sum(t.numel() * t.element_size() for name, t in whole.items()
                    if "_proj" in name or name.startswith(("embed_tokens.", "lm_head.")))
        assert llm.llm_engine.rank_model.split_bytes < 0.6 * split
        assert "rank 0 of 2" in llm.llm_engine.memory_plan()
    finally:
        llm.llm_engine.shutdown()
    assert [p.exitcode for p in llm.llm_engine.ranks.processes] == [0]
    if not method:  # and transformers' greedy tokens (a quantized checkpoint: its own weights)
        hf = load_hf_model(path)
        for prompt, b in zip(PROMPTS, got):
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            assert out[0, len(prompt):].tolist()[:len(b.token_ids)] == b.token_ids
    for x, y in zip(want.pop(), got.pop(), strict=True):  # the scored prompt
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):  # the sampled token's, then the top 2
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4)


# State-space models split by head (Mamba2 mixers): the norm over every rank's heads (one group)
# or over groups the ranks divide, B and C replicated (one group) or split, hybrids with
# attention (Bamba, Granite 4 with experts and a fused shared MLP, FalconH1's parallel layers with
# its multipliers folded into each rank's rows, Nemotron-H's MLP-only layers without a gate).
STATE_CASES = {
    "mamba2-one-group": ("Mamba2ForCausalLM", dict(n_groups=1)),
    "mamba2-groups-split": ("Mamba2ForCausalLM", dict(n_groups=4)),
    "bamba": ("BambaForCausalLM", dict(mamba_n_groups=1)),
    "granite-hybrid-moe": ("GraniteMoeHybridForCausalLM", dict(mamba_n_groups=2)),
    "falcon-h1-normed": ("FalconH1ForCausalLM", dict(mamba_n_groups=1, mamba_rms_norm=True)),
    "nemotron-h": ("NemotronHForCausalLM", dict(n_groups=2)),
    # Mamba (S6) mixers by channel: Mamba, FalconMamba's unweighted norms of dt, B and C, Jamba's
    # weighted ones beside attention and experts.
    "mamba": ("MambaForCausalLM", {}),
    "falcon-mamba": ("FalconMambaForCausalLM", {}),
    "jamba": ("JambaForCausalLM", {}),
}


@SCHEDULING
@pytest.mark.parametrize("case", list(STATE_CASES))
def test_state_space_models_split_by_head(tmp_path, case, async_scheduling):
    """Each rank keeps its heads' conv and SSM states; the saved states that prefix hits resume
    from are copied on every rank."""
    arch, overrides = STATE_CASES[case]
    path = make_checkpoint(tmp_path, arch, **overrides)
    options = OPTIONS | dict(num_state_snapshots=8)
    want = _generate(LLM(path, **options))
    llm = LLM(path, tensor_parallel_size=2, distributed_timeout=60.0,
              async_scheduling=async_scheduling, **options)
    try:
        got = _generate(llm)
        assert llm.llm_engine.block_manager.prefix_cache_hits() > 0
        state_bytes = llm.llm_engine.kv_cache.state_bytes_per_sequence
        heads = llm.llm_engine.config.ssm.num_heads
        assert f"states of {heads // 2} of {heads} state-space " in (
            llm.llm_engine.memory_plan())
    finally:
        llm.llm_engine.shutdown()
    alone = LLM(path, **options).llm_engine.kv_cache.state_bytes_per_sequence
    assert 0 < state_bytes < alone  # rank 0 holds its heads' states
    for x, y in zip(want.pop(), got.pop(), strict=True):  # the scored prompt
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == pytest.approx(
            [y.logprob for y in b.logprobs], abs=1e-4)
    # transformers' log-probabilities of the tokens the two ranks chose (teacher-forced: a
    # near-tie that float rounding flips cannot fail it).
    hf = load_hf_model(path)
    for prompt, b in zip(PROMPTS, got):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + b.token_ids])).logits[0].double()
        reference = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
        assert [x.logprob for x in b.logprobs] == pytest.approx(
            reference.gather(1, torch.tensor(b.token_ids)[:, None])[:, 0].tolist(), abs=1e-4)


@pytest.mark.parametrize("case", ["llama-one-kv-head", "deepseek-v3-mla-moe"])
def test_async_scheduling_at_two_ranks_samples_what_one_rank_does(tmp_path, case):
    """Seeded sampling with penalties, min_tokens and two samples of a prompt: every rank's
    forward reads tokens that rank 0 sampled a step before and never copied to the host."""
    arch, overrides = CASES[case]
    path = make_checkpoint(tmp_path, arch, **overrides)

    def params(i):
        return SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=i, n=1 + i % 2,
                              repetition_penalty=1.4, presence_penalty=0.5, min_tokens=4,
                              logprobs=1)

    def generate(llm):
        outputs = llm.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))],
                               use_tqdm=False)
        return [(c.token_ids, [x.logprob for x in c.logprobs])
                for o in outputs for c in o.outputs]

    want = generate(LLM(path, **OPTIONS))
    llm = LLM(path, tensor_parallel_size=2, distributed_timeout=60.0, async_scheduling=True,
              **OPTIONS)
    try:
        got = generate(llm)
        assert llm.llm_engine.get_stats().num_async_steps > 0
    finally:
        llm.llm_engine.shutdown()
    assert len(got) == 4  # n = 1, 2, 1
    for (a, a_logprobs), (b, b_logprobs) in zip(want, got, strict=True):
        assert a == b
        assert a_logprobs == pytest.approx(b_logprobs, abs=1e-4)


def test_an_eagle3_head_drafts_on_rank_0_as_on_one_rank(tmp_path):
    """An EAGLE-3 head runs on rank 0 alone, over the streams rank 0's split target keeps (whole
    after each layer's sums) and the target's whole embedding (rank 0's own holds half the
    vocabulary): it drafts what it drafts beside one rank, step for step (the same acceptance
    per position), and the greedy output is plain decoding's."""
    target = make_checkpoint(tmp_path / "target", "LlamaForCausalLM", vocab_size=16,
                             num_hidden_layers=4)
    head = make_eagle3_head(tmp_path / "head", target, draft_vocab_size=14, aux_layers=[1, 2, 3],
                            seed=2)
    prompts = [[1, 7, 5, 9, 12, 7, 3, 12, 8, 3, 15, 14, 6], [1, 7, 5], [1, 10, 11, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    drafted = _drafts_as_one_rank(target, prompts, params, dict(
        OPTIONS, speculative_method="eagle3", speculative_model=head, num_speculative_tokens=3))
    assert sum(drafted[2]) > 0


def _drafts_as_one_rank(path, prompts, params, options) -> tuple:
    """Greedy speculation at tp=2 gives plain decoding's tokens and drafts what one rank drafts,
    step for step (the same counts and acceptance per position); those counts."""
    def generate(llm):
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        s = llm.llm_engine.get_stats()
        return tokens, (s.num_drafts, s.num_draft_tokens, list(s.accepted_per_position))

    plain, _ = generate(LLM(path, **{k: v for k, v in options.items()
                                     if not k.startswith(("speculative", "num_speculative",
                                                          "prompt_lookup"))}))
    want, drafted = generate(LLM(path, **options))
    llm = LLM(path, tensor_parallel_size=2, distributed_timeout=60.0, **options)
    try:
        got, drafted_split = generate(llm)
    finally:
        llm.llm_engine.shutdown()
    assert got == want == plain
    assert drafted_split == drafted
    return drafted


@pytest.mark.parametrize("case", ["mamba2-groups-split", "granite-hybrid-moe", "jamba"])
def test_speculation_over_split_states(tmp_path, case):
    """N-gram drafts through states split by head or channel: every rank backs up its part of a
    sequence's state before a step that verifies drafts and takes it back when one is rejected
    (the step's state copies): tp=2 gives one rank's tokens and acceptance."""
    arch, overrides = STATE_CASES[case]
    path = make_checkpoint(tmp_path, arch, vocab_size=32, **overrides)
    prompts = [[1, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [1, 9, 10, 11, 12], [1, 3, 4]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    drafted = _drafts_as_one_rank(path, prompts, params, OPTIONS | dict(
        num_state_snapshots=8, speculative_method="ngram", num_speculative_tokens=3,
        prompt_lookup_min=1, speculative_disable_batch_size=0))
    assert drafted[1] > sum(drafted[2])  # drafts rejected


def test_an_eagle3_head_drafts_for_a_split_hybrid(tmp_path):
    """An EAGLE-3 head on rank 0 over a Granite 4 style hybrid split in two: its rejected drafts
    send every rank's part of the states back."""
    target = make_checkpoint(tmp_path / "target", "GraniteMoeHybridForCausalLM", vocab_size=32,
                             mamba_n_groups=2)
    head = make_eagle3_head(tmp_path / "head", target, draft_vocab_size=24, aux_layers=[0, 1, 2],
                            seed=2)
    prompts = [[1, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [1, 9, 10, 11, 12], [1, 3, 4]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    drafted = _drafts_as_one_rank(target, prompts, params, OPTIONS | dict(
        num_state_snapshots=8, speculative_method="eagle3", speculative_model=head,
        num_speculative_tokens=3, speculative_disable_batch_size=0))
    assert drafted[1] > sum(drafted[2])


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"])
def test_mtp_modules_are_split_with_the_target(tmp_path, arch):
    """A checkpoint's multi-token-prediction modules split as its layers are (latent attention
    by head with DeepSeek-V3, key/value heads with GLM-4.5, experts by column) and run on both
    ranks beside the target: tp=2 drafts what one rank drafts, step for step, through chunked
    prefill and prefix hits, and the greedy output is plain decoding's; seeded samples (n = 2)
    get one rank's tokens."""
    from tests.models.test_mtp import two_module_checkpoint

    path = two_module_checkpoint(tmp_path / "mtp", arch)
    prompts = [[1, 17, 5, 9, 42, 7, 30, 12, 8, 3, 25, 14, 6], [1, 40, 41, 42, 43, 44],
               [1, 17, 5, 9, 42, 7, 30, 12, 8, 3, 25, 14, 33]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    sampled = SamplingParams(temperature=1.0, top_k=8, seed=3, max_tokens=24, ignore_eos=True,
                             n=2)

    def generate(llm):
        outputs = llm.generate(prompts, [greedy, sampled, greedy], use_tqdm=False)
        # A hit on the first prompt's cached blocks: the modules attend over the rows each
        # rank's pool kept of the first request, in draft distributions that sampled requests'
        # acceptance reads.
        outputs += llm.generate([prompts[0][:12]], sampled, use_tqdm=False)
        s = llm.llm_engine.get_stats()
        return ([(c.token_ids, [x.logprob for x in c.logprobs or []])
                 for o in outputs for c in o.outputs], (s.num_drafts, s.num_draft_tokens,
                                                        list(s.accepted_per_position)))

    options = dict(OPTIONS, speculative_method="mtp", num_speculative_tokens=3,
                   speculative_disable_batch_size=0, speculative_max_verify_tokens=0)
    plain, _ = generate(LLM(path, **OPTIONS))
    one = LLM(path, **options)
    want, drafted = generate(one)
    llm = LLM(path, tensor_parallel_size=2, distributed_timeout=60.0, **options)
    try:
        got, drafted_split = generate(llm)
        # Each rank holds its part of the modules' layers (their eh_proj and norms whole).
        assert "MTP modules" in llm.llm_engine.memory_plan()
        assert "on each rank, split as the target" in llm.llm_engine.memory_plan()
        assert (llm.llm_engine.draft_model.weight_bytes
                < one.llm_engine.draft_model.weight_bytes)
    finally:
        llm.llm_engine.shutdown()
    assert [p.exitcode for p in llm.llm_engine.ranks.processes] == [0]
    info = load_checkpoint_info(path)

    def projection_bytes(shard):  # the modules' split projections (not the latent ones)
        w = load_mtp_weights(path, info.hf_config, info.config, torch.float32, shard=shard)
        return sum(t.numel() * t.element_size() for block in w.blocks
                   for name, t in block.items()
                   if "_proj" in name and "kv_a_proj" not in name and "q_a_proj" not in name)

    assert projection_bytes(Shard(0, 2)) <= 0.55 * projection_bytes(None)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [want[i][0] for i in (0, 3)] == [plain[i][0] for i in (0, 3)]
    for (_, a), (_, b) in zip(want, got, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    assert drafted_split == drafted and sum(drafted[2]) > 0


@SCHEDULING
def test_lora_adapters_are_split_with_their_projections(tmp_path, async_scheduling):
    """Two adapters and the base model in one batch, at tp=2 and tp=1: every rank gets its part
    of each adapter (B's columns of q/k/v and gate/up, A's columns of o and down), with one
    key/value head replicated on both ranks."""
    pytest.importorskip("peft")
    from tests.models.test_lora import make_adapter

    path = make_checkpoint(tmp_path / "base", "LlamaForCausalLM", num_key_value_heads=1)
    make_adapter(path, tmp_path / "a", r=4, lora_alpha=8, target_modules="all-linear")
    make_adapter(path, tmp_path / "b", seed=1, r=2, lora_alpha=4,
                 target_modules=["k_proj", "o_proj", "up_proj"])
    loras = [LoRARequest("a", tmp_path / "a"), None, LoRARequest("b", tmp_path / "b")]
    options = dict(OPTIONS, enable_lora=True, max_loras=2, max_lora_rank=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)

    def generate(llm):
        return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False, lora=loras)]

    want = generate(LLM(path, **options))
    llm = LLM(path, tensor_parallel_size=2, distributed_timeout=60.0,
              async_scheduling=async_scheduling, **options)
    try:
        got = generate(llm)
        base = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == pytest.approx(
            [y.logprob for y in b.logprobs], abs=1e-4)
    # The adapters change what the model says (else the test would prove nothing).
    assert got[0].token_ids != base[0].token_ids or got[2].token_ids != base[2].token_ids


@SCHEDULING
@pytest.mark.parametrize("arch, overrides", [("LlamaForCausalLM", {}),
                                             ("BambaForCausalLM", dict(mamba_n_groups=1))],
                         ids=["llama", "bamba"])
def test_arrivals_and_preemption_at_two_ranks_give_each_requests_tokens_alone(
        tmp_path, arch, overrides, async_scheduling):
    """The engine's invariance at tp=2: mixed requests arriving over the steps, in a pool small
    enough to preempt some (a state-space model's preempted sequence gives its state slot back
    on every rank), each get the greedy tokens it gets alone on one rank."""
    from tests.engine_loop import fp32_engine, run_arrivals

    path = make_checkpoint(tmp_path, arch, **overrides)
    rng = random.Random(0)
    requests = [([1] + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 40))],
                 rng.randrange(1, 16), rng.randrange(0, 8)) for _ in range(12)]
    one = fp32_engine(path)
    alone = {str(i): run_arrivals(one, [(prompt, n, 0)])["0"]
             for i, (prompt, n, _) in enumerate(requests)}
    engine = fp32_engine(path, tensor_parallel_size=2, distributed_timeout=60.0, block_size=4,
                         num_blocks=24, enable_prefix_caching=False,
                         async_scheduling=async_scheduling)
    try:
        assert run_arrivals(engine, requests) == alone
        assert engine.get_stats().num_preemptions > 0
    finally:
        engine.shutdown()


@SCHEDULING
def test_a_worker_that_dies_is_an_error_not_a_hang(tmp_path, async_scheduling):
    path = make_checkpoint(tmp_path, "LlamaForCausalLM")
    llm = LLM(path, tensor_parallel_size=2, distributed_timeout=30.0,
              async_scheduling=async_scheduling, **OPTIONS)
    try:
        worker = llm.llm_engine.ranks.processes[0]
        worker.kill()
        worker.join(10)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - started < 5.0
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(tensor_parallel_size=3), "divide"),
    (dict(tensor_parallel_size=2, distributed_backend="nccl"), "nccl"),
    (dict(tensor_parallel_size=2, distributed_timeout=0.0), "distributed_timeout"),
])
def test_what_cannot_run_is_refused_before_any_rank_starts(tmp_path, options, message):
    path = make_checkpoint(tmp_path, "LlamaForCausalLM")
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", **options)


@pytest.mark.parametrize("arch, overrides, message", [
    ("MambaForCausalLM", dict(intermediate_size=87), "divide the 87 state-space channels"),
    ("Mamba2ForCausalLM", dict(num_heads=15, head_dim=16, n_groups=1),
     "divide the 15 state-space heads"),
    ("Mamba2ForCausalLM", dict(n_groups=5), "the 5 B/C groups"),
    ("NemotronHForCausalLM", dict(n_groups=2, layers_block_type=["mamba", "moe"],
                                  n_routed_experts=4, num_experts_per_tok=2),
     "ungated experts of NemotronHForCausalLM"),
])
def test_state_space_models_the_ranks_cannot_split_are_refused(tmp_path, arch, overrides,
                                                                message):
    path = make_checkpoint(tmp_path, arch, **overrides)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", tensor_parallel_size=2)


@pytest.mark.cuda
@SCHEDULING
def test_two_ranks_on_one_gpu_generate_what_one_does(tmp_path, async_scheduling):
    """Both ranks on one GPU over Gloo (NCCL refuses two ranks on one device): correctness only
    (`scripts/cuda_session.sh test-distributed`); with asynchronous scheduling, the fed tokens
    go from rank 0's CUDA tensor to rank 1's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    path = make_checkpoint(tmp_path, "LlamaForCausalLM", num_key_value_heads=1, vocab_size=383)
    want = _generate(LLM(path, device="cuda", **OPTIONS))
    llm = LLM(path, device="cuda", tensor_parallel_size=2, distributed_timeout=120.0,
              async_scheduling=async_scheduling, **OPTIONS)
    try:
        got = _generate(llm)
    finally:
        llm.shutdown()
    assert [a.token_ids for a in want] == [b.token_ids for b in got]
