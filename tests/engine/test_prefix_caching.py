"""The model over the paged cache with the block manager: a prefix-cache hit gives the logits of
a cold run, a forked sequence diverges through copy-on-write without corrupting its parent, and
LLM.generate reuses prompt blocks across and within calls, returning the pool whole."""

from __future__ import annotations

import pytest
import torch

import kvserve
from kvserve import _C

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def llm(checkpoint_factory):
    return kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), dtype="float32")


class PagedModel:
    """A block manager and a paged cache driven by hand, one sequence per forward."""

    def __init__(self, llm, num_blocks=64):
        c = llm.config
        self.llm = llm
        self.blocks = _C.PagedBlockManager(num_blocks, BLOCK_SIZE)
        self.cache = _C.PagedKVCache(c.num_layers, num_blocks, BLOCK_SIZE, c.num_kv_heads,
                                     c.head_dim)
        for t in self.cache.key_caches + self.cache.value_caches:
            t.fill_(float("nan"))  # only written slots may be read

    def feed(self, seq_id, tokens, num_cached):
        """Runs `tokens` of seq_id after num_cached cached ones; returns the last logits."""
        builder = _C.ForwardBatchBuilder(BLOCK_SIZE)
        builder.add(tokens, num_cached, self.blocks.block_table(seq_id))
        batch = builder.build()
        hidden = self.llm.model.forward(batch.input_ids, batch.positions, batch.metadata,
                                        self.cache)
        self.blocks.mark_computed(seq_id, num_cached + len(tokens))
        return self.llm.model.compute_logits(hidden[batch.logits_indices])[0]

    def prefill(self, seq_id, prompt):
        cached = self.blocks.allocate(seq_id, prompt)
        return self.feed(seq_id, prompt[cached:], cached), cached

    def append(self, seq_id, token):
        copies = self.blocks.append_slots(seq_id, [token])
        self.cache.copy_blocks([(c.src, c.dst) for c in copies])
        return self.feed(seq_id, [token], self.blocks.num_tokens(seq_id) - 1), copies


def cold_logits(llm, tokens):
    """Last-position logits of a fresh contiguous-cache run."""
    c = llm.config
    caches = kvserve.KVCache.from_model_config(1, len(tokens), c.num_layers, c.num_kv_heads,
                                               c.head_dim)
    return llm.model(torch.tensor([tokens]), caches)[0, -1]


def assert_same_logits(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_prefix_hit_gives_the_cold_logits(llm):
    pm = PagedModel(llm)
    system = [1] + list(range(10, 23))                    # 14 tokens: 3 full blocks + 2
    first, cached = pm.prefill(1, system + [40, 41, 42])
    assert cached == 0
    assert_same_logits(first, cold_logits(llm, system + [40, 41, 42]))
    pm.blocks.free(1)                                     # its full blocks stay cached

    prompt = system + [50, 51, 52, 53, 54]
    logits, cached = pm.prefill(2, prompt)
    assert cached == 12 and pm.blocks.prefix_cache_hits() == 12
    assert_same_logits(logits, cold_logits(llm, prompt))

    # The identical prompt again while sequence 2 runs: all full blocks but the last token's.
    logits, cached = pm.prefill(3, prompt)
    assert cached == 16
    assert_same_logits(logits, cold_logits(llm, prompt))
    pm.blocks.check_invariants()


def test_extra_key_separates_identical_prompts(llm):
    pm = PagedModel(llm)
    prompt = [1] + list(range(30, 42))
    pm.prefill(1, prompt)
    assert pm.blocks.allocate(2, prompt, extra_key=7) == 0
    assert pm.blocks.allocate(3, prompt) == 12


def test_forked_sequence_diverges_without_corrupting_its_parent(llm):
    pm = PagedModel(llm)
    prompt = [1, 5, 9, 200, 31, 7, 8, 9, 10, 11]          # 10 tokens: the last block is half full
    pm.prefill(1, prompt)
    pm.blocks.fork(1, 2)
    parent, child = list(prompt), list(prompt)
    parent_logits, copies = pm.append(1, 300)
    assert len(copies) == 1                               # the shared half-full block is copied
    child_logits, copies = pm.append(2, 301)
    assert copies == []                                   # the child now owns the original
    parent.append(300)
    child.append(301)
    for step in range(7):                                 # both keep decoding, interleaved
        assert_same_logits(parent_logits, cold_logits(llm, parent))
        assert_same_logits(child_logits, cold_logits(llm, child))
        parent.append(int(parent_logits.argmax()))
        child.append(int(child_logits.argmax()))
        parent_logits, _ = pm.append(1, parent[-1])
        child_logits, _ = pm.append(2, child[-1])
    shared = set(pm.blocks.block_table(1)) & set(pm.blocks.block_table(2))
    assert len(shared) == 2                               # the two full prompt blocks
    pm.blocks.check_invariants()


def test_generate_reuses_prompt_blocks_and_returns_the_pool(checkpoint_factory):
    path = checkpoint_factory("LlamaForCausalLM")
    system = [1] + list(range(40, 80))                    # 41 tokens
    prompts = [system + [100 + i, 101 + i] for i in range(4)]
    params = kvserve.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cold = kvserve.LLM(path, dtype="float32", block_size=8, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, params)]
    assert cold.block_manager.prefix_cache_hits() == 0

    llm = kvserve.LLM(path, dtype="float32", block_size=8)
    first = llm.generate(prompts, params)
    # Within one batch the later prompts reuse the first one's five full blocks.
    assert [o.num_cached_tokens for o in first] == [0, 40, 40, 40]
    again = llm.generate(prompts[:1], params)
    assert again[0].num_cached_tokens == 40
    assert [o.outputs[0].token_ids for o in first] == expected
    assert again[0].outputs[0].token_ids == expected[0]
    blocks = llm.block_manager
    assert blocks.num_free_blocks() == blocks.num_usable_blocks() and blocks.num_sequences() == 0
    blocks.check_invariants()


def test_small_pool_runs_requests_in_several_batches(checkpoint_factory):
    path = checkpoint_factory("LlamaForCausalLM")
    prompts = [[1] + [10 + i] * (5 + 3 * i) for i in range(6)]
    params = kvserve.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    big = kvserve.LLM(path, dtype="float32")
    # 11 usable blocks of 4 tokens: room for about two of these requests at a time.
    small = kvserve.LLM(path, dtype="float32", block_size=4, num_blocks=12,
                        enable_prefix_caching=False)
    assert small.kv_cache.capacity_tokens == 44
    assert ([o.outputs[0].token_ids for o in small.generate(prompts, params)] ==
            [o.outputs[0].token_ids for o in big.generate(prompts, params)])


def test_a_request_that_can_never_fit_is_rejected(checkpoint_factory):
    path = checkpoint_factory("LlamaForCausalLM")
    llm = kvserve.LLM(path, dtype="float32", block_size=4, num_blocks=5)  # 16 tokens
    params = kvserve.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params)
    out = llm.generate([[1, 2, 3]], params)               # still serving
    assert len(out[0].outputs[0].token_ids) == 10


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size"),
    (dict(num_blocks=1), "num_blocks"),
    (dict(kv_cache_memory=10), "kv_cache_memory"),
    (dict(num_blocks=8, kv_cache_memory=1 << 20), "not both"),
])
def test_bad_cache_arguments(checkpoint_factory, kwargs, message):
    with pytest.raises(ValueError, match=message):
        kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), **kwargs)


def test_kv_cache_memory_sizes_the_pool(checkpoint_factory):
    llm = kvserve.LLM(checkpoint_factory("LlamaForCausalLM"), dtype="float32",
                      kv_cache_memory=1 << 20)
    per_block = llm.kv_cache.bytes_per_token * 16
    assert llm.kv_cache.num_blocks == (1 << 20) // per_block
