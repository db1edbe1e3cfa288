"""Driving an LLMEngine in tests: an fp32 engine without the start-up print, and a loop that
steps until every request finished and checks that the pool is whole afterwards."""

from __future__ import annotations

from kvserve import LLMEngine


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
