"""AsyncLLMEngine under slow consumers and failures: a stream holds one pending update that later
steps merge into (the text read equals LLM.generate's), a consumer that falls more than
max_stream_lag behind is aborted and its blocks freed, a failed step ends its streams with an
error and turns `healthy` off after max_consecutive_failures in a row, and a dead owner thread
ends every stream instead of leaving it waiting."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import kvserve
from kvserve import AsyncLLMEngine, SamplingParams
from kvserve.async_engine import merge_outputs
from kvserve.outputs import CompletionOutput, RequestOutput
from tests.engine_loop import wait_idle

MODEL = Path(__file__).resolve().parents[2] / "models" / "shakespeare-target"
PROMPT = "JULIET:\nO Romeo, Romeo!"
LONG = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, logprobs=1)


def async_engine(**kwargs) -> AsyncLLMEngine:
    return AsyncLLMEngine(MODEL, dtype="float32", max_model_len=256, num_blocks=64, **kwargs)


@pytest.fixture(scope="module")
def reference():
    out = kvserve.LLM(MODEL, dtype="float32", max_model_len=256).generate(
        [PROMPT], LONG, use_tqdm=False)[0].outputs[0]
    return out


@pytest.mark.parametrize("kind", ["delta", "cumulative"])
def test_a_slow_reader_gets_merged_updates_that_add_up(reference, kind):
    e = async_engine()

    async def main():
        outs = []
        async for out in e.generate(PROMPT, LONG, "slow", output_kind=kind):
            outs.append(out)
            if len(outs) == 1:  # the engine runs to the end meanwhile
                channel = e._channels["slow"]
                while not (channel.pending and channel.pending.finished):
                    await asyncio.sleep(0.01)
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        e.shutdown()
    assert len(outs) == 2  # every later step's update merged into one while it waited
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    text = "".join(o.outputs[0].delta_text for o in outs)
    ids = [t for o in outs for t in o.outputs[0].new_token_ids]
    assert text == reference.text and ids == reference.token_ids
    last = outs[-1].outputs[0]
    if kind == "delta":
        assert "".join(o.outputs[0].text for o in outs) == reference.text
        logprobs = [lp for o in outs for lp in o.outputs[0].logprobs]
    else:
        assert last.text == reference.text and last.token_ids == reference.token_ids
        logprobs = last.logprobs
    assert [lp.token_id for lp in logprobs] == reference.token_ids


def test_a_reader_that_falls_too_far_behind_is_aborted():
    e = async_engine(max_stream_lag=0.02)  # well under the 200 tokens' time, even unloaded

    async def main():
        outs = []
        async for out in e.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True),
                                    "stuck", output_kind="delta"):
            outs.append(out)
            if len(outs) == 1:
                await asyncio.sleep(3.0)
        return outs

    try:
        outs = asyncio.run(main())
        assert outs[-1].outputs[0].finish_reason == "abort"
        assert e.num_lagging_aborts == 1
        wait_idle(e)
    finally:
        e.shutdown()


def test_failed_steps_end_their_streams_with_an_error_and_health_recovers():
    e = async_engine(max_consecutive_failures=2)

    async def one(request_id):
        return [o async for o in e.generate(PROMPT, SamplingParams(max_tokens=30), request_id)]

    try:
        e.engine.engine.inject_step_failures(2)
        outs = asyncio.run(one("a"))
        assert outs[-1].outputs[0].finish_reason == "error"
        assert "injected step failure" in outs[-1].error
        outs = asyncio.run(one("b"))
        assert outs[-1].outputs[0].finish_reason == "error"
        assert not e.healthy and e.num_consecutive_failures == 2
        assert len(e.errors) == 2 and "injected" in e.errors[-1][1]
        outs = asyncio.run(one("c"))  # the fault cleared: a step succeeds
        assert outs[-1].outputs[0].finish_reason == "length"
        assert e.healthy and e.num_failed_steps == 2
        wait_idle(e)
    finally:
        e.shutdown()


def test_the_error_log_is_bounded():
    e = async_engine()
    try:
        e.engine.engine.inject_step_failures(100)

        async def many():
            for i in range(40):
                async for _ in e.generate([1, 5], SamplingParams(max_tokens=2), f"r{i}"):
                    pass

        asyncio.run(many())
        assert e.num_failed_steps == 40 and len(e.errors) == e.errors.maxlen < 40
    finally:
        e.engine.engine.inject_step_failures(0)
        e.shutdown()


class Fatal(BaseException):
    pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_ends_every_stream():
    e = async_engine()

    def die(*args, **kwargs):
        raise Fatal("the owner thread is gone")

    e.engine.step = die

    async def main():
        outs = [o async for o in e.generate(PROMPT, SamplingParams(max_tokens=30, n=2), "x")]
        with pytest.raises(RuntimeError, match="died"):
            await e.add_request(PROMPT)
        return outs

    outs = asyncio.run(main())
    assert [c.finish_reason for c in outs[-1].outputs] == ["error", "error"]
    assert "the engine thread died" in outs[-1].error and not e.healthy
    e._thread.join()


def test_merging_keeps_deltas_whole():
    def out(text, ids, finish=None, kind_delta=True):
        c = CompletionOutput(0, text, ids, finish, text, ids, None)
        return RequestOutput("r", None, [1], [c], finish is not None)

    merged = merge_outputs(out("ab", [1, 2]), out("c", [3], "stop"), delta=True)
    c = merged.outputs[0]
    assert (c.text, c.token_ids, c.delta_text, c.new_token_ids, c.finish_reason) == (
        "abc", [1, 2, 3], "abc", [1, 2, 3], "stop") and merged.finished
    cumulative = merge_outputs(
        RequestOutput("r", None, [1], [CompletionOutput(0, "ab", [1, 2], None, "b", [2])], False),
        RequestOutput("r", None, [1], [CompletionOutput(0, "abc", [1, 2, 3], None, "c", [3])],
                      False), delta=False)
    c = cumulative.outputs[0]
    assert (c.text, c.token_ids, c.delta_text, c.new_token_ids) == ("abc", [1, 2, 3], "bc", [2, 3])


def test_a_step_that_never_ends_makes_the_engine_unhealthy():
    """A wedged device: the step does not return; /health must say so."""
    import threading

    e = async_engine(max_step_seconds=0.2)
    release = threading.Event()
    real = e.engine.step

    def stuck(*args, **kwargs):
        release.wait(10)
        return real(*args, **kwargs)

    e.engine.step = stuck

    async def main():
        stream = await e.add_request(PROMPT, SamplingParams(max_tokens=4), "w")
        deadline = time.monotonic() + 5
        while e.healthy:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert "wedged" in e.unhealthy_reason()
        release.set()
        return [o async for o in stream]

    try:
        outs = asyncio.run(main())
        assert outs[-1].outputs[0].finish_reason == "length"
        assert e.healthy and e.unhealthy_reason() is None
    finally:
        release.set()
        e.shutdown()
