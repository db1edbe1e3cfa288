"""Property-based bad input (hypothesis): any SamplingParams and add_request arguments either run
to completion or raise ValueError / TypeError at the boundary, and the engine keeps serving."""

from __future__ import annotations

import math

import pytest

from kvserve import LLMEngine, SamplingParams
from tests.engine_loop import drain

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("transformers")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MAX_MODEL_LEN = 48
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])

extreme_ints = st.one_of(st.integers(-3, 40), st.sampled_from(
    [-2**63, -2**31, 2**31 - 1, 2**31, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]))
extreme_floats = st.one_of(st.floats(-5, 5), st.sampled_from(
    [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 1e-30, 1e-6, 1e300, -1e300, 2.0000001]))
texts = st.text(st.characters(codec="utf-8"), max_size=6)

sampling_kwargs = st.fixed_dictionaries({}, optional={
    "n": extreme_ints, "temperature": extreme_floats, "top_k": extreme_ints,
    "top_p": extreme_floats, "min_p": extreme_floats, "repetition_penalty": extreme_floats,
    "presence_penalty": extreme_floats, "frequency_penalty": extreme_floats,
    "seed": st.one_of(st.none(), extreme_ints), "max_tokens": extreme_ints,
    "min_tokens": extreme_ints, "ignore_eos": st.booleans(),
    "stop": st.one_of(st.none(), texts, st.lists(texts, max_size=4)),
    "stop_token_ids": st.one_of(st.none(), st.lists(extreme_ints, max_size=6),
                                st.just(list(range(5000)))),
    "include_stop_str_in_output": st.booleans(),
    "logprobs": st.one_of(st.none(), extreme_ints),
    "logit_bias": st.one_of(st.none(), st.dictionaries(extreme_ints, extreme_floats, max_size=4),
                            st.just({i: 100.0 for i in range(5000)})),
    "allowed_token_ids": st.one_of(st.none(), st.lists(extreme_ints, max_size=4),
                                   st.just(list(range(5000)))),
    "truncate_prompt_tokens": st.one_of(st.none(), extreme_ints),
    "bad_words": st.one_of(st.none(), st.lists(texts, max_size=4), st.just(["w"] * 200)),
})

prompts = st.one_of(
    st.lists(st.integers(0, 300), min_size=0, max_size=60),
    st.lists(extreme_ints, min_size=1, max_size=4),
    st.just([1] * 100_000),
    texts,
    st.text(max_size=200),
    st.sampled_from([None, 3, 2.5, [1.0, 2.0], [True, False], b"bytes", [[1, 2]]]),
)


# An engine stepping one step at a time, and one launching each step before the last one's
# samples are in (async scheduling).
@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def served(request, checkpoint_factory):
    e = LLMEngine(checkpoint_factory("LlamaForCausalLM"), dtype="float32",
                  max_model_len=MAX_MODEL_LEN, block_size=4, num_blocks=64,
                  log_memory_plan=False, async_scheduling=request.param)
    yield e
    # Still serving after everything the fuzzers threw at it.
    e.add_request("final", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0,
                                                     ignore_eos=True))
    outs = drain(e, max_steps=2000)
    assert outs["final"].outputs[0].finish_reason == "length"


counter = iter(range(10**9))


@FUZZ
@given(kwargs=sampling_kwargs, prompt=prompts,
       arrival=st.one_of(st.none(), extreme_floats), priority=extreme_ints)
def test_any_request_runs_or_raises_cleanly(served, kwargs, prompt, arrival, priority):
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as error:
        event(f"SamplingParams raised {type(error).__name__}")
        params = SamplingParams(max_tokens=3)
    request_id = f"fuzz-{next(counter)}"
    try:
        served.add_request(request_id, prompt, params, arrival_time=arrival, priority=priority)
    except (ValueError, TypeError) as error:
        event(f"add_request raised {type(error).__name__}")
        assert not served.has_unfinished_requests()
        return
    out = drain(served, max_steps=2000)[request_id]
    event(f"ran: {sorted({c.finish_reason for c in out.outputs})}")
    assert out.finished and len(out.outputs) == params.n
    for c in out.outputs:
        assert c.finish_reason in ("length", "stop", "error")
        assert len(c.token_ids) <= params.max_tokens
        assert all(0 <= t < served.config.vocab_size for t in c.token_ids)
        if c.finish_reason == "error":
            assert out.error


@FUZZ
@given(request_id=st.one_of(texts, st.integers(), st.none(), st.just("x" * 10_000)),
       params=st.one_of(st.none(), st.just("greedy"), st.just(SamplingParams(max_tokens=2))))
def test_request_ids_and_params_types(served, request_id, params):
    try:
        served.add_request(request_id, [1, 2], params)
    except (ValueError, TypeError):
        return
    out = drain(served, max_steps=2000)[request_id]
    assert out.finished
