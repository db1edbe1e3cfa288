"""Driving an LLMEngine in tests: an fp32 engine without the start-up print, a loop that steps
until every request finished and checks that the pool is whole afterwards, one that adds
requests at their arrival steps, and the request mixes the invariance tests feed it."""

from __future__ import annotations

import random
import time

from kvserve import LLMEngine, SamplingParams


def fp32_engine(path, **kwargs) -> LLMEngine:
    kwargs.setdefault("log_memory_plan", False)
    return LLMEngine(path, dtype="float32", **kwargs)


def drain(e: LLMEngine, max_steps: int = 10_000) -> dict:
    """Steps until nothing is unfinished (at most max_steps); the final output of each request by
    id. Fails if a request made no progress or a block was not given back."""
    final = {}
    for _ in range(max_steps):
        if not e.has_unfinished_requests():
            break
        for out in e.step():
            if out.finished:
                final[out.request_id] = out
    assert not e.has_unfinished_requests(), "a request made no progress"
    blocks = e.block_manager
    assert blocks.num_sequences() == 0 and blocks.num_free_blocks() == blocks.num_usable_blocks()
    return final


def run_arrivals(e: LLMEngine, requests, params: SamplingParams | None = None) -> dict[str, list[int]]:
    """Adds each (prompt ids, max_tokens, arrival step) request at its step (greedy unless
    `params` is given); the token ids per request id. Checks the scheduler's invariants every
    step and that the pool is whole afterwards."""
    pending = sorted((arrival, i, prompt, n) for i, (prompt, n, arrival) in enumerate(requests))
    results, step = {}, 0
    while pending or e.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i, prompt, n = pending.pop(0)
            e.add_request(str(i), prompt, params or SamplingParams(
                temperature=0.0, max_tokens=n, ignore_eos=True))
        for out in e.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        e.scheduler.check_invariants()
        step += 1
    blocks = e.block_manager
    assert blocks.num_free_blocks() == blocks.num_usable_blocks() and blocks.num_sequences() == 0
    return results


def mixed_requests(count: int, seed: int = 0, max_prompt: int = 60, max_tokens: int = 24,
                   max_arrival: int = 20) -> list[tuple[list[int], int, int]]:
    """(prompt ids, max_tokens, arrival step) of `count` requests of mixed lengths, their ids
    below 381 (any test vocabulary)."""
    rng = random.Random(seed)
    return [([1] + [rng.randrange(3, 381) for _ in range(rng.randrange(1, max_prompt))],
             rng.randrange(1, max_tokens), rng.randrange(0, max_arrival)) for _ in range(count)]


def shared_prefix_requests() -> tuple[list[int], list[tuple[list[int], int, int]]]:
    """A 41-token system prompt, and 12 requests (as mixed_requests') that start with it."""
    system = [1] + list(range(100, 140))
    return system, [(system + [200 + i] * (i % 5 + 1), 8, i % 3) for i in range(12)]


def wait_idle(async_engine, timeout: float = 20.0) -> None:
    """Until the LLMEngine that `async_engine` (an AsyncLLMEngine) steps has no request left,
    in C++ or in Python, and every block is free; fails after `timeout` seconds."""
    e = async_engine.engine
    deadline = time.monotonic() + timeout
    blocks = e.block_manager
    while e.has_unfinished_requests() or e._requests or (
            blocks.num_free_blocks() != blocks.num_usable_blocks()):
        assert time.monotonic() < deadline, "requests or blocks were not freed"
        time.sleep(0.02)
