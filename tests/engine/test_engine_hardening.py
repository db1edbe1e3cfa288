"""Inputs that used to hang, crash or misreport the engine: overflowing limits, logits with no
distribution, stop-string metrics, and stats that grew with every request. Each case failed before
its fix; the engine must keep serving the other requests afterwards."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLMEngine, SamplingParams
from tests.engine_loop import drain
from tests.engine_loop import fp32_engine as engine

pytest.importorskip("transformers")

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    return checkpoint_factory("LlamaForCausalLM")


def serves_a_normal_request(e: LLMEngine) -> None:
    e.add_request("after", [1, 5, 6], SamplingParams(max_tokens=3, **GREEDY))
    out = drain(e)["after"]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=2**63 - 1), "exceeds max_model_len"),
    (dict(max_tokens=2**62), "exceeds max_model_len"),
    (dict(max_tokens=8, n=1024), "KV blocks"),
])
def test_limits_are_compared_without_overflow(path, kwargs, message):
    """prompt + max_tokens overflowed int64 and passed the checks; the request then never
    progressed (and n = 2**62 made step() loop forever)."""
    e = engine(path, num_blocks=64)
    with pytest.raises(ValueError, match=message):
        e.add_request("huge", [1, 2, 3], SamplingParams(**kwargs))
    serves_a_normal_request(e)


def test_every_token_masked_is_a_per_request_error(path):
    """min_tokens with every id a stop id leaves no token: the sampling kernel read past its sort
    order (top_p < 1) and crashed the process. Now that request ends with an error and the one
    batched with it is untouched."""
    e = engine(path)
    vocab = e.config.vocab_size
    e.add_request("masked", [1, 2, 3], SamplingParams(min_tokens=1, stop_token_ids=list(range(vocab)),
                                                      top_p=0.5, max_tokens=4, seed=0))
    e.add_request("fine", [1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))
    final = drain(e)
    masked = final["masked"]
    assert masked.outputs[0].finish_reason == "error" and masked.outputs[0].token_ids == []
    assert "masked" in masked.error and "min_tokens" in masked.error
    assert final["fine"].outputs[0].finish_reason == "length"
    assert final["fine"].error is None
    stats = e.get_stats()
    assert stats.num_failed_requests == 1 and stats.num_finished_requests == 2


@pytest.fixture(scope="module")
def nan_path(path, tmp_path_factory):
    """The checkpoint with a NaN final-norm weight: every logit is NaN."""
    out = tmp_path_factory.mktemp("nan") / "model"
    shutil.copytree(path, out)
    weights = load_file(out / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=4, **GREEDY),
                                    SamplingParams(max_tokens=4, temperature=0.8, top_k=5,
                                                   top_p=0.9, seed=1, logprobs=2),
                                    SamplingParams(max_tokens=4, n=3, seed=2)])
def test_nan_logits_end_the_request_with_an_error(nan_path, params):
    """A NaN row silently sampled token 0 (greedy or not)."""
    e = engine(nan_path)
    e.add_request("nan", [1, 2, 3], params)
    out = drain(e)["nan"]
    assert [c.finish_reason for c in out.outputs] == ["error"] * params.n
    assert all(c.token_ids == [] for c in out.outputs)
    assert "NaN" in out.error
    assert e.get_stats().num_failed_requests == 1


@pytest.mark.parametrize("temperature", [1e-30, 1e-6, 1e300])
def test_extreme_temperatures_sample_valid_tokens(path, temperature):
    """1e-30 overflowed x / t to inf (NaN after the max is subtracted); 1e300 became an fp32 inf
    (-inf / inf = NaN). Below 1e-5 the request samples greedily, as in vLLM."""
    e = engine(path)
    e.add_request("t", [1, 2, 3], SamplingParams(max_tokens=6, temperature=temperature, seed=0,
                                                 top_p=0.9, ignore_eos=True))
    e.add_request("g", [1, 2, 3], SamplingParams(max_tokens=6, **GREEDY))
    final = drain(e)
    tokens = final["t"].outputs[0].token_ids
    assert final["t"].outputs[0].finish_reason == "length" and len(tokens) == 6
    if temperature < 1e-5:
        assert tokens == final["g"].outputs[0].token_ids


def check_metrics(m, started: float, ended: float, num_tokens: int) -> None:
    assert started <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time <= m.last_token_time <= m.finished_time <= ended
    assert m.num_generated_tokens == num_tokens
    assert 0 < m.time_to_first_token <= m.e2e_latency <= ended - started
    assert m.queue_time >= 0
    if num_tokens > 1:
        assert 0 < m.time_per_output_token * (num_tokens - 1) <= m.e2e_latency


def test_metrics_are_ordered_for_every_finish_reason(path):
    """A request ended by a stop string reported finished_time 0 (a negative e2e latency)."""
    e = engine(path)
    free = drain_one(e, "probe", SamplingParams(max_tokens=12, **GREEDY))
    text = e.tokenizer.decode(free.outputs[0].token_ids)
    stop_token = free.outputs[0].token_ids[5]
    started = time.monotonic()
    e.add_request("length", [1, 2, 3], SamplingParams(max_tokens=5, **GREEDY))
    e.add_request("stop_token", [1, 2, 3], SamplingParams(max_tokens=12, stop_token_ids=[stop_token],
                                                          **GREEDY))
    e.add_request("stop_string", [1, 2, 3], SamplingParams(max_tokens=12, stop=[text[-3:]],
                                                           **GREEDY))
    e.add_request("abort", [1, 2, 3], SamplingParams(max_tokens=200, **GREEDY))
    final, steps = {}, 0
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        if steps == 3:
            e.abort_request("abort")
    ended = time.monotonic()
    reasons = {k: v.outputs[0].finish_reason for k, v in final.items()}
    assert reasons == {"length": "length", "stop_token": "stop", "stop_string": "stop",
                       "abort": "abort"}
    for out in final.values():
        check_metrics(out.metrics, started, ended, len(out.outputs[0].token_ids))


def drain_one(e: LLMEngine, request_id: str, params: SamplingParams):
    e.add_request(request_id, [1, 2, 3], params)
    return drain(e)[request_id]


def test_get_stats_is_counters_and_histograms(path):
    """get_stats() copied every finished request's metrics (unbounded), and a reused request id
    counted once."""
    e = engine(path)
    for _ in range(3):  # the same id, three times
        drain_one(e, "same", SamplingParams(max_tokens=3, **GREEDY))
    drain_one(e, "one", SamplingParams(max_tokens=1, **GREEDY))
    stats = e.get_stats()
    assert not hasattr(stats, "finished_metrics")
    assert stats.num_finished_requests == 4 and stats.num_generated_tokens == 10
    assert stats.num_running_requests == stats.num_waiting_requests == 0
    assert stats.e2e_latency.count == 4 and stats.time_to_first_token.count == 4
    assert stats.time_per_output_token.count == 3  # the one-token request has no TPOT
    for h in (stats.e2e_latency, stats.time_to_first_token, stats.time_per_output_token):
        assert sum(h.counts) == h.count and len(h.counts) == len(h.bounds) + 1 and h.sum > 0


def test_gauges_count_running_and_waiting_requests(path):
    e = engine(path, max_num_seqs=2)
    for i in range(5):
        e.add_request(str(i), [1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))
    assert e.get_stats().num_waiting_requests == 5
    e.step()
    stats = e.get_stats()
    assert stats.num_running_requests == 2 and stats.num_waiting_requests == 3
    assert stats.num_running_sequences == 2 and 0 < stats.kv_cache_usage < 1
    drain(e)


@pytest.mark.parametrize("arrival", [float("nan"), float("inf"), -float("inf"), 1e300])
def test_arrival_time_must_be_a_past_monotonic_time(path, arrival):
    e = engine(path)
    with pytest.raises(ValueError, match="arrival_time"):
        e.add_request("a", [1, 2], SamplingParams(), arrival_time=arrival)
    serves_a_normal_request(e)


def test_logprobs_are_bounded_by_max_logprobs(path):
    e = engine(path, max_logprobs=5)
    with pytest.raises(ValueError, match="logprobs must be at most 5"):
        e.add_request("a", [1, 2], SamplingParams(logprobs=6))
    out = drain_one(e, "b", SamplingParams(max_tokens=2, logprobs=5, **GREEDY))
    assert [len(lp.top) for lp in out.outputs[0].logprobs] == [5, 5]
