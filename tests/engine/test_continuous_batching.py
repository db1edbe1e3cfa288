"""The continuous-batching engine end to end: a request's greedy tokens do not depend on what it
is batched with, on preemption, on chunked prefill or on prefix caching; sampling features against
references; n > 1 shares blocks; aborts and bad input leave the engine serving and the pool whole."""

from __future__ import annotations

import random

import pytest
import torch

import kvserve
from kvserve import SamplingParams
from kvserve.config import load_checkpoint_info
from tests.engine_loop import drain, mixed_requests, shared_prefix_requests
from tests.engine_loop import fp32_engine as engine
from tests.engine_loop import run_arrivals as run

transformers = pytest.importorskip("transformers")

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    return checkpoint_factory("LlamaForCausalLM")


# The invariance tests run on a Llama (paged K/V), a DeepSeek-V2 (MLA latents, MoE), a Gemma 2
# (local layers with a window of 6 beside global ones), a Cohere2 (windowed RoPE layers beside
# NoPE global ones, attention beside the MLP), a gpt-oss (attention sinks, windowed and full
# layers, biased experts) and a Llama whose layers 1 and 3 attend over the KV of layers 0 and 2
# (cross-layer sharing).
@pytest.fixture(scope="module", params=["LlamaForCausalLM", "DeepseekV2ForCausalLM",
                                        "Gemma2ForCausalLM", "Cohere2ForCausalLM",
                                        "GptOssForCausalLM", "cla"])
def model_path(request, checkpoint_factory, tmp_path_factory):
    if request.param == "cla":
        from kvserve.testing.cla import make_cla_checkpoint
        return make_cla_checkpoint(tmp_path_factory.mktemp("cla"), {1: 0, 3: 2},
                                   num_hidden_layers=4)
    return checkpoint_factory(request.param)


@pytest.fixture(scope="module")
def alone(model_path):
    """Each request of mixed_requests(32) run by itself."""
    e = engine(model_path)
    return {str(i): run(e, [(prompt, n, 0)])["0"] for i, (prompt, n, _) in
            enumerate(mixed_requests(32))}


def test_batched_with_arrivals_equals_alone(model_path, alone):
    assert run(engine(model_path), mixed_requests(32)) == alone


def test_preemption_gives_identical_results(model_path, alone):
    # 40 blocks preempt a model of one or two KV groups; gpt-oss's two windowed layers and one
    # full one are three, each holding its blocks during a prefill: 20 more.
    groups = len(kvserve._C.KVCacheLayout.for_model(load_checkpoint_info(model_path).config,
                                                    True).groups)
    e = engine(model_path, block_size=4, num_blocks=40 + 20 * max(0, groups - 2),
               enable_prefix_caching=False)
    assert run(e, mixed_requests(32)) == alone
    assert e.get_stats().num_preemptions > 0


def test_chunked_prefill_gives_identical_results(model_path, alone):
    e = engine(model_path, max_num_batched_tokens=16)  # smaller than most prompts
    assert run(e, mixed_requests(32)) == alone


def test_prefix_caching_on_and_off_agree(model_path):
    _, requests = shared_prefix_requests()
    on = engine(model_path, block_size=8)
    off = engine(model_path, block_size=8, enable_prefix_caching=False)
    assert run(on, requests) == run(off, requests)
    stats = on.get_stats()
    assert stats.prefix_cache_hits >= 11 * 40 and stats.prefix_cache_hit_rate > 0.8
    assert off.get_stats().prefix_cache_hits == 0


def test_stop_string_across_a_token_boundary(path):
    e = engine(path)
    prompt = "Once upon a time"
    reference = kvserve.LLM(path, dtype="float32").generate(
        prompt, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)[0].outputs[0]
    ids = reference.token_ids
    tok = e.tokenizer
    # A stop string made of the last character of one token's text and the first of the next
    # one's, whose first occurrence is at that boundary.
    prompt_ids = tok.encode(prompt)
    stop = start = None
    for k in range(2, len(ids) - 1):
        before = tok.decode_continuation(prompt_ids, ids[:k])
        after = tok.decode_continuation(prompt_ids + ids[:k], ids[k:k + 1])
        if before and after and reference.text.find(before[-1] + after[0]) == len(before) - 1:
            stop, start = before[-1] + after[0], len(before) - 1
            break
    assert stop is not None
    e.add_request("s", prompt, SamplingParams(max_tokens=24, stop=[stop], **GREEDY))
    streamed, final = "", None
    while e.has_unfinished_requests():
        for out in e.step():
            streamed += out.outputs[0].delta_text
            final = out
    assert final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].text == reference.text[:start] == streamed
    e.add_request("t", prompt, SamplingParams(max_tokens=24, stop=[stop],
                                              include_stop_str_in_output=True, **GREEDY))
    while e.has_unfinished_requests():
        for out in e.step():
            final = out
    assert final.outputs[0].text == reference.text[:start + len(stop)]


def test_min_tokens_holds_back_stop_tokens(path):
    e = engine(path)
    greedy = run(e, [([1, 5, 6, 7], 12, 0)])["0"]
    stop_id = greedy[0]
    params = SamplingParams(max_tokens=12, min_tokens=4, stop_token_ids=[stop_id], **GREEDY)
    e.add_request("m", [1, 5, 6, 7], params)
    tokens = None
    while e.has_unfinished_requests():
        for out in e.step():
            tokens, reason = out.outputs[0].token_ids, out.outputs[0].finish_reason
    assert stop_id not in tokens[:4] and len(tokens) >= 5
    assert reason == "length" or (reason == "stop" and tokens[-1] == stop_id)


def test_seeded_sampling_is_the_same_in_any_batch(path):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    solo = run(engine(path), [([1, 9, 8, 7], 16, 0)], params)["0"]
    crowd = mixed_requests(10, seed=3)
    e = engine(path)
    for i, (prompt, n, _) in enumerate(crowd):
        e.add_request(f"x{i}", prompt, SamplingParams(max_tokens=n, temperature=1.0, seed=i))
    e.add_request("seeded", [1, 9, 8, 7], params)
    out = None
    while e.has_unfinished_requests():
        for o in e.step():
            if o.request_id == "seeded" and o.finished:
                out = o.outputs[0].token_ids
    assert out == solo


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_penalties_match_transformers_greedy(path):
    """Repetition penalty: transformers' processor over prompt + output, greedy."""
    prompt, n = [1, 5, 9, 5, 9, 5], 16
    model = hf_model(path)
    processor = transformers.RepetitionPenaltyLogitsProcessor(1.5)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            scores = processor(ids, model(ids).logits[:, -1])
            ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=1)
    expected = ids[0, len(prompt):].tolist()
    params = SamplingParams(max_tokens=n, repetition_penalty=1.5, **GREEDY)
    assert run(engine(path), [(prompt, n, 0)], params)["0"] == expected


def test_step_outputs_carry_each_tokens_logprobs_once(path):
    """The C++ engine's output for a running sample carries the logprobs of its new tokens only;
    the output that finishes it carries all of them (a step's cost must not grow with the output
    so far). LLMEngine still hands out every logprob so far at each step."""
    params = SamplingParams(max_tokens=7, logprobs=2, n=2, seed=3, temperature=1.0)
    core = engine(path).engine  # kvserve._C.ContinuousBatchingEngine
    core.add_request("l", [1, 40, 41], params)
    seen, final = {0: [], 1: []}, {}
    while core.has_unfinished_requests():
        for out in core.step():
            for o in out.outputs:
                assert [lp.token_id for lp in o.new_logprobs] == list(o.new_token_ids)
                seen[o.index] += list(o.new_logprobs)
                if o.finished:
                    final[o.index] = o
                else:
                    assert len(o.logprobs) == 0
    assert sorted(final) == [0, 1]
    for index, o in final.items():
        assert [(lp.token_id, lp.logprob) for lp in o.logprobs] == \
            [(lp.token_id, lp.logprob) for lp in seen[index]]
        assert [lp.token_id for lp in o.logprobs] == list(o.token_ids)
    python_engine = engine(path)
    python_engine.add_request("l", [1, 40, 41], params)
    while python_engine.has_unfinished_requests():
        for out in python_engine.step():
            for o in out.outputs:
                assert [lp.token_id for lp in o.logprobs] == list(o.token_ids)
                if o.finished:
                    assert [(lp.token_id, lp.logprob) for lp in o.logprobs] == \
                        [(lp.token_id, lp.logprob) for lp in final[o.index].logprobs]


def test_finished_only_steps_report_what_generate_needs(path):
    """step(finished_only=True) (LLM.generate's) reports a request only when it finishes, with
    every token it made since (new_token_ids, new_logprobs), unless it has stop strings, whose
    text is matched as tokens arrive: those are reported every step. The tokens equal the ones
    of reporting steps."""
    plain = SamplingParams(max_tokens=5, logprobs=1, **GREEDY)
    stopping = SamplingParams(max_tokens=5, stop=["never printed"], **GREEDY)
    finals = {}
    for finished_only in (False, True):
        core = engine(path).engine
        core.add_request("plain", [1, 40, 41], plain)
        core.add_request("stop", [1, 40, 42], stopping)
        core.add_request("short", [1, 40, 43], SamplingParams(max_tokens=2, n=2, seed=1))
        tokens = {"plain": [], "stop": [], "short0": [], "short1": []}
        steps = stop_reports = 0
        while core.has_unfinished_requests():
            steps += 1
            for out in core.step(finished_only):
                stop_reports += out.request_id == "stop"
                if finished_only:
                    assert out.finished or out.request_id == "stop", (steps, out.request_id)
                for o in out.outputs:
                    key = out.request_id + (str(o.index) if out.request_id == "short" else "")
                    tokens[key] += list(o.new_token_ids)
                    if out.request_id == "plain" and out.finished:
                        assert [lp.token_id for lp in o.new_logprobs] == list(o.new_token_ids)
        assert steps >= 5 and len(tokens["plain"]) == 5 and len(tokens["short0"]) == 2
        assert stop_reports == 5  # one report per token: its text is matched as it grows
        finals[finished_only] = tokens
    assert finals[True] == finals[False]


def test_logprobs_match_log_softmax(path):
    prompt, n = [1, 40, 41, 42], 6
    e = engine(path)
    e.add_request("l", prompt, SamplingParams(max_tokens=n, logprobs=3, **GREEDY))
    final = None
    while e.has_unfinished_requests():
        for out in e.step():
            final = out
    raw = final.outputs[0]
    assert len(raw.logprobs) == n
    tokens = raw.token_ids
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt + tokens])).logits[0]
    reference = torch.log_softmax(logits.double(), -1)[len(prompt) - 1:-1]
    for lp, row, token in zip(raw.logprobs, reference, tokens):
        assert lp.token_id == token and lp.rank == 1
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_n_samples_share_the_prompt_blocks(path):
    e = engine(path, block_size=8)
    prompt = [1] + list(range(50, 89))  # 40 tokens: five full blocks
    params = SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)
    e.add_request("n", prompt, params)
    used = []
    final = None
    while e.has_unfinished_requests():
        for out in e.step():
            final = out
        blocks = e.block_manager
        used.append(blocks.num_usable_blocks() - blocks.num_free_blocks())
    # After the fork every sample writes its own sixth block; the five prompt blocks are shared
    # (without sharing: 4 x 6 = 24).
    assert max(used) == 9
    assert e.block_manager.usage() == 0
    assert len(final.outputs) == 4 and all(len(c.token_ids) == 5 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1


def test_abort_frees_everything_and_reports_once(path):
    e = engine(path)
    e.add_request("a", [1, 2, 3, 4], SamplingParams(max_tokens=50, **GREEDY))
    e.add_request("b", [1, 7, 8], SamplingParams(max_tokens=5, **GREEDY))
    e.step()
    assert e.abort_request("a") and not e.abort_request("a") and not e.abort_request("zz")
    reports = []
    while e.has_unfinished_requests():
        reports += e.step()
    aborted = [o for o in reports if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].outputs[0].finish_reason == "abort"
    assert [o for o in reports if o.request_id == "b"][-1].outputs[0].finish_reason == "length"
    assert e.block_manager.num_sequences() == 0
    assert e.block_manager.num_free_blocks() == e.block_manager.num_usable_blocks()


@pytest.mark.parametrize("args, error, message", [
    (("dup", [1, 2], SamplingParams()), ValueError, "already in use"),
    (("e", [], SamplingParams()), ValueError, "prompt is empty"),
    (("v", [1, 10**6], SamplingParams()), ValueError, "outside the vocabulary"),
    (("v", [1, -3], SamplingParams()), ValueError, "outside the vocabulary"),
    (("long", [1] * 250, SamplingParams(max_tokens=10)), ValueError, "exceeds max_model_len"),
    (("lp", [1, 2], SamplingParams(logprobs=10**6)), ValueError, "logprobs"),
    (("a", [1, 2], SamplingParams(allowed_token_ids=[3, 10**6])), ValueError,
     "allowed token id 1000000 is outside the vocabulary"),
    (("a", [1, 2], SamplingParams(allowed_token_ids=list(range(10**4)))), ValueError,
     "at most .* allowed token ids"),
    (("b", [1, 2], SamplingParams(logit_bias={10**6: 1.0})), ValueError,
     "logit_bias token id 1000000 is outside the vocabulary"),
    ((1, [1, 2], SamplingParams()), TypeError, "request_id"),
    (("p", [1, 2], "greedy"), TypeError, "SamplingParams"),
])
def test_bad_input_is_rejected_and_the_engine_keeps_serving(path, args, error, message):
    e = engine(path)
    e.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))
    with pytest.raises(error, match=message):
        e.add_request(*args)
    outputs = []
    while e.has_unfinished_requests():
        outputs += e.step()
    assert outputs[-1].request_id == "dup" and len(outputs[-1].outputs[0].token_ids) == 4


def test_allowed_tokens_that_min_tokens_masks_end_the_request_with_an_error(path):
    e = engine(path)
    e.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))
    stop_first = dict(max_tokens=4, min_tokens=2, stop_token_ids=[5], temperature=0.0)
    e.add_request("only-stop", [1, 2, 3], SamplingParams(allowed_token_ids=[5], **stop_first))
    e.add_request("stop-or-9", [1, 2, 3], SamplingParams(allowed_token_ids=[5, 9], **stop_first))
    final = drain(e)
    assert final["only-stop"].outputs[0].finish_reason == "error"
    assert "allowed_token_ids" in final["only-stop"].error
    assert final["stop-or-9"].outputs[0].token_ids[:2] == [9, 9]
    assert len(final["ok"].outputs[0].token_ids) == 4


def test_truncate_prompt_tokens_keeps_the_prompts_end(path):
    e = engine(path, max_model_len=64)
    long = list(range(3, 103))  # 100 tokens: more than max_model_len
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        e.add_request("whole", long, SamplingParams(max_tokens=4))
    greedy = dict(max_tokens=4, **GREEDY)
    e.add_request("last-10", long, SamplingParams(truncate_prompt_tokens=10, **greedy))
    e.add_request("tail", long[-10:], SamplingParams(**greedy))
    e.add_request("short", long[:5], SamplingParams(truncate_prompt_tokens=10, **greedy))
    final = drain(e)
    assert final["last-10"].prompt_token_ids == long[-10:]
    assert final["last-10"].outputs[0].token_ids == final["tail"].outputs[0].token_ids
    assert final["short"].prompt_token_ids == long[:5]
    # A text prompt cut is reported as the text of the tokens kept.
    text = "Once upon a time there was a little engine that served tokens"
    e.add_request("text", text, SamplingParams(truncate_prompt_tokens=3, **greedy))
    out = drain(e)["text"]
    assert len(out.prompt_token_ids) == 3 and out.prompt_token_ids == e.tokenizer.encode(text)[-3:]
    assert out.prompt == e.tokenizer.decode(out.prompt_token_ids) and text.endswith(out.prompt)
    # -1: the last max_model_len tokens (vLLM's), which leave no room for an output.
    with pytest.raises(ValueError, match=r"the prompt \(64 tokens\) \+ max_tokens \(1\)"):
        e.add_request("most", long, SamplingParams(truncate_prompt_tokens=-1, max_tokens=1))
    e.add_request("fits", long[:20], SamplingParams(truncate_prompt_tokens=-1, max_tokens=1))
    assert drain(e)["fits"].prompt_token_ids == long[:20]


def test_a_request_larger_than_the_pool_is_rejected(path):
    e = engine(path, block_size=4, num_blocks=6)  # 20 tokens
    with pytest.raises(ValueError, match="KV blocks"):
        e.add_request("big", [1] * 12, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="KV blocks"):
        e.add_request("many", [1] * 4, SamplingParams(max_tokens=6, n=4))


def test_randomized_arrivals_aborts_and_parameters(path):
    rng = random.Random(5)
    e = engine(path, block_size=4, num_blocks=48, max_num_batched_tokens=24, max_num_seqs=6)
    live, next_id, steps = set(), 0, 0
    while next_id < 600 or e.has_unfinished_requests():
        if next_id < 600 and rng.random() < 0.4:
            params = SamplingParams(
                max_tokens=rng.randrange(1, 16), temperature=rng.choice([0.0, 0.7, 1.0]),
                top_k=rng.choice([-1, 5]), n=rng.choice([1, 1, 2]), seed=rng.randrange(100),
                repetition_penalty=rng.choice([1.0, 1.2]), ignore_eos=rng.random() < 0.5,
                logprobs=rng.choice([None, 2]))
            prompt = [1] + [rng.randrange(3, 20) for _ in range(rng.randrange(1, 40))]
            e.add_request(str(next_id), prompt, params, priority=rng.randrange(2))
            live.add(str(next_id))
            next_id += 1
        if live and rng.random() < 0.05:
            e.abort_request(rng.choice(sorted(live)))
        for out in e.step():
            if out.finished:
                live.discard(out.request_id)
                for c in out.outputs:
                    assert c.finish_reason in ("length", "stop", "abort")
        e.scheduler.check_invariants()
        steps += 1
        assert steps < 20000
    assert steps > 1000 and e.get_stats().num_preemptions > 0
    assert not live
    assert e.block_manager.num_sequences() == 0
    assert e.block_manager.num_free_blocks() == e.block_manager.num_usable_blocks()


def test_the_compat_api(path):
    engine_ = kvserve.ContinuousBatchingEngine(model=path, tokenizer=None, device="cpu",
                                               max_batch_size=16, max_seq_len=128)
    first = engine_.add_request(kvserve.GenerationRequest(prompt="Hello", max_new_tokens=12,
                                                          temperature=0.0))
    second = engine_.add_request(kvserve.GenerationRequest(prompt="World", max_new_tokens=8))
    while engine_.scheduler.has_pending_work:
        engine_.step()
    assert set(engine_.results) == {first, second}
    assert len(engine_.results[second].outputs[0].token_ids) <= 8
    expected = kvserve.LLM(path, dtype="float32").generate(
        "Hello", SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
    assert engine_.results[first].outputs[0].token_ids == expected.outputs[0].token_ids
    with pytest.raises(TypeError, match="GenerationRequest"):
        engine_.add_request("Hello")
