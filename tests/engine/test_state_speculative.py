"""Speculative decoding on models with state-space layers. A step that verifies drafts runs every
draft through the sequences' states, which would then keep the rejected ones: each sequence's
state is copied to a backup slot before such a step, and when a draft is rejected the backup
comes back and the next step recomputes the accepted tokens through it. So greedy output equals
plain decoding (and transformers) for every family, through mixed arrivals, chunked prefill,
prefix hits on saved states and preemption, with drafts rejected and drafts accepted in full;
sampled output follows the target's distribution."""

from __future__ import annotations

import pytest
import torch

import kvserve
from kvserve import SamplingParams
from kvserve.testing.checkpoints import make_checkpoint
from tests.engine.test_state_models import MODELS, VARIANTS, engine, generate, run

# Draft three tokens from any earlier occurrence of the last one, whatever the batch.
NGRAM = dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
             speculative_disable_batch_size=0, speculative_max_verify_tokens=0)
# A vocabulary of 32: outputs soon repeat tokens, so n-gram lookup drafts at most steps.
PROMPTS = [[1, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [1, 9, 10, 11, 12], [1, 3, 4],
           [1, 20, 21, 22, 23, 24, 25, 26, 27, 28]]
NUM_TOKENS = 24


@pytest.fixture(scope="module", params=MODELS)
def model(checkpoint_factory, request):
    architecture, _, variant = request.param.partition("+")
    return checkpoint_factory(architecture, vocab_size=32, **VARIANTS.get(variant, {}))


@pytest.fixture(scope="module")
def plain(model):
    """Plain decoding's greedy tokens for each prompt, alone (test_state_models checks them
    against transformers)."""
    e = engine(model)
    return [run(e, [(prompt, NUM_TOKENS, 0)])["0"] for prompt in PROMPTS]


def test_greedy_ngram_equals_plain_decoding(model, plain):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    llm = kvserve.LLM(model, dtype="float32", **NGRAM)
    assert [o.outputs[0].token_ids for o in generate(llm, PROMPTS, params)] == plain
    s = llm.llm_engine.get_stats()
    assert s.num_draft_tokens > s.num_accepted_tokens  # rejected drafts sent states back
    # Each sequence's slot has a backup beside it, in the pool and the memory plan.
    assert llm.llm_engine.kv_cache.num_state_slots == 2 * llm.llm_engine.engine.config.max_num_seqs
    assert "of the slots back up states before steps that verify drafts" in (
        llm.llm_engine.memory_plan())


def test_mixed_arrivals_prefix_hits_and_preemption_equal_alone(model, plain):
    """Requests arriving while others prefill and decode in chunks of 9 tokens, prefix hits on
    saved states, a pool that preempts: each request gives its solo tokens."""
    e = engine(model, max_num_batched_tokens=9, block_size=4, num_blocks=14,
               num_state_snapshots=4, **NGRAM)
    requests = [(prompt, NUM_TOKENS, arrival) for prompt, arrival in zip(PROMPTS, (0, 2, 3, 9))]
    requests += [(PROMPTS[0], NUM_TOKENS, 14)]
    got = run(e, requests)
    assert [got[str(i)] for i in range(len(requests))] == plain + plain[:1]
    assert e.scheduler.num_preemptions > 0 and e.get_stats().num_draft_tokens > 0
    e.block_manager.check_invariants()


def test_a_prefix_hit_past_the_prompt_resumes_from_a_true_state(model, plain):
    """A second request's prompt is the first's prompt and output: it hits blocks the first
    computed while verifying drafts, whose states were saved only from steps without drafts (a
    state after drafts is not the state at the block's end). It gives plain decoding's tokens."""
    e = engine(model, block_size=4, num_state_snapshots=16, **NGRAM)
    assert run(e, [(PROMPTS[0], NUM_TOKENS, 0)])["0"] == plain[0]
    assert e.get_stats().num_draft_tokens > 0
    prompt = PROMPTS[0] + plain[0][:22]
    hits = e.block_manager.prefix_cache_hits()
    got = run(e, [(prompt, 8, 0)])["0"]
    assert e.block_manager.prefix_cache_hits() > hits
    assert got == run(engine(model, enable_prefix_caching=False), [(prompt, 8, 0)])["0"]


def test_drafts_accepted_in_full_keep_the_state(checkpoint_factory):
    """A tiny Nemotron-H whose greedy output repeats: some steps accept all three drafts (the
    state after them is the sequence's), others part of them; the output is plain decoding's."""
    path = checkpoint_factory("NemotronHForCausalLM")
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in generate(kvserve.LLM(path, dtype="float32"),
                                                     PROMPTS, params)]
    llm = kvserve.LLM(path, dtype="float32", **NGRAM)
    assert [o.outputs[0].token_ids for o in generate(llm, PROMPTS, params)] == want
    accepted = list(llm.llm_engine.get_stats().accepted_per_position)
    assert accepted[2] > 0 and accepted[0] > accepted[2]


def test_a_draft_model_drafts_for_a_hybrid(checkpoint_factory, tmp_path):
    """A Llama of the same vocabulary drafts for a Granite 4 style hybrid; a draft model with
    state-space layers of its own is refused."""
    target = checkpoint_factory("GraniteMoeHybridForCausalLM")
    vocab = kvserve.LLM(target, dtype="float32").llm_engine.config.vocab_size
    draft = make_checkpoint(tmp_path / "draft", "LlamaForCausalLM", vocab_size=vocab)
    want = [o.outputs[0].token_ids for o in generate(kvserve.LLM(target, dtype="float32"))]
    llm = kvserve.LLM(target, dtype="float32", speculative_model=str(draft),
                      num_speculative_tokens=2, speculative_disable_batch_size=0)
    assert [o.outputs[0].token_ids for o in generate(llm)] == want
    assert llm.llm_engine.get_stats().num_drafts > 0
    with pytest.raises(ValueError, match="a draft model with state-space layers"):
        kvserve.LLM(draft, dtype="float32", speculative_model=str(target))


def test_sampled_tokens_follow_the_target_distribution(tmp_path):
    """N-gram drafts at temperature 1 on a six-token Mamba2 against its enumerated distribution
    (test_speculative_decoding's chi-square test): a rejected draft's state never leaks into
    what follows."""
    from tests.engine.test_speculative_decoding import (FILTERS, SAMPLES, chi_square_pvalue,
                                                        conditionals, engine_counts, joint)

    path = make_checkpoint(tmp_path / "tiny", "Mamba2ForCausalLM", vocab_size=6,
                           with_tokenizer=False, initializer_range=0.3)
    sampling = FILTERS["temperature 1"]
    expected = joint(conditionals(path, sampling, torch.float32))
    counts = engine_counts(path, NGRAM, sampling)
    assert chi_square_pvalue(counts, expected, SAMPLES) > 1e-4
