"""Prefill/decode disaggregation between two engines of one process, over the real transport
(torch.distributed Gloo on loopback): a producer prefills with max_tokens 1 and holds the KV, a
consumer pulls it into its blocks and decodes. The reference is the colocated engine's greedy
output; the consumer computes no prompt token; what is held, loaded and freed is checked in
the block pools, also on timeouts, aborts, refusals and mismatches."""

from __future__ import annotations

import time

import pytest

from kvserve import LLMEngine, SamplingParams
from tests.engine_loop import drain, fp32_engine

pytest.importorskip("transformers")

BLOCK = 4
PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(n)] for i, n in enumerate([3, 9, 17, 26])]


def pair(path, timeout: float = 10.0, **options) -> tuple[LLMEngine, LLMEngine]:
    producer = fp32_engine(path, block_size=BLOCK, num_blocks=96, kv_role="producer",
                           kv_transfer_timeout=timeout, **options)
    consumer = fp32_engine(path, block_size=BLOCK, num_blocks=96, kv_role="consumer",
                           kv_transfer_timeout=timeout, **options)
    return producer, consumer


def prefill(producer: LLMEngine, request_id: str, prompt, **sampling) -> dict:
    """The producer's half: the prompt with max_tokens 1; its kv_transfer_params."""
    producer.add_request(request_id, prompt, SamplingParams(max_tokens=1, **sampling),
                         kv_transfer_params={"do_remote_decode": True})
    out = drain_held(producer)[request_id]
    assert out.outputs[0].finish_reason == "length" and out.kv_transfer_params is not None
    return out.kv_transfer_params


def drain_held(e: LLMEngine) -> dict:
    final = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                final[out.request_id] = out
    return final


def decode(consumer: LLMEngine, request_id: str, prompt, params: dict, max_tokens: int = 12,
           deadline: float = 30.0, **sampling):
    """The consumer's half: steps until the request finished (the pull runs on the connector's
    thread meanwhile)."""
    consumer.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **sampling),
                         kv_transfer_params=params)
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        for out in consumer.step():
            if out.finished and out.request_id == request_id:
                return out
        time.sleep(0.001)
    raise AssertionError("the disaggregated request did not finish")


def whole(e: LLMEngine) -> bool:
    b = e.block_manager
    return b.num_sequences() == 0 and b.num_free_blocks() == b.num_usable_blocks()


def colocated(path, prompts, max_tokens: int = 12, **options) -> list[list[int]]:
    e = fp32_engine(path, block_size=BLOCK, num_blocks=96, **options)
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True))
    final = drain(e)
    return [final[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def wait_for(condition, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.mark.parametrize("architecture, options", [
    ("LlamaForCausalLM", {}),
    ("DeepseekV2ForCausalLM", {}),               # MLA: the latent cache moves
    ("Gemma2ForCausalLM", {}),                   # a sliding-window group and a global one
    ("LlamaForCausalLM", {"kv_cache_dtype": "int8"}),  # entries and their scales
    ("LlamaForCausalLM", {"async_scheduling": True}),  # both engines launch steps ahead
    # State-space layers: each request's state at the prompt's end moves after its pages (a
    # Mamba2's blocks hold no bytes), and the consumer's prefix hits keep its saved states out
    ("Mamba2ForCausalLM", {"num_state_snapshots": 32}),
    ("GraniteMoeHybridForCausalLM", {"num_state_snapshots": 32}),
    ("JambaForCausalLM", {"num_state_snapshots": 32}),
], ids=["llama", "deepseek-mla", "gemma2-hybrid", "llama-int8-kv", "llama-async", "mamba2",
        "granite-hybrid", "jamba"])
def test_disaggregated_greedy_equals_colocated(checkpoint_factory, architecture, options):
    """Every prompt prefilled on the producer and decoded on the consumer gives the colocated
    tokens; the consumer computes no prompt token, both pools are whole afterwards. A second
    round whose prompts extend the first round's hits the consumer's prefix cache: only the
    blocks after the hit move. (A state model's consumer saves no state inside a loaded prompt,
    so its second round extends the first round's output, a conversation's next turn: the hits
    end at states its decode saved, and the transfer brings the state at the new prompt's end
    in place of the hit's.)"""
    path = checkpoint_factory(architecture)
    greedy = dict(temperature=0.0, ignore_eos=True)
    if "num_state_snapshots" in options:
        first = colocated(path, PROMPTS, **options)
        extended = [p + out[:9] for p, out in zip(PROMPTS, first)]
        want = first + colocated(path, extended, **options)
    else:
        extended = [p + [11, 12, 13, 14, 15] for p in PROMPTS]
        want = colocated(path, PROMPTS + extended, **options)
    producer, consumer = pair(path, **options)
    try:
        for i, prompt in enumerate(PROMPTS + extended):
            params = prefill(producer, f"p{i}", prompt, **greedy)
            out = decode(consumer, f"d{i}", prompt, params, **greedy)
            assert out.outputs[0].token_ids == want[i], (architecture, i)
            assert out.error is None
            if i >= len(PROMPTS) and len(PROMPTS[i - len(PROMPTS)]) >= 2 * BLOCK:
                assert out.num_cached_tokens >= BLOCK  # the first round's blocks stayed cached
        stats = consumer.get_stats()
        assert stats.num_computed_prompt_tokens == 0
        loaded = sum(len(p) for p in PROMPTS + extended)
        assert 0 < stats.num_loaded_prompt_tokens < loaded  # the hits moved nothing
        assert stats.num_loaded_prompt_tokens + stats.prefix_cache_hits == loaded
        assert wait_for(lambda: producer.get_stats().num_held_requests == 0)
        assert whole(producer) and whole(consumer)
        assert producer.kv_connector.num_pulled == len(PROMPTS + extended)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_seeded_sampling_continues_the_producers_stream(checkpoint_factory):
    """A seeded, sampled request gives the colocated tokens: the consumer continues the random
    stream after the producer's draw for the first token; logprobs of the first token come along."""
    path = checkpoint_factory("LlamaForCausalLM")
    sampling = dict(temperature=0.9, top_k=40, seed=1234, ignore_eos=True, logprobs=2)
    e = fp32_engine(path, block_size=BLOCK, num_blocks=96)
    e.add_request("ref", PROMPTS[2], SamplingParams(max_tokens=10, **sampling))
    want = drain(e)["ref"].outputs[0]
    producer, consumer = pair(path)
    try:
        params = prefill(producer, "p", PROMPTS[2], **sampling)
        got = decode(consumer, "d", PROMPTS[2], params, max_tokens=10, **sampling).outputs[0]
        assert got.token_ids == want.token_ids
        assert [(lp.token_id, lp.rank, lp.top) for lp in got.logprobs] == \
            [(lp.token_id, lp.rank, lp.top) for lp in want.logprobs]
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_an_unpulled_transfer_is_freed_after_its_timeout(checkpoint_factory):
    """Held blocks go back to the producer's pool after kv_transfer_timeout; a late pull then
    ends the consumer's request with an error naming why, and frees its blocks."""
    path = checkpoint_factory("LlamaForCausalLM")
    producer, consumer = pair(path, timeout=0.5)
    try:
        params = prefill(producer, "p", PROMPTS[3])
        assert producer.get_stats().num_held_requests == 1 and not whole(producer)
        assert wait_for(lambda: producer.get_stats().num_held_requests == 0)
        assert whole(producer) and producer.kv_connector.num_expired == 1
        out = decode(consumer, "d", PROMPTS[3], params)
        assert out.outputs[0].finish_reason == "error" and "no KV is held" in out.error
        assert whole(consumer) and consumer.kv_connector.num_failed == 1
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_pull_for_another_prompt_or_layout_is_refused(checkpoint_factory):
    """The producer checks what it sends: the consumer's prompt must be the prefilled one, and
    both pools must lay blocks out alike; either refusal ends only that request, and the held
    blocks are freed."""
    path = checkpoint_factory("LlamaForCausalLM")
    producer, consumer = pair(path)
    other = fp32_engine(path, block_size=BLOCK, num_blocks=96, kv_role="consumer",
                        kv_cache_dtype="int8")
    try:
        params = prefill(producer, "p1", PROMPTS[1])
        out = decode(consumer, "d1", PROMPTS[1][:-1] + [99], params)
        assert out.outputs[0].finish_reason == "error" and "prompt tokens differ" in out.error
        params = prefill(producer, "p2", PROMPTS[1])
        out = decode(other, "d2", PROMPTS[1], params)
        assert out.outputs[0].finish_reason == "error" and "layouts differ" in out.error
        assert wait_for(lambda: whole(producer)) and whole(consumer) and whole(other)
        params = prefill(producer, "p3", PROMPTS[1], temperature=0.0)  # the pair still works
        out = decode(consumer, "d3", PROMPTS[1], params, temperature=0.0)
        assert out.error is None and len(out.outputs[0].token_ids) == 12
    finally:
        for e in (producer, consumer, other):
            e.shutdown()


def test_an_abort_while_loading_frees_the_blocks_after_the_pull(checkpoint_factory):
    """A request aborted while its pull runs ends at once ("abort"); its blocks stay allocated
    until the pull is over (the transport may still write them), then return to the pool."""
    path = checkpoint_factory("LlamaForCausalLM")
    producer, consumer = pair(path)
    try:
        params = prefill(producer, "p", PROMPTS[3])
        consumer.add_request("d", PROMPTS[3], SamplingParams(max_tokens=8),
                             kv_transfer_params=params)
        consumer.step()  # admitted: blocks allocated, the pull starts
        consumer.abort_request("d")
        outs = {o.request_id: o for o in consumer.step()}
        assert outs["d"].outputs[0].finish_reason == "abort"
        assert wait_for(lambda: (consumer.step(), whole(consumer))[1])
        assert not consumer.has_unfinished_requests()
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("params, sampling, match", [
    ({"do_remote_prefill": True, "remote_host": "127.0.0.1"}, {}, "needs remote_port"),
    ({"do_remote_prefill": True, "do_remote_decode": True}, {}, "exclusive"),
    ({"do_remote_decode": "yes"}, {}, "must be a boolean"),
    ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 70000,
      "remote_request_id": "r"}, {}, "port number"),
    ({"do_remote_decode": True}, {}, "not a KV producer"),
    ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 1,
      "remote_request_id": "r"}, {"n": 2}, "n = 1"),
    ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 1,
      "remote_request_id": "r"}, {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("not an object", {}, "must be an object"),
])
def test_bad_kv_transfer_params_are_refused(checkpoint_factory, params, sampling, match):
    """Refused at add_request with a ValueError naming the problem; nothing is queued."""
    e = fp32_engine(checkpoint_factory("LlamaForCausalLM"), block_size=BLOCK, num_blocks=32,
                    kv_role="consumer")
    try:
        with pytest.raises(ValueError, match=match):
            e.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4, **sampling),
                          kv_transfer_params=params)
        assert not e.has_unfinished_requests()
    finally:
        e.shutdown()


def test_a_state_model_producer_holds_the_state_at_the_prompts_end(checkpoint_factory):
    """The state it sends is the one after the prompt: more than one token is refused."""
    producer = fp32_engine(checkpoint_factory("Mamba2ForCausalLM"), kv_role="producer")
    try:
        with pytest.raises(ValueError, match="takes max_tokens = 1"):
            producer.add_request("p", PROMPTS[1], SamplingParams(max_tokens=2),
                                 kv_transfer_params={"do_remote_decode": True})
    finally:
        producer.shutdown()
    assert not producer.has_unfinished_requests()


def test_kv_transfer_params_need_a_kv_role(checkpoint_factory):
    e = fp32_engine(checkpoint_factory("LlamaForCausalLM"), num_blocks=32)
    with pytest.raises(ValueError, match="has no kv_role"):
        e.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4),
                      kv_transfer_params={"do_remote_decode": True})
    e.add_request("ok", PROMPTS[0], SamplingParams(max_tokens=2),  # flags off: a plain request
                  kv_transfer_params={"do_remote_decode": False, "remote_host": None})
    assert len(drain(e)["ok"].outputs[0].token_ids) == 2


def test_an_unreachable_producer_delays_only_the_pulls_that_name_it(checkpoint_factory):
    """kv_transfer_params naming a port where nothing listens: that request ends with an error
    after the transfer timeout, while a pull from a live producer, added after it, completes
    meanwhile (each producer has a pull thread of its own)."""
    from kvserve.server.serve import free_port

    path = checkpoint_factory("LlamaForCausalLM")
    producer, consumer = pair(path, timeout=3.0)
    try:
        dead = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                "remote_port": free_port(), "remote_request_id": "nothing"}
        consumer.add_request("lost", PROMPTS[2], SamplingParams(max_tokens=4),
                             kv_transfer_params=dead)
        consumer.step()
        params = prefill(producer, "p", PROMPTS[1], temperature=0.0)
        started = time.monotonic()
        out = decode(consumer, "d", PROMPTS[1], params, temperature=0.0)
        assert out.error is None and time.monotonic() - started < 2.5
        lost = decode(consumer, "lost-2", PROMPTS[0], dead)  # the dead lane's next pull
        assert lost.outputs[0].finish_reason == "error" and "failed" in lost.error
        assert wait_for(lambda: (consumer.step(), whole(consumer))[1])
        assert consumer.kv_connector.num_failed == 2
    finally:
        producer.shutdown()
        consumer.shutdown()
