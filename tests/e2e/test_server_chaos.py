"""The HTTP server under hostile traffic, each mix bounded in time: a disconnect storm with stop
strings that match early (every stream kept to the end equals its non-streamed twin, nothing runs
afterwards), readers that stop reading (aborted after max_stream_lag, memory bounded, the others
served), a flood past the waiting bound (429s with Retry-After, no 500, no hang), oversized and
malformed bodies amid real traffic, and injected step failures (500s and error events, /health
503, and recovery once the fault clears). Each on one rank, stepping synchronously or with async
scheduling, and on two ranks with async scheduling."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvserve.async_engine import AsyncLLMEngine  # noqa: E402
from kvserve.server import ServerState  # noqa: E402
from kvserve.server.limits import ServerLimits  # noqa: E402
from kvserve.server.serve import BackgroundServer  # noqa: E402
from kvserve.testing.chaos import rss_bytes, sse_events, stalled_stream  # noqa: E402
from tests.engine_loop import wait_idle  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "models" / "shakespeare-target"
NAME = "shakespeare"
PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo!", "First Citizen:\nBefore we proceed",
           "KING HENRY:\n", "HAMLET:\nTo be", "MERCUTIO:\n"]


# Every attack runs on an engine stepping one step at a time, on one that launches each step
# before the last one's samples are in (async scheduling), and on a model split over two ranks
# (the engine's process and the worker it spawns) with async scheduling.
ENGINE_OPTIONS = [{}]


@pytest.fixture(scope="module", autouse=True, params=[
    {}, {"async_scheduling": True},
    {"async_scheduling": True, "tensor_parallel_size": 2, "distributed_timeout": 60.0}],
    ids=["sync", "async-scheduling", "tp2-async-scheduling"])
def engine_options(request):
    ENGINE_OPTIONS[0] = request.param
    yield
    ENGINE_OPTIONS[0] = {}


def serve(**engine_kwargs):
    engine_kwargs = dict(dtype="float32", max_model_len=1024, num_blocks=400,
                         max_stream_lag=1.0, max_consecutive_failures=2,
                         **ENGINE_OPTIONS[0]) | engine_kwargs
    engine = AsyncLLMEngine(MODEL, **engine_kwargs)
    state = ServerState(NAME, limits=ServerLimits(max_body_bytes=64 << 10))
    state.ready(engine, None)
    return engine, BackgroundServer(state, send_buffer_bytes=8192)


# An engine per test: a process holds one tensor-parallel engine at a time (torch.distributed's
# one default group), and some attacks need an engine of their own.
@pytest.fixture
def roomy(engine_options):
    engine, server = serve(max_num_seqs=16, max_waiting_requests=256)
    with server:
        yield engine, server
    engine.shutdown()


def body(prompt, **extra):
    return {"model": NAME, "prompt": prompt, "temperature": 0, "max_tokens": 32,
            "ignore_eos": True, **extra}


def test_a_disconnect_storm_with_early_stop_strings_loses_no_kept_stream(roomy):
    engine, server = roomy
    with httpx.Client(base_url=server.url, timeout=30) as client:
        free = [client.post("/v1/completions", json=body(p)).json()["choices"][0]["text"]
                for p in PROMPTS]
    stops = [t[2:4] if t[2:4].strip() else t[:3] for t in free]
    rng = random.Random(0)
    jobs = [(i % len(PROMPTS), rng.random() < 0.5, rng.randrange(0, 4)) for i in range(48)]

    async def twin(client, p):
        r = await client.post("/v1/completions", json=body(PROMPTS[p], stop=[stops[p]]))
        return r.json()["choices"][0]["text"]

    async def stream(client, p, leave, after):
        text = ""
        async with client.stream("POST", "/v1/completions",
                                 json=body(PROMPTS[p], stop=[stops[p]], stream=True)) as r:
            assert r.status_code == 200
            async for event in sse_events(r):
                if leave and after == 0:
                    return None  # disconnects mid-stream (or before its first token)
                after -= 1
                if event != "[DONE]":
                    text += json.loads(event)["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            twins = await asyncio.gather(*(twin(client, p) for p in range(len(PROMPTS))))
            texts = await asyncio.wait_for(asyncio.gather(
                *(stream(client, *job) for job in jobs)), 60)
        return twins, texts

    twins, texts = asyncio.run(main())
    for (p, leave, _), text in zip(jobs, texts):
        if not leave or text is not None:
            assert text == twins[p]
    wait_idle(engine)


def test_readers_that_stop_reading_are_aborted_and_the_others_served(roomy):
    engine, server = roomy
    wait_idle(engine)
    aborts = engine.num_lagging_aborts
    request = body(PROMPTS[0], max_tokens=900, logprobs=5, stream=True)
    before = rss_bytes()
    stalled = [stalled_stream(server.port, request) for _ in range(6)]
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for p in PROMPTS:  # served while the stalled streams hold their connections
                r = client.post("/v1/completions", json=body(p, max_tokens=8))
                assert r.status_code == 200
        deadline = time.monotonic() + 40
        while engine.num_lagging_aborts < aborts + len(stalled):
            assert time.monotonic() < deadline, "stalled readers were not aborted"
            time.sleep(0.05)
        wait_idle(engine)
        # Each stalled stream's unread text is at most a few KiB past its socket buffers.
        assert rss_bytes() - before < 64 << 20
    finally:
        for s in stalled:
            s.close()


def test_a_flood_past_the_waiting_bound_gets_429s_and_nothing_hangs():
    engine, server = serve(max_num_seqs=2, max_waiting_requests=4)
    statuses = []

    async def one(client, i):
        r = await client.post("/v1/completions", json=body(PROMPTS[i % 6], max_tokens=16))
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), 60)

    with server:
        asyncio.run(main())
        assert statuses.count(429) > 0 and statuses.count(200) >= 4  # at least the bound
        assert set(statuses) <= {200, 429}
        wait_idle(engine)
        assert httpx.get(server.url + "/health").status_code == 200
    engine.shutdown()


def test_junk_bodies_amid_real_traffic(roomy):
    engine, server = roomy
    junk = [b"{not json", b"\xff\xfe\x00", b'{"prompt": "\\ud800", "model": "shakespeare"}',
            b"x" * (65 << 10), json.dumps(body("a", n=2**65)).encode(),
            json.dumps(body(["a"] * 500)).encode()]

    async def bad(client, content):
        r = await client.post("/v1/completions", content=content,
                              headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500 and "error" in r.json()
        return r.status_code

    async def good(client, p):
        r = await client.post("/v1/completions", json=body(PROMPTS[p], max_tokens=8))
        assert r.status_code == 200
        return r.status_code

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            return await asyncio.wait_for(asyncio.gather(
                *(bad(client, junk[i % len(junk)]) for i in range(30)),
                *(good(client, i % 6) for i in range(12))), 60)

    statuses = asyncio.run(main())
    assert 413 in statuses and 400 in statuses
    wait_idle(engine)


def test_injected_step_failures_are_errors_and_health_recovers(roomy):
    engine, server = roomy
    wait_idle(engine)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        engine.engine.engine.inject_step_failures(2)
        r = client.post("/v1/completions", json=body(PROMPTS[0]))
        error = r.json()["error"]
        assert r.status_code == 500 and error["type"] == "internal_error"
        assert "injected step failure" in error["message"]
        with client.stream("POST", "/v1/completions",
                           json=body(PROMPTS[1], stream=True)) as r:
            events = [e for e in sse_lines(r)]
        assert events[-1] == "[DONE]"
        assert "injected step failure" in json.loads(events[-2])["error"]["message"]
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "error"
        health = client.get("/health")
        assert health.status_code == 503 and "injected" in health.json()["reason"]
        # Requests are still taken: the fault has cleared, so the next one succeeds and the
        # engine reports itself healthy again.
        r = client.post("/v1/completions", json=body(PROMPTS[2]))
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert client.get("/health").status_code == 200
    wait_idle(engine)


def sse_lines(response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_a_queued_stream_that_leaves_before_its_first_token_is_never_prefilled():
    engine, server = serve(max_num_seqs=1, max_waiting_requests=8, max_stream_lag=60.0)

    def until(condition, what):
        deadline = time.monotonic() + 10
        while not condition(engine.get_stats()):
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    with server:
        busy = stalled_stream(server.port, body(PROMPTS[0], max_tokens=900, stream=True))
        until(lambda s: s.num_running_requests == 1, "the first stream did not start")
        queued = stalled_stream(server.port, body(PROMPTS[1], max_tokens=8, stream=True))
        until(lambda s: s.num_waiting_requests == 1, "the second stream did not queue")
        queued.close()  # before its first token: it only waited
        until(lambda s: s.num_waiting_requests == 0, "the waiting request was not aborted")
        stats = engine.get_stats()
        assert stats.num_aborted_requests == 1 and stats.num_running_requests == 1
        busy.close()  # aborts it, unless its 900 tokens were done by now (a fast machine)
        wait_idle(engine)
        # Only the stream that ran had its prompt prefilled; both ended, nothing else ran.
        stats = engine.get_stats()
        assert stats.prefix_cache_queries == len(engine.engine.tokenizer.encode(PROMPTS[0]))
        assert stats.num_finished_requests == 2 and stats.num_aborted_requests in (1, 2)
    engine.shutdown()
