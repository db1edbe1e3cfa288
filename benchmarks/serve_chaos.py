"""The hostile mixes of `bench_serve.py --chaos`, each run beside the same clean load of streaming
requests against one `kvserve serve` process, so that the table shows what each mix costs the
well-behaved clients: their requests/s, output tokens/s and p99 latency, and the server's peak
resident memory.

    clean          the clean load alone
    disconnects    as many extra streams with stop strings that match early, half of them
                   dropped by their client at a random chunk (before the first token included)
    slow-readers   streams whose clients never read (tiny receive buffers; 8 samples with 20
                   logprobs each, megabytes past the kernel's buffers), held all along
    flood          three times the load again as short requests, fired at once past the
                   server's waiting bound (429s expected)
    junk           malformed, non-UTF-8, oversized and out-of-range bodies amid the load
    step-failures  an injected engine-step failure mid-load (the requests of that step end with
                   an error event), then the clean load again: the row counts that second wave

Checks: every clean stream that was not failed by an injected fault has LLM.generate's text;
no 5xx but the injected ones; the hostile requests get 4xx or their own answer; the server is
idle (no request, no KV block) and healthy after every mix.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

import httpx

from kvserve.testing.chaos import rss_bytes, sse_events, stalled_stream

MIXES = ["clean", "disconnects", "slow-readers", "flood", "junk", "step-failures"]


class PeakRSS:
    """Samples a process's resident memory every 20 ms while in a `with` block."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()

    def __enter__(self) -> "PeakRSS":
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            self._stop.wait(0.02)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def clean_stream(http, name, prompt, max_tokens) -> dict:
    body = dict(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                ignore_eos=True, stream=True)
    started, text, finish, error, tokens = time.perf_counter(), "", None, None, 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return dict(status=r.status_code)
        async for event in sse_events(r):
            if event == "[DONE]":
                break
            chunk = json.loads(event)
            if "error" in chunk:
                error = chunk["error"]["message"]
                continue
            for choice in chunk["choices"]:
                text += choice["text"]
                tokens += 1
                finish = choice["finish_reason"] or finish
    return dict(status=200, text=text, finish=finish, error=error, tokens=tokens,
                seconds=time.perf_counter() - started, end=time.perf_counter())


async def dropped_stream(http, name, prompt, stop, drop_at) -> int:
    body = dict(model=name, prompt=prompt, max_tokens=48, temperature=0, stop=[stop],
                stream=True)
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code
        seen = 0
        async for _ in sse_events(r):
            if drop_at is not None and seen >= drop_at:
                break
            seen += 1
    return 200


async def short_request(http, name, prompt) -> tuple[int, float]:
    started = time.perf_counter()
    r = await http.post("/v1/completions", json=dict(model=name, prompt=prompt, max_tokens=4))
    return r.status_code, time.perf_counter() - started


async def junk_request(http, content: bytes) -> tuple[int, float]:
    started = time.perf_counter()
    try:
        r = await http.post("/v1/completions", content=content,
                            headers={"content-type": "application/json"})
    except httpx.TransportError:  # an oversized body: the server answered 413 from its header
        return 413, time.perf_counter() - started  # and closed before the client sent it all
    return r.status_code, time.perf_counter() - started


def junk_bodies(name: str) -> list[bytes]:
    return [b"{not json", b"\xff\xfe\x00garbage", b'{"model": "x", "prompt": "\\ud800"}',
            b"z" * (17 << 20), json.dumps(dict(model=name, prompt="a", n=2**70)).encode(),
            json.dumps(dict(model=name, prompt=["a"] * 1000)).encode(),
            json.dumps(dict(model=name, prompt="a", stop=["s"] * 1000)).encode(),
            json.dumps(dict(model=name, prompt="a", seed=-1)).encode()]


async def run_mix(mix: str, url: str, port: int, name: str, requests, rng) -> dict:
    """Runs the clean load with `mix` beside it; the clean results and the hostile side's."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    hostile: list = []
    stalled = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        started = time.perf_counter()
        clean = [asyncio.ensure_future(clean_stream(http, name, p, n)) for p, n in requests]
        if mix == "disconnects":
            hostile = [dropped_stream(http, name, p, p[-3:-1] or "e",
                                      rng.randrange(0, 6) if rng.random() < 0.5 else None)
                       for p, _ in requests]
        elif mix == "slow-readers":
            body = dict(model=name, prompt=requests[0][0], max_tokens=900, logprobs=20, n=8,
                        temperature=0, ignore_eos=True, stream=True)
            stalled = [stalled_stream(port, body) for _ in range(max(4, len(requests) // 10))]
        elif mix == "flood":
            await asyncio.sleep(0.5)  # the clean load is in; the flood comes on top
            hostile = [short_request(http, name, p) for p, _ in requests * 3]
        elif mix == "junk":
            bodies = junk_bodies(name)
            hostile = [junk_request(http, bodies[i % len(bodies)]) for i in range(len(requests))]
        elif mix == "step-failures":
            await asyncio.sleep(0.5)
            await http.post("/fault/step_failures", json={"count": 1})
        hostile_results = await asyncio.gather(*hostile)
        clean_results = await asyncio.gather(*clean)
        if stalled:  # held until the server gives up on them (max_stream_lag), 60 s at most
            deadline = time.monotonic() + 60
            while (time.monotonic() < deadline
                   and _running((await http.get("/metrics")).text) > 0):
                await asyncio.sleep(0.2)
        if mix == "step-failures":  # the failed wave, then the same load again on the recovered
            failed_wave = clean_results
            started = time.perf_counter()
            clean_results = await asyncio.gather(*(clean_stream(http, name, p, n)
                                                   for p, n in requests))
            hostile_results = [(500, 0.0) for r in failed_wave if r.get("error")]
        for s in stalled:
            s.close()
        return dict(clean=clean_results, hostile=hostile_results, started=started,
                    stalled=len(stalled))


def _running(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("kvserve:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def summarize(mix: str, result: dict, offline_texts: list[str], peak_rss: int) -> tuple:
    """(table row, checks) of one mix."""
    clean, started = result["clean"], result["started"]
    done = [r for r in clean if r.get("status") == 200 and r["error"] is None]
    injected = [r for r in clean if r.get("status") == 200 and r["error"] is not None]
    wrong = sum(1 for r, want in zip(clean, offline_texts)
                if r.get("status") == 200 and r["error"] is None and r["text"] != want)
    unexpected = [r.get("status") for r in clean if r.get("status") != 200]
    seconds = max((r["end"] for r in done), default=time.perf_counter()) - started
    latency = statistics.quantiles([r["seconds"] for r in done], n=100)[98] if len(done) > 1 \
        else float("nan")
    hostile = result["hostile"]
    statuses = [h if isinstance(h, int) else h[0] for h in hostile]
    reject_seconds = [h[1] for h in hostile if not isinstance(h, int) and 400 <= h[0] < 500]
    # The step-failures mix lists the first wave's streams that the injected fault ended.
    hostile_5xx = 0 if mix == "step-failures" else sum(1 for s in statuses if s >= 500)
    row = [mix, f"{len(done)}/{len(clean)}", f"{len(done) / seconds:.1f}",
           f"{sum(r['tokens'] for r in done) / seconds:.0f}", f"{latency * 1e3:.0f}",
           f"{peak_rss / 2**20:.0f}",
           f"{len(hostile) + result['stalled']}",
           f"{sum(1 for s in statuses if 400 <= s < 500)}",
           f"{max(reject_seconds) * 1e3:.0f}" if reject_seconds else "-"]
    checks = dict(wrong_text=wrong, clean_not_200=len(unexpected), hostile_5xx=hostile_5xx,
                  clean_failed=len(injected),
                  failed_by_injection=len(hostile) if mix == "step-failures" else 0)
    return row, checks


HEADERS = ["mix", "clean streams done", "requests/s", "output tokens/s", "p99 latency ms",
           "server peak RSS MiB", "hostile requests", "4xx", "slowest 4xx ms"]
