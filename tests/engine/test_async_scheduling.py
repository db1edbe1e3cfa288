"""Asynchronous scheduling (EngineArgs.async_scheduling): each step is launched before the previous
one's samples reach the host, the new step fed those samples on the device. The engine must give
exactly what it gives without it: greedy and seeded tokens and logprobs, through arrivals, stops,
aborts, length limits, preemption, chunked prefill, prefix caching, n samples, prompt logprobs, a
producer's held KV, and penalties, min_tokens and bad words that count the token still on the
device."""

from __future__ import annotations

import random

import pytest

import kvserve
from kvserve import SamplingParams
from tests import engine_loop
from tests.engine_loop import drain
from tests.engine_loop import fp32_engine as engine
from tests.engine_loop import run_arrivals as run

GREEDY = dict(temperature=0.0, ignore_eos=True)


def mixed_requests(count: int, seed: int = 0):
    return engine_loop.mixed_requests(count, seed, max_prompt=40, max_tokens=20, max_arrival=16)


# Paged K/V (Llama), MLA latents (DeepSeek-V2) and sliding-window groups beside full ones
# (Gemma 2): the pending token lands in each kind of cache.
@pytest.fixture(scope="module", params=["LlamaForCausalLM", "DeepseekV2ForCausalLM",
                                        "Gemma2ForCausalLM"])
def model_path(request, checkpoint_factory):
    return checkpoint_factory(request.param)


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    return checkpoint_factory("LlamaForCausalLM")


@pytest.fixture(scope="module")
def synchronous(model_path):
    """mixed_requests(24) through the engine without asynchronous scheduling."""
    return run(engine(model_path), mixed_requests(24))


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill beside pending decodes
    {"block_size": 4, "num_blocks": 48, "enable_prefix_caching": False},  # preemption
    {"max_num_seqs": 3},  # requests wait for a running one to end
], ids=["arrivals", "chunked-prefill", "preemption", "few-seqs"])
def test_async_equals_synchronous(model_path, synchronous, options):
    e = engine(model_path, async_scheduling=True, **options)
    assert run(e, mixed_requests(24)) == synchronous
    stats = e.get_stats()
    assert stats.num_async_steps == stats.num_steps > 0
    if "num_blocks" in options:
        assert e.get_stats().num_preemptions > 0


def test_prefix_caching_agrees_and_hits(path):
    system, requests = engine_loop.shared_prefix_requests()
    sync = engine(path, block_size=8)
    e = engine(path, block_size=8, async_scheduling=True)
    assert run(e, requests) == run(sync, requests)
    # Full blocks of generated tokens enter the cache too, each with its sampled token.
    stats = e.get_stats()
    assert stats.prefix_cache_hits >= 11 * 40
    # A prompt that repeats request 0 and its output hits the block its decode filled (48 of
    # its 50 tokens): that block was hashed with the tokens' values, not with placeholders.
    follow = [(system + [200] + run(sync, [(system + [200], 8, 0)])["0"], 4, 0)]
    before = e.get_stats().prefix_cache_hits
    assert run(e, follow) == run(sync, follow)
    assert e.get_stats().prefix_cache_hits - before == 48


def outputs(e, requests, params_of, steps_to_abort=()):
    """Per request id, its samples' final (token ids, finish reason, logprobs); requests are
    (id, prompt, arrival step); ids in steps_to_abort are aborted at that step. Checks that the
    pool is whole afterwards."""
    pending = sorted(requests, key=lambda r: r[2])
    aborts = dict(steps_to_abort)
    final, step = {}, 0
    while pending or e.has_unfinished_requests():
        while pending and pending[0][2] <= step:
            rid, prompt, _ = pending.pop(0)
            e.add_request(rid, prompt, params_of(rid))
        for rid, at in aborts.items():
            if at == step:
                e.abort_request(rid)
        for out in e.step():
            if out.finished:
                final[out.request_id] = [
                    (list(o.token_ids), o.finish_reason,
                     [(x.token_id, round(x.logprob, 4), x.rank,
                       [(t, round(v, 4)) for t, v in x.top]) for x in o.logprobs or []])
                    for o in out.outputs]
        step += 1
    blocks = e.block_manager
    assert blocks.num_free_blocks() == blocks.num_usable_blocks() and blocks.num_sequences() == 0
    return final


def strip_logprobs(final):
    return {rid: [(tokens, reason) for tokens, reason, _ in samples]
            for rid, samples in final.items()}


def logprob_values(final):
    return [value for rid in sorted(final) for _, _, logprobs in final[rid]
            for _, logprob, _, top in logprobs for value in [logprob] + [v for _, v in top]]


def test_seeded_sampling_logprobs_stops_and_aborts(path):
    rng = random.Random(3)
    requests = [(str(i), [1] + [rng.randrange(3, 381) for _ in range(rng.randrange(2, 30))],
                 rng.randrange(0, 12)) for i in range(20)]
    sync = outputs(engine(path), requests, lambda rid: SamplingParams(
        temperature=0.9, top_p=0.95, seed=int(rid), max_tokens=16, ignore_eos=True))
    # Stop token ids that end some requests early: a token each one sampled without them.
    stop_ids = sorted({s[0][0][5] for s in sync.values() if len(s[0][0]) > 6})[:4]

    def params(rid):
        return SamplingParams(temperature=0.9, top_p=0.95, seed=int(rid), max_tokens=16,
                              ignore_eos=True, logprobs=3, stop_token_ids=stop_ids)

    aborts = [("4", 6), ("9", 3), ("13", 20)]
    want = outputs(engine(path), requests, params, aborts)
    got = outputs(engine(path, async_scheduling=True), requests, params, aborts)
    # An abort ends a request one step sooner in its tokens: the step that sampled the last ones
    # was still running when it came.
    for rid, _ in aborts:
        [(tokens, reason, _)], [(want_tokens, want_reason, _)] = got.pop(rid), want.pop(rid)
        assert reason == want_reason and tokens == want_tokens[:len(tokens)]
    assert got == want
    assert any(s[0][1] == "stop" for s in want.values())


def test_max_model_len_ends_requests_by_length(path):
    # Each request may fill the context exactly (the engine refuses more).
    requests = [([1] + list(range(5, 5 + n)), 31 - n, i) for i, n in enumerate((10, 27, 30))]
    sync = run(engine(path, max_model_len=32), requests)
    assert run(engine(path, max_model_len=32, async_scheduling=True), requests) == sync
    assert [len(sync[str(i)]) for i in range(3)] == [21, 4, 1]


def test_stop_strings_end_as_without_async(path):
    prompt = "Once upon a time"
    sync = engine(path)
    reference = kvserve.LLM(path, dtype="float32").generate(
        prompt, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)[0].outputs[0]
    stop = reference.text[len(reference.text) // 2:][:3]
    assert stop
    e = engine(path, async_scheduling=True)
    for target in (sync, e):
        target.add_request("s", prompt, SamplingParams(max_tokens=24, stop=[stop], **GREEDY))
        target.add_request("t", prompt, SamplingParams(max_tokens=24, **GREEDY))
    want, got = drain(sync), drain(e)
    for rid in ("s", "t"):
        assert got[rid].outputs[0].text == want[rid].outputs[0].text
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
        assert got[rid].outputs[0].finish_reason == want[rid].outputs[0].finish_reason
    assert want["s"].outputs[0].finish_reason == "stop"


def test_streamed_deltas_add_up_to_the_output(path):
    e = engine(path, async_scheduling=True)
    e.add_request("d", [1, 5, 6, 7], SamplingParams(max_tokens=12, **GREEDY),
                  output_kind="delta")
    tokens, finished = [], 0
    while e.has_unfinished_requests():
        for out in e.step():
            tokens += out.outputs[0].token_ids
            finished += out.finished
    assert finished == 1 and tokens == run(engine(path), [([1, 5, 6, 7], 12, 0)])["0"]


def test_penalties_and_min_tokens_count_the_pending_token(path):
    """Penalties and min_tokens see each sequence's last token while it is still on the device:
    every step runs ahead, and tokens and logprobs are the synchronous engine's, through
    repetitions of prompt and output tokens, seeded sampling and stop tokens."""
    rng = random.Random(5)
    requests = [(str(i), [1] + [rng.randrange(3, 40) for _ in range(rng.randrange(2, 20))],
                 rng.randrange(0, 8)) for i in range(24)]

    def params(rid):
        r = random.Random(int(rid))
        return SamplingParams(
            max_tokens=r.randrange(4, 20), ignore_eos=True, logprobs=2,
            temperature=r.choice([0.0, 0.9]), seed=int(rid),
            repetition_penalty=r.choice([1.0, 1.4, 0.7]),
            presence_penalty=r.choice([0.0, 0.6, -0.4]),
            frequency_penalty=r.choice([0.0, 0.3, -0.5]),
            min_tokens=r.choice([0, 3]), stop_token_ids=r.choice([[], [5, 9]]))

    e = engine(path, async_scheduling=True)
    assert outputs(e, requests, params) == outputs(engine(path), requests, params)
    stats = e.get_stats()
    assert stats.num_async_steps == stats.num_steps


def test_min_tokens_lets_a_stop_token_through_right_when_reached(path):
    """A stop token first sampled at position k with min_tokens = k: the step that samples it
    counts the pending token among the k before it, so the request stops there."""
    prompt = [1, 5, 6, 7]
    tokens = run(engine(path), [(prompt, 16, 0)])["0"]
    k = next(k for k in range(2, len(tokens)) if tokens[k] not in tokens[:k])
    params = SamplingParams(max_tokens=16, min_tokens=k, stop_token_ids=[tokens[k]], **GREEDY)
    for e in (engine(path), engine(path, async_scheduling=True)):
        e.add_request("m", prompt, params)
        out = drain(e)["m"].outputs[0]
        assert (out.token_ids, out.finish_reason) == (tokens[:k + 1], "stop")


@pytest.mark.parametrize("options", [{}, {"block_size": 4, "num_blocks": 40,
                                         "enable_prefix_caching": False}],
                         ids=["pool", "preemption"])
def test_n_samples_fork_behind_their_pending_tokens(path, options):
    """A prompt's n samples fork in the step that samples their first tokens, each sequence
    behind its own pending token (a shared last block copied on write): the synchronous
    engine's samples, seeded, with logprobs and penalties."""
    rng = random.Random(7)
    requests = [(str(i), [1] + [rng.randrange(3, 381) for _ in range(rng.randrange(2, 14))],
                 rng.randrange(0, 6)) for i in range(10)]

    def params(rid):
        return SamplingParams(n=1 + int(rid) % 3, temperature=0.9, seed=int(rid), logprobs=1,
                              max_tokens=6 + int(rid), ignore_eos=True,
                              frequency_penalty=0.4 * (int(rid) % 2))

    e = engine(path, async_scheduling=True, **options)
    got, want = outputs(e, requests, params), outputs(engine(path, **options), requests, params)
    if options:
        # A preempted sequence is recomputed in a prefill whose batch differs between the two
        # engines (they preempt at different steps): its logits are equal to rounding only.
        assert strip_logprobs(got) == strip_logprobs(want)
        assert logprob_values(got) == pytest.approx(logprob_values(want), abs=1e-4)
    else:
        assert got == want
    stats = e.get_stats()
    assert stats.num_async_steps == stats.num_steps
    if options:
        assert stats.num_preemptions > 0


def test_prompt_logprobs_are_scored_in_launched_steps(path):
    """Prompt logprobs of prompts prefilled in chunks beside decoding sequences: every step runs
    ahead, and each prompt's scores are the synchronous engine's."""
    rng = random.Random(11)
    requests = [(str(i), [1] + [rng.randrange(3, 381) for _ in range(rng.randrange(3, 40))],
                 rng.randrange(0, 6)) for i in range(8)]

    def params(rid):
        return SamplingParams(max_tokens=8, prompt_logprobs=int(rid) % 3 or None, logprobs=1,
                              **GREEDY)

    def scored(e):
        final, pending, step = {}, sorted(requests, key=lambda r: r[2]), 0
        while pending or e.has_unfinished_requests():
            while pending and pending[0][2] <= step:
                rid, prompt, _ = pending.pop(0)
                e.add_request(rid, prompt, params(rid))
            for out in e.step():
                if out.finished:
                    final[out.request_id] = (out.outputs[0].token_ids, str(out.prompt_logprobs))
            step += 1
        return final

    e = engine(path, async_scheduling=True, max_num_batched_tokens=16)
    got = scored(e)
    assert got == scored(engine(path, max_num_batched_tokens=16))
    assert sum(p != "None" for _, p in got.values()) >= 4
    stats = e.get_stats()
    assert stats.num_async_steps == stats.num_steps


def test_bad_words_match_across_the_pending_token(path):
    """Bad words of one, two and three tokens, whose next-to-last token is the one still on the
    device: masked where they match, as by the synchronous engine, every step ahead."""
    prompt = [1, 5, 6, 7]
    tokens = run(engine(path), [(prompt, 16, 0)])["0"]
    words = [tokens[1:3], tokens[4:7], tokens[9:10], [tokens[2], tokens[0]]]
    requests = [(str(i), prompt if i % 2 else [1] + list(range(10 + i, 20 + 2 * i)), i)
                for i in range(8)]

    def params(rid):
        p = SamplingParams(max_tokens=16, **GREEDY)
        p.bad_words_token_ids = words
        return p

    e = engine(path, async_scheduling=True)
    got = outputs(e, requests, params)
    assert got == outputs(engine(path), requests, params)
    assert got["1"][0][0] != tokens  # the words bit
    stats = e.get_stats()
    assert stats.num_async_steps == stats.num_steps


def test_a_producers_held_request_among_plain_ones(path):
    """A request whose KV a decode engine will pull, ending by a stop token after a pending
    token was scheduled behind it, holds its blocks among plain requests on a producer; every
    output is the synchronous engine's (tests/engine/test_kv_transfer.py pulls such KV)."""
    requests = [(str(i), [1] + list(range(10 + i, 20 + 2 * i)), i) for i in range(8)]
    first = run(engine(path), [(requests[3][1], 4, 0)])["0"]

    def tokens(e):
        final, pending, step = {}, list(requests), 0
        while pending or e.has_unfinished_requests():
            while pending and pending[0][2] <= step:
                rid, prompt, _ = pending.pop(0)
                held = rid == "3"
                e.add_request(rid, prompt, SamplingParams(
                    max_tokens=10, stop_token_ids=[first[2]] if held else None, **GREEDY),
                    kv_transfer_params={"do_remote_decode": True} if held else None)
            for out in e.step():
                if out.finished:
                    final[out.request_id] = (out.outputs[0].token_ids,
                                             out.outputs[0].finish_reason)
            step += 1
        assert e.get_stats().num_held_requests == 1
        return final

    launched = engine(path, async_scheduling=True, kv_role="producer")
    got = tokens(launched)
    assert got == tokens(engine(path, kv_role="producer"))
    assert got["3"][1] == "stop"
    stats = launched.get_stats()
    assert stats.num_async_steps == stats.num_steps


def test_a_failed_step_ends_its_requests_and_the_engine_keeps_serving(path):
    e = engine(path, async_scheduling=True)
    for i in range(3):
        e.add_request(f"a{i}", [1, 5 + i, 6], SamplingParams(max_tokens=20, **GREEDY))
    e.step()
    e.step()
    e.engine.inject_step_failures(1)
    with pytest.raises(RuntimeError, match="injected"):
        e.step()
    final = drain(e)
    assert {final[f"a{i}"].outputs[0].finish_reason for i in range(3)} == {"error"}
    e.add_request("b", [1, 5, 6, 7], SamplingParams(max_tokens=12, **GREEDY))
    assert drain(e)["b"].outputs[0].token_ids == run(engine(path), [([1, 5, 6, 7], 12, 0)])["0"]


def test_speculative_decoding_is_refused(path):
    with pytest.raises(ValueError, match="speculative decoding"):
        engine(path, async_scheduling=True, speculative_method="ngram")


@pytest.mark.parametrize("architecture", ["Mamba2ForCausalLM", "GraniteMoeHybridForCausalLM",
                                          "FalconH1ForCausalLM", "JambaForCausalLM"])
@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 9},
    {"block_size": 4, "num_blocks": 16, "max_num_batched_tokens": 16, "num_state_snapshots": 4},
], ids=["chunked-prefill", "preemption-snapshots"])
def test_state_space_models(checkpoint_factory, architecture, options):
    """State slots beside the blocks: a launched step writes the states of sequences whose last
    samples may end them (their slots are handed out again only after), chunked prefills carry
    states across launched steps, snapshots serve prefix hits, n samples fork a state."""
    path = checkpoint_factory(architecture)
    rng = random.Random(13)
    prompts = [[1] + [rng.randrange(3, 90) for _ in range(rng.randrange(3, 20))]
               for _ in range(4)]
    requests = [(str(i), prompts[i % 4], i) for i in range(8)]

    def params(rid):
        return SamplingParams(max_tokens=6 + int(rid), n=1 + int(rid) % 2, temperature=0.8,
                              seed=int(rid), ignore_eos=True, logprobs=1)

    e = engine(path, async_scheduling=True, **options)
    got, want = outputs(e, requests, params), outputs(engine(path, **options), requests, params)
    assert strip_logprobs(got) == strip_logprobs(want)
    assert logprob_values(got) == pytest.approx(logprob_values(want), abs=1e-4)
    stats = e.get_stats()
    assert stats.num_async_steps == stats.num_steps


def test_the_option_reaches_the_cli_and_llm(path):
    args = kvserve.EngineArgs.from_cli_args(
        kvserve.EngineArgs.add_cli_args(__import__("argparse").ArgumentParser()).parse_args(
            ["--async-scheduling"]), model=str(path))
    assert args.async_scheduling
    llm = kvserve.LLM(path, dtype="float32", async_scheduling=True, log_memory_plan=False)
    out = llm.generate([[1, 5, 6, 7]], SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    assert out[0].outputs[0].token_ids == run(engine(path), [([1, 5, 6, 7], 12, 0)])["0"]
