"""Aborts that land between the C++ step and LLMEngine's post-processing of it (a client that
disconnects while the owner thread matches stop strings), step failures, and the per-step
output contract: no output is lost, nothing leaks, every request ends exactly once.

The reference is the same requests run alone, without aborts (LLM.generate)."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

import kvserve
from kvserve import LLMEngine, SamplingParams

MODEL = Path(__file__).resolve().parents[2] / "models" / "shakespeare-target"
PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo!", "First Citizen:\nBefore we proceed",
           "KING HENRY:\n", "HAMLET:\nTo be"]


@pytest.fixture(scope="module")
def llm():
    return kvserve.LLM(MODEL, dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def greedy_texts(llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


# Each test runs on an engine that steps one step at a time and on one that launches each step
# before the last one's samples are in (async scheduling), whose outputs come a step later.
ASYNC_SCHEDULING = [False]


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async-scheduling"])
def async_scheduling(request):
    ASYNC_SCHEDULING[0] = request.param
    yield
    ASYNC_SCHEDULING[0] = False


def engine(**kwargs) -> LLMEngine:
    kwargs.setdefault("async_scheduling", ASYNC_SCHEDULING[0])
    return LLMEngine(MODEL, dtype="float32", max_model_len=256, num_blocks=200,
                     log_memory_plan=False, **kwargs)


def early_stop(text: str) -> str:
    """A stop string its greedy text reaches within the first few characters."""
    return text[2:4] if text[2:4].strip() else text[:3]


class AbortAfterStep:
    """The C++ engine with another thread's abort of `victim` landing right after its step
    number `at` returns: the moment a client's disconnect hits while LLMEngine post-processes
    that step."""

    def __init__(self, real, victim: str, at: int):
        self._real, self._victim, self._at, self.steps = real, victim, at, 0

    def step(self, finished_only=False):
        outputs = self._real.step(finished_only)
        self.steps += 1
        if self.steps == self._at:
            assert self._real.abort_request(self._victim)
        return outputs

    def __getattr__(self, name):
        return getattr(self._real, name)


def assert_nothing_leaked(e: LLMEngine) -> None:
    assert not e.has_unfinished_requests()
    assert not e._requests
    blocks = e.block_manager
    assert blocks.num_sequences() == 0
    assert blocks.num_free_blocks() == blocks.num_usable_blocks()


def drain(e: LLMEngine, max_steps: int = 2_000) -> dict:
    """request id -> its finished outputs (each must come exactly once)."""
    finished: dict[str, list] = {}
    for _ in range(max_steps):
        if not e.has_unfinished_requests():
            break
        for out in e.step():
            if out.finished:
                finished.setdefault(out.request_id, []).append(out)
    assert all(len(outs) == 1 for outs in finished.values()), "a request finished twice"
    return {k: v[0] for k, v in finished.items()}


def test_an_abort_between_the_step_and_a_stop_string_finish_loses_nothing(greedy_texts):
    """Two requests with stop strings; the first is aborted right after the C++ step in which
    its stop string appears returns, before LLMEngine finishes it for that string. Before the
    fix, finish_completion raised IndexError ("unknown request id") out of step(), every output
    of that step was lost, and the other request's stream never ended."""
    stops = [early_stop(greedy_texts[i]) for i in (0, 1)]

    def run(abort_at: int | None):
        e = engine()
        for i in (0, 1):
            e.add_request(str(i), PROMPTS[i], SamplingParams(
                temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stops[i]]))
        if abort_at is not None:
            e.engine = AbortAfterStep(e.engine, "0", abort_at)
        finished, steps, stopped_at = {}, 0, None
        while e.has_unfinished_requests() and steps < 200:
            steps += 1
            for out in e.step():
                if out.finished:
                    assert out.request_id not in finished, "reported finished twice"
                    finished[out.request_id] = out
                    if out.request_id == "0":
                        stopped_at = steps
        assert_nothing_leaked(e)
        return finished, stopped_at

    alone, stopped_at = run(None)
    assert alone["0"].outputs[0].finish_reason == "stop"
    finished, _ = run(stopped_at)
    assert set(finished) == {"0", "1"}
    for i in ("0", "1"):  # the victim's stop is kept: its text was complete in that step
        assert finished[i].outputs[0].finish_reason == "stop"
        assert finished[i].outputs[0].text == alone[i].outputs[0].text
        assert finished[i].outputs[0].token_ids == alone[i].outputs[0].token_ids


def test_finishing_a_request_aborted_since_the_step_is_a_no_op():
    e = engine()
    e.add_request("a", [1, 5, 9], SamplingParams(max_tokens=8, ignore_eos=True))
    e.step()
    assert e.abort_request("a")
    metrics = e.engine.finish_completion("a", 0, "stop")  # was IndexError
    assert metrics.finished_time > 0
    # The id stays in use until the abort's output is reported by the next step.
    with pytest.raises(ValueError, match="already in use"):
        e.engine.add_request("a", [1, 2], SamplingParams())
    outs = e.engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("a", "abort")]
    with pytest.raises(IndexError, match="unknown request id"):
        e.engine.finish_completion("a", 0, "stop")
    e.engine.add_request("a", [1, 2], SamplingParams(max_tokens=2))  # free again


@pytest.mark.parametrize("seed", [0, 1])
def test_random_aborts_during_stop_string_steps(greedy_texts, seed):
    """Hundreds of requests with early-matching stop strings while another thread aborts at
    random: step() never raises, each request ends exactly once, with the tokens it gets alone
    unless it was aborted, and nothing leaks."""
    rng = random.Random(seed)
    e = engine(max_num_seqs=32)
    stops = [early_stop(t) for t in greedy_texts]
    requests = {}
    for i in range(240):
        p = rng.randrange(len(PROMPTS))
        requests[str(i)] = p
        e.add_request(str(i), PROMPTS[p], SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True,
            stop=[stops[p]] if rng.random() < 0.8 else None, n=rng.choice([1, 1, 2])))
    aborted = set()
    done = threading.Event()

    def aborter():
        while not done.is_set():
            victim = str(rng.randrange(len(requests)))
            if e.abort_request(victim):
                aborted.add(victim)
            done.wait(rng.random() * 0.002)

    thread = threading.Thread(target=aborter)
    thread.start()
    try:
        finished = drain(e)
    finally:
        done.set()
        thread.join()
    assert set(finished) == set(requests)
    for request_id, out in finished.items():
        want = greedy_texts[requests[request_id]]
        for c in out.outputs:
            if c.finish_reason == "abort":
                assert request_id in aborted
                continue
            assert c.finish_reason in ("stop", "length")
            assert want.startswith(c.text), (request_id, c.text, want)
    assert_nothing_leaked(e)


def test_a_failed_step_ends_its_requests_with_an_error_and_the_engine_goes_on():
    e = engine()
    e.add_request("a", [1, 5, 9], SamplingParams(max_tokens=8, ignore_eos=True))
    e.add_request("b", [1, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    e.engine.inject_step_failures(1)
    with pytest.raises(RuntimeError, match="injected step failure"):
        e.step()
    outs = {o.request_id: o for o in e.step()}
    for request_id in ("a", "b"):
        assert outs[request_id].finished
        assert outs[request_id].outputs[0].finish_reason == "error"
        assert "injected step failure" in outs[request_id].error
    assert e.get_stats().num_failed_requests == 2
    assert_nothing_leaked(e)
    e.add_request("c", [1, 5, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    assert drain(e)["c"].outputs[0].finish_reason == "length"


def test_an_output_that_fails_to_build_fails_only_its_request(monkeypatch):
    e = engine()
    e.add_request("bad", [1, 5, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    e.add_request("good", [1, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    real = e._update_sample

    def broken(request_id, *args, **kwargs):
        if request_id == "bad":
            raise RuntimeError("boom")
        return real(request_id, *args, **kwargs)

    monkeypatch.setattr(e, "_update_sample", broken)
    finished = drain(e)
    assert finished["bad"].outputs[0].finish_reason == "error"
    assert "boom" in finished["bad"].error
    assert finished["good"].outputs[0].finish_reason == "length"
    assert len(finished["good"].outputs[0].token_ids) == 4
    assert_nothing_leaked(e)


def test_running_cpp_outputs_carry_only_new_tokens():
    e = engine()
    e.add_request("a", [1, 5, 9], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1))
    seen = []
    while e.has_unfinished_requests():
        for raw in e.engine.step():
            c = raw.outputs[0]
            seen.extend(c.new_token_ids)
            if not c.finish_reason:
                assert list(c.token_ids) == [] and list(c.logprobs) == []
            else:
                assert list(c.token_ids) == seen and len(c.logprobs) == 5


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, n=3, stop=["e "]),
], ids=["greedy-logprobs", "n3-stop"])
def test_delta_outputs_add_up_to_the_cumulative_ones(params):
    outs = {}
    for kind in ("cumulative", "delta"):
        e = engine()
        e.add_request("r", PROMPTS[1], params, output_kind=kind)
        outs[kind] = [o for _ in range(100) if e.has_unfinished_requests() for o in e.step()]
    final = outs["cumulative"][-1]
    for c in final.outputs:
        parts = [d for o in outs["delta"] for d in o.outputs if d.index == c.index]
        assert "".join(d.text for d in parts) == c.text
        assert "".join(d.delta_text for d in parts) == c.text
        assert [t for d in parts for t in d.token_ids] == c.token_ids
        if c.logprobs is not None:
            got = [lp.token_id for d in parts for lp in d.logprobs]
            assert got == [lp.token_id for lp in c.logprobs]
    with pytest.raises(ValueError, match="output_kind"):
        engine().add_request("x", "a", output_kind="whole")


def test_lora_users_are_released_whatever_ends_the_request(tmp_path, greedy_texts):
    """Requests on an adapter finish by stop strings, by length, by aborts landing before and
    after the step: the adapter has no user left afterwards (else its slot could never be
    reused)."""
    from tests.models.test_lora import make_adapter

    make_adapter(MODEL, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["q_proj"])
    lora = kvserve.LoRARequest("a", tmp_path / "adapter")
    e = engine(enable_lora=True, max_loras=1, max_lora_rank=2)
    stops = [early_stop(t) for t in greedy_texts]
    for i in range(24):
        p = i % len(PROMPTS)
        e.add_request(str(i), PROMPTS[p], SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stops[p]] if i % 2 else None),
            lora=lora)
    e.engine = AbortAfterStep(e.engine, "1", at=2)
    e.abort_request("0")
    drain(e)
    assert e.lora_manager._loaded["a"].users == 0
    assert_nothing_leaked(e)
