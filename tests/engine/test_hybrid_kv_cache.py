"""The engine on models with sliding-window layers: the pool groups layers by window, a local
group's blocks stay bounded by its window however long a request runs (decode and chunked
prefill), prefix hits on a hybrid model give the tokens of cold runs, and the admission counts
only the window."""

from __future__ import annotations

import pytest
import torch

import kvserve
from kvserve import SamplingParams
from tests.engine_loop import fp32_engine as engine
from tests.engine_loop import run_arrivals as run

transformers = pytest.importorskip("transformers")

GREEDY = dict(temperature=0.0, ignore_eos=True)
WINDOW, BLOCK = 6, 4  # the tiny Gemma's window; blocks of 4 tokens


@pytest.fixture(scope="module")
def gemma(checkpoint_factory):
    """Gemma 2: layer 0 local (window 6), layer 1 global; 12k positions."""
    return checkpoint_factory("Gemma2ForCausalLM", max_position_embeddings=12288)


def test_pool_groups_layers_by_window(gemma):
    e = engine(gemma, block_size=BLOCK)
    layout = e.kv_cache.layout
    assert [(g.sliding_window, list(g.layers)) for g in layout.groups] == [(6, [0]), (0, [1])]
    assert layout.num_slots() == 1 and e.kv_cache.num_layers == 2
    blocks = e.block_manager
    assert (blocks.num_groups(), blocks.group_window(0), blocks.group_window(1)) == (2, 6, 0)


def used_blocks(e) -> int:
    return e.block_manager.num_usable_blocks() - e.block_manager.num_free_blocks()


def test_local_blocks_stay_bounded_over_ten_thousand_tokens(gemma):
    """One request of 10,000 tokens: the global group holds a block per 4 tokens, the local
    group never more than its window's (asserted at every step)."""
    e = engine(gemma, block_size=BLOCK, max_model_len=10_016, enable_prefix_caching=False,
               num_blocks=2600)
    prompt = [1, 5, 9, 13]
    e.add_request("long", prompt, SamplingParams(max_tokens=10_000 - len(prompt), **GREEDY))
    most_local, steps = 0, 0
    while e.has_unfinished_requests():
        e.step()
        steps += 1
        seq_len = len(prompt) + steps  # tokens whose KV is in the cache after this step
        if e.has_unfinished_requests():
            local = used_blocks(e) - -(-seq_len // BLOCK)  # all but the global group's
            most_local = max(most_local, local)
    assert steps == 10_000 - len(prompt)
    assert 1 <= most_local <= -(-WINDOW // BLOCK) + 1


def test_chunked_prefill_of_a_long_prompt_keeps_the_local_group_bounded(gemma):
    e = engine(gemma, block_size=BLOCK, max_model_len=4096, enable_prefix_caching=False,
               max_num_batched_tokens=64, num_blocks=1200)
    prompt = [1] + [3 + i % 300 for i in range(3000)]
    e.add_request("p", prompt, SamplingParams(max_tokens=2, **GREEDY))
    most = 0
    for _ in range(100):
        if not e.has_unfinished_requests():
            break
        e.step()
        most = max(most, used_blocks(e))
    # The global group's whole prompt, plus the local window and one chunk.
    assert most <= -(-len(prompt) // BLOCK) + (WINDOW + 64) // BLOCK + 2


def test_prefix_hits_give_the_tokens_of_cold_runs(gemma):
    system = [1] + list(range(100, 160))
    requests = [(system + [200 + i] * (i % 5 + 1), 12, i % 3) for i in range(10)]
    on = engine(gemma, block_size=BLOCK)
    cold = engine(gemma, block_size=BLOCK, enable_prefix_caching=False)
    assert run(on, requests) == run(cold, requests)
    assert on.get_stats().prefix_cache_hits >= 9 * 56


def test_admission_counts_only_the_window_of_local_layers(gemma):
    """Memory for 260 one-layer blocks of 4 tokens: a 400-token prompt holds 100 global blocks
    and only a window and a chunk of local ones, so a second one is admitted while the first
    decodes (with every layer's blocks, each would hold 200 and they would run one by one)."""
    layer_block = BLOCK * 2 * 2 * 24 * 4  # tokens x (key, value) x KV heads x head_dim x fp32
    e = engine(gemma, block_size=BLOCK, max_model_len=512, kv_cache_memory=260 * layer_block,
               enable_prefix_caching=False, max_num_batched_tokens=64)
    assert e.kv_cache.num_blocks == 260
    for name in "ab":
        e.add_request(name, [1] + [7 + i % 200 for i in range(399)],
                      SamplingParams(max_tokens=8, **GREEDY))
    most = 0
    while e.has_unfinished_requests():
        e.step()
        most = max(most, e.get_stats().num_running_requests)
    assert most == 2 and e.get_stats().num_preemptions == 0


def test_matches_transformers_past_the_window(gemma):
    """Greedy tokens through the grouped pool, far past the window, against transformers."""
    from tests.models.test_parity import hf_greedy
    llm = kvserve.LLM(gemma, dtype="float32", block_size=BLOCK, log_memory_plan=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(gemma).eval()
    prompt = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    out = llm.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0]
    with torch.no_grad():
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 30)
