"""The engine on models with state-space layers (Mamba2; Mamba and FalconMamba, whose mixers
decay per channel and state entry, and Jamba's hybrid of them with attention and experts;
Granite 4 and Bamba hybrids of Mamba2 mixers and attention layers; FalconH1, both in every layer; Nemotron-H, mixers, attention and MLPs or mixtures of
experts each a layer of its own): every running sequence holds one state slot beside its blocks, so
chunked prefill, batching, slot reuse, preemption and parallel samples must all give the tokens
of transformers' whole-sequence forward (its pure-torch path)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import kvserve
from kvserve import SamplingParams
from tests.engine_loop import drain
from tests.engine_loop import fp32_engine as engine
from tests.engine_loop import run_arrivals as run
from tests.models.test_parity import PROMPTS, hf_greedy

transformers = pytest.importorskip("transformers")

MAMBA2 = "Mamba2ForCausalLM"
MODELS = [MAMBA2, "MambaForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM",
          "GraniteMoeHybridForCausalLM", "BambaForCausalLM", "FalconH1ForCausalLM",
          "NemotronHForCausalLM", "NemotronHForCausalLM+moe"]
# Overrides of an architecture's tiny config, by the name after "+": Nemotron 3's mixtures of
# experts in place of its MLP layers (grouped routing, a shared expert).
VARIANTS = {"moe": dict(layers_block_type=["linear_attention", "moe", "full_attention",
                                           "linear_attention", "moe"],
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                        moe_shared_expert_intermediate_size=40, n_group=2, topk_group=1)}
NUM_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=MODELS)
def model(checkpoint_factory, request):
    architecture, _, variant = request.param.partition("+")
    return checkpoint_factory(architecture, **VARIANTS.get(variant, {}))


@pytest.fixture(scope="module")
def mamba2(checkpoint_factory):
    return checkpoint_factory(MAMBA2)


@pytest.fixture(scope="module")
def reference(model):
    """transformers' greedy tokens and their log-probabilities (full forwards, no cache)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        tokens = hf_greedy(ref, prompt, NUM_TOKENS)
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
        positions = range(len(prompt) - 1, len(prompt) - 1 + NUM_TOKENS)
        out.append((tokens, [logits[p, t].item() for p, t in zip(positions, tokens)]))
    return out


def test_the_reference_runs_transformers_pure_torch_path():
    """The optimized kernels (mamba_ssm, causal_conv1d) would replace the reference's own code."""
    for package in ("mamba_ssm", "causal_conv1d"):
        assert importlib.util.find_spec(package) is None, f"{package} is installed"


def generate(llm: kvserve.LLM, prompts=PROMPTS, params=GREEDY):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("chunk", [None, 7, 1])
def test_greedy_tokens_and_logprobs_equal_transformers(model, reference, chunk):
    """Whole prompts, and prompts prefilled 7 tokens or 1 token per step (the state carried
    from chunk to chunk), in one batch of mixed lengths."""
    extra = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_num_seqs=chunk)
    llm = kvserve.LLM(model, dtype="float32", **extra)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    for out, (tokens, logprobs) in zip(generate(llm, params=params), reference):
        assert out.outputs[0].token_ids == tokens
        assert [lp.token_id for lp in out.outputs[0].logprobs] == tokens
        ours = [lp.logprob for lp in out.outputs[0].logprobs]
        assert ours == pytest.approx(logprobs, abs=1e-4)


# Prefix caching on: states saved at the boundaries of blocks of 8 tokens (the test prompts have
# 11, 2, 21 and 7 tokens: hits at 8 and 16).
SNAPSHOTS = dict(num_state_snapshots=16, block_size=8)


@pytest.mark.parametrize("chunk", [None, 7])
def test_prefix_hits_resume_from_saved_states(model, reference, chunk):
    """Each prompt again after all ran once: it resumes from the state saved at its last cached
    block (and, in a hybrid, that prefix's KV), to transformers' tokens and log-probabilities."""
    extra = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_num_seqs=chunk)
    llm = kvserve.LLM(model, dtype="float32", **SNAPSHOTS, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    for _ in range(2):
        outs = generate(llm, params=params)
        for out, (tokens, logprobs) in zip(outs, reference):
            assert out.outputs[0].token_ids == tokens
            ours = [lp.logprob for lp in out.outputs[0].logprobs]
            assert ours == pytest.approx(logprobs, abs=1e-4)
    assert [out.num_cached_tokens for out in outs] == [8, 0, 16, 0]


def test_a_shared_prefix_is_saved_where_prompts_part(model):
    """Three prompts share 21 tokens (2 full blocks of 8) and part after: the first saves its
    state at its own end only; the second finds those 2 blocks without a state, ends a prefill
    chunk there and saves one; the third resumes from it. Each gives its tokens without caching."""
    shared = PROMPTS[2]
    prompts = [shared + [40 + i, 41 + i, 42] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].token_ids
             for o in generate(kvserve.LLM(model, dtype="float32"), prompts, params)]
    llm = kvserve.LLM(model, dtype="float32", **SNAPSHOTS)
    outs = [generate(llm, [prompt], params)[0] for prompt in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 16]
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_a_failed_step_publishes_no_state(model, reference):
    """A step that fails while it saves a state (its copy never made): the request ends with an
    error, and the same prompt afterwards neither hits that snapshot nor gives other tokens."""
    e = engine(model, **SNAPSHOTS)
    prompt, (tokens, _) = PROMPTS[2], reference[2]
    e.engine.inject_step_failures(1)
    e.add_request("failed", prompt, GREEDY)
    with pytest.raises(RuntimeError, match="injected step failure"):
        e.step()
    failed = drain(e)
    assert failed["failed"].outputs[0].finish_reason == "error"
    assert e.block_manager.num_cached_states() == 0
    for i in range(2):
        e.add_request(str(i), prompt, GREEDY)
        assert drain(e)[str(i)].outputs[0].token_ids == tokens
    assert e.block_manager.num_cached_states() > 0
    e.block_manager.check_invariants()


@pytest.mark.parametrize("snapshots", [1, 16])
def test_prefix_hits_with_mixed_arrivals_equal_alone(model, reference, snapshots):
    """Prompts sharing prefixes arrive while others prefill and decode, twice each (the second
    copy in the same step as the first, which must not read a state the step has not written
    yet); one snapshot slot evicts all the time. Every request gives its solo tokens."""
    e = engine(model, max_num_batched_tokens=9, num_state_snapshots=snapshots, block_size=8)
    requests = [(prompt, NUM_TOKENS, arrival) for prompt, arrival in zip(PROMPTS, (0, 2, 3, 9))]
    requests += [(prompt, NUM_TOKENS, arrival) for prompt, arrival in zip(PROMPTS, (0, 5, 12, 30))]
    requests.append((PROMPTS[0], NUM_TOKENS, 20))
    got = run(e, requests)
    solo = [tokens for tokens, _ in reference]
    assert [got[str(i)] for i in range(len(requests))] == solo + solo + solo[:1]
    assert e.block_manager.prefix_cache_hits() > 0 or snapshots == 1
    e.block_manager.check_invariants()


def test_batched_with_mixed_arrivals_equals_alone(model, reference):
    """Requests arriving while others prefill or decode: each gives its solo tokens."""
    e = engine(model, max_num_batched_tokens=9)
    requests = [(prompt, NUM_TOKENS, arrival) for prompt, arrival in zip(PROMPTS, (0, 2, 3, 9))]
    got = run(e, requests)
    assert [got[str(i)] for i in range(len(PROMPTS))] == [tokens for tokens, _ in reference]


def test_a_reused_slot_gives_the_new_request_its_solo_tokens(model, reference):
    """One slot: each request starts from the stale state of the one before it, and must not
    read it (the slot is flagged as holding no state when handed out)."""
    e = engine(model, max_num_seqs=1)
    assert e.kv_cache.num_state_slots == 1
    for i, prompt in enumerate(PROMPTS):
        e.add_request(str(i), prompt, GREEDY)
    final = drain(e)
    assert [final[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == [
        tokens for tokens, _ in reference]
    assert e.block_manager.num_free_state_slots() == 1


@pytest.mark.parametrize("snapshots", [0, 4])
def test_preemption_recomputes_the_state(model, reference, snapshots):
    """A pool too small for every sequence at once: preempted sequences free their slot and
    blocks and are recomputed from their tokens (with snapshots, from the states saved before
    through the prefix cache), to the same output."""
    e = engine(model, block_size=4, num_blocks=12, max_num_batched_tokens=16,
               num_state_snapshots=snapshots)
    for i, prompt in enumerate(PROMPTS):
        e.add_request(str(i), prompt, GREEDY)
    final = drain(e)
    assert e.scheduler.num_preemptions > 0
    assert [final[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == [
        tokens for tokens, _ in reference]


def test_parallel_samples_fork_the_prompt_state(model):
    """n samples share the prefill; each forked sample starts from a copy of its state and
    follows its own random stream, as n separate requests with the same seeds do."""
    prompt = PROMPTS[0]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5, ignore_eos=True)
    llm = kvserve.LLM(model, dtype="float32", max_num_seqs=4)
    forked = [c.token_ids for c in generate(llm, [prompt], params)[0].outputs]
    e = engine(model, max_num_seqs=4)
    e.add_request("n", prompt, params)
    final = drain(e)
    assert [c.token_ids for c in final["n"].outputs] == forked
    assert len({tuple(t) for t in forked}) > 1, "the samples should differ"
    # Each sample alone (n=1) from the same prefill: the first sample's stream is the request's.
    alone = generate(llm, [prompt], SamplingParams(temperature=1.0, max_tokens=12, seed=5,
                                                   ignore_eos=True))[0].outputs[0].token_ids
    assert alone == forked[0]


def test_more_samples_than_state_slots_is_refused(mamba2):
    llm = kvserve.LLM(mamba2, dtype="float32", max_num_seqs=2)
    with pytest.raises(ValueError, match="3 samples need as many state slots; the pool has 2"):
        generate(llm, [PROMPTS[0]], SamplingParams(n=3, max_tokens=4))
    assert generate(llm, [PROMPTS[1]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_hybrid_memory_plan_has_kv_for_its_attention_layer_and_states_for_the_rest(
        checkpoint_factory):
    e = engine(checkpoint_factory("GraniteMoeHybridForCausalLM"), max_num_seqs=3)
    layout = e.kv_cache.layout
    assert layout.num_layers == 1 and list(layout.state.layers) == [0, 2, 3]
    assert len(e.kv_cache.key_caches) == 1 and len(e.kv_cache.ssm_states) == 3
    plan = e.memory_plan()
    assert "KV cache" in plan and "3 slots x" in plan and "3 state-space layers" in plan


def test_jamba_memory_plan_has_kv_for_attention_and_mamba_states_for_the_rest(
        checkpoint_factory):
    e = engine(checkpoint_factory("JambaForCausalLM"), max_num_seqs=3)
    layout, kv, s = e.kv_cache.layout, e.kv_cache, e.config.ssm
    assert layout.num_layers == 2 and list(layout.state.layers) == [0, 2]
    assert [tuple(t.shape) for t in kv.ssm_states] == [(3, s.inner_size, 1, 10)] * 2
    assert list(e.config.moe.layers) == [0, 1, 0, 1]
    assert "KV cache" in e.memory_plan() and "2 state-space layers" in e.memory_plan()


def test_falcon_h1_has_kv_and_a_state_in_every_layer(checkpoint_factory):
    """FalconH1's layers attend and mix side by side: each has its KV and its state."""
    e = engine(checkpoint_factory("FalconH1ForCausalLM"), max_num_seqs=3)
    layout = e.kv_cache.layout
    assert layout.num_layers == 3 and list(layout.state.layers) == [0, 1, 2]
    assert len(e.kv_cache.key_caches) == 3 and len(e.kv_cache.ssm_states) == 3
    c = e.config
    assert [c.kv_cache_index(i) for i in range(3)] == [0, 1, 2]
    assert [c.state_cache_index(i) for i in range(3)] == [3, 4, 5]


def test_nemotron_h_mlp_layers_hold_neither_kv_nor_state(checkpoint_factory):
    """Nemotron-H's layers (tiny: mixer, MLP, attention, mixer, MLP): one KV for its attention
    layer, a state for each mixer, nothing for an MLP."""
    e = engine(checkpoint_factory("NemotronHForCausalLM"), max_num_seqs=3)
    c, kv = e.config, e.kv_cache
    assert list(c.ssm.layers) == [1, 3, 0, 1, 3]
    assert [c.mlp_only(i) for i in range(5)] == [False, True, False, False, True]
    assert kv.layout.num_layers == 1 and list(kv.layout.state.layers) == [0, 3]
    assert len(kv.key_caches) == 1 and len(kv.ssm_states) == 2
    assert c.kv_cache_index(2) == 0 and [c.state_cache_index(i) for i in (0, 3)] == [1, 2]
    s = c.ssm
    per_layer = s.conv_dim * (s.conv_kernel - 1) * 4 + s.num_heads * s.head_dim * s.state_size * 4
    kv_bytes_per_token = 2 * c.num_kv_heads * c.head_dim * 4  # K and V of one layer, fp32
    plan = e.memory_plan()
    assert f"at {kv_bytes_per_token} bytes/token" in plan
    assert f"3 slots x {2 * per_layer:,} bytes/sequence" in plan and "2 state-space layers" in plan


def test_lora_is_refused_where_multipliers_are_folded(checkpoint_factory):
    with pytest.raises(ValueError, match="LoRA adapters are not supported for "
                                         "FalconH1ForCausalLM yet"):
        engine(checkpoint_factory("FalconH1ForCausalLM"), enable_lora=True)


def test_memory_plan_shows_the_fixed_state_per_sequence(mamba2):
    e = engine(mamba2, max_num_seqs=5)
    layout, kv = e.kv_cache.layout, e.kv_cache
    assert layout.num_layers == 0 and layout.has_state() and list(layout.state.layers) == [0, 1, 2]
    s = e.config.ssm
    per_layer = s.conv_dim * (s.conv_kernel - 1) * 4 + s.num_heads * s.head_dim * s.state_size * 4
    assert kv.state_bytes_per_sequence == 3 * per_layer
    assert kv.num_state_slots == 5 and not e.engine.config.enable_prefix_caching
    assert [tuple(t.shape) for t in kv.ssm_states] == [(5, s.num_heads, s.head_dim,
                                                         s.state_size)] * 3
    plan = e.memory_plan()
    assert f"5 slots x {3 * per_layer:,} bytes/sequence, whatever its length" in plan
    assert "prefix caching off (num_state_snapshots saves states for it)" in plan
    cached = engine(mamba2, max_num_seqs=5, num_state_snapshots=3)
    assert cached.kv_cache.num_state_slots == 8 and cached.engine.config.enable_prefix_caching
    assert cached.kv_cache.state_bytes_per_sequence == 3 * per_layer
    assert "prefix caching on: 3 of the slots keep states saved at block boundaries" in (
        cached.memory_plan())
    half = kvserve.LLMEngine(mamba2, dtype="bfloat16", max_num_seqs=5, log_memory_plan=False,
                             mamba_ssm_cache_dtype="auto")
    assert half.kv_cache.ssm_states[0].dtype == torch.bfloat16
    assert half.kv_cache.state_bytes_per_sequence < kv.state_bytes_per_sequence


def test_mamba_states_hold_a_row_per_channel(checkpoint_factory):
    """Mamba's state: its conv channels are x's alone, its SSM state a row a channel (a head of
    one), [inner, state_size] a layer."""
    e = engine(checkpoint_factory("MambaForCausalLM"), max_num_seqs=3)
    s, kv = e.config.ssm, e.kv_cache
    assert s.kind == "mamba" and s.head_dim == 1 and s.conv_dim == s.inner_size == 88
    assert [tuple(t.shape) for t in kv.ssm_states] == [(3, 88, 1, 10)] * 3
    assert [tuple(t.shape) for t in kv.conv_states] == [(3, 88, 2)] * 3
    assert kv.state_bytes_per_sequence == 3 * (88 * 2 + 88 * 10) * 4


@pytest.mark.parametrize("options, message", [
    # (tests/distributed/ splits the models whose heads and groups two ranks divide)
    (dict(tensor_parallel_size=2), "tensor_parallel_size 2 and the 5 B/C groups of "
     "Mamba2ForCausalLM must divide one another"),
    (dict(kv_role="producer", async_scheduling=True), "kv_role with async_scheduling is not "
     "supported for models with state-space layers"),
    (dict(num_state_snapshots=-1), r"num_state_snapshots must be in \[0, 1048576\], got -1"),
    (dict(num_state_snapshots=10**9), r"num_state_snapshots must be in \[0, 1048576\]"),
    # Memory: the states alone past the default budget, or past the one given.
    (dict(max_num_seqs=10**6), r"the state pool \(max_num_seqs 1000000 \+ num_state_snapshots 0 "
     r"states of 41040 bytes\) exceeds the default budget \(4294967296 bytes\): lower them, or "
     "set kv_cache_memory"),
    (dict(num_state_snapshots=1 << 20), "exceeds the default budget"),
    (dict(num_state_snapshots=100, kv_cache_memory=1 << 20),
     r"exceeds kv_cache_memory \(1048576 bytes\): lower them$"),
])
def test_unsupported_options_are_refused_clearly(mamba2, options, message):
    with pytest.raises(ValueError, match=message):
        engine(mamba2, **options)


def test_state_snapshots_are_refused_for_a_model_without_states(checkpoint_factory):
    with pytest.raises(ValueError, match="num_state_snapshots is for models with state-space "
                                         "layers; LlamaForCausalLM has none"):
        engine(checkpoint_factory("LlamaForCausalLM"), num_state_snapshots=4)
