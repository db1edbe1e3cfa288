"""The engine under threads: 64 producers submit and abort against one serving loop (threads on
LLMEngine, and coroutines on AsyncLLMEngine). Every request that was not aborted gets exactly the
tokens it gets alone, each is reported finished once, and every block is free at the end."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from kvserve import AsyncLLMEngine, LLMEngine, SamplingParams

pytest.importorskip("transformers")

NUM_PRODUCERS = 64
PER_PRODUCER = 3


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    return checkpoint_factory("LlamaForCausalLM")


def engine(path, **kwargs) -> LLMEngine:
    kwargs.setdefault("log_memory_plan", False)
    return LLMEngine(path, dtype="float32", block_size=4, num_blocks=200,
                     max_num_batched_tokens=64, max_num_seqs=16, **kwargs)


def workload(seed: int = 0):
    """request id -> (prompt ids, SamplingParams, abort after this many seconds or None)."""
    rng = random.Random(seed)
    work = {}
    for p in range(NUM_PRODUCERS):
        for i in range(PER_PRODUCER):
            prompt = [1] + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))]
            params = SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0,
                                    ignore_eos=True, n=rng.choice([1, 1, 2]))
            abort = rng.uniform(0, 0.05) if rng.random() < 0.3 else None
            work[f"{p}-{i}"] = (prompt, params, abort)
    return work


@pytest.fixture(scope="module")
def expected(path):
    """The tokens of every request of workload() run alone."""
    e = engine(path)
    out = {}
    for request_id, (prompt, params, _) in workload().items():
        e.add_request(request_id, prompt, params)
        while e.has_unfinished_requests():
            for o in e.step():
                if o.finished:
                    out[request_id] = [c.token_ids for c in o.outputs]
    return out


def check_final(e: LLMEngine, finished: dict, expected: dict, aborted: set) -> None:
    assert set(finished) == set(expected)
    for request_id, out in finished.items():
        reasons = {c.finish_reason for c in out.outputs}
        if reasons == {"abort"} or (request_id in aborted and "abort" in reasons):
            assert request_id in aborted
            continue
        assert reasons == {"length"}, (request_id, reasons)
        assert [c.token_ids for c in out.outputs] == expected[request_id], request_id
    blocks = e.block_manager
    assert blocks.num_sequences() == 0
    assert blocks.num_free_blocks() == blocks.num_usable_blocks()
    stats = e.get_stats()
    assert stats.num_finished_requests == len(expected)
    assert stats.num_running_requests == stats.num_waiting_requests == 0


def test_threads_submit_and_abort_against_one_serving_loop(path, expected):
    e = engine(path)
    work = workload()
    finished: dict = {}
    events = {request_id: threading.Event() for request_id in work}
    aborted: set = set()
    done = threading.Event()
    reports = []

    def serve():  # the owner thread
        while not done.is_set() or e.has_unfinished_requests():
            for out in e.step():
                reports.append(out.request_id)
                if out.finished:
                    assert out.request_id not in finished, "reported finished twice"
                    finished[out.request_id] = out
                    events[out.request_id].set()

    def produce(p: int):
        for i in range(PER_PRODUCER):
            request_id = f"{p}-{i}"
            prompt, params, abort_after = work[request_id]
            e.add_request(request_id, prompt, params)
            if abort_after is not None:
                events[request_id].wait(abort_after)
                if e.abort_request(request_id):
                    aborted.add(request_id)
            assert events[request_id].wait(60), f"{request_id} never finished"

    owner = threading.Thread(target=serve)
    owner.start()
    producers = [threading.Thread(target=produce, args=(p,)) for p in range(NUM_PRODUCERS)]
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    done.set()
    owner.join()
    check_final(e, finished, expected, aborted)
    assert aborted, "the workload should abort some requests while they run"


def test_two_threads_stepping_at_once_serialize(path, expected):
    """Concurrent step() calls are prevented (they run one after the other), not undefined."""
    e = engine(path)
    work = {k: v for k, v in workload().items() if v[2] is None}
    finished: dict = {}
    lock = threading.Lock()
    for request_id, (prompt, params, _) in work.items():
        e.add_request(request_id, prompt, params)

    def stepper():
        while e.has_unfinished_requests():
            for out in e.step():
                if out.finished:
                    with lock:
                        assert out.request_id not in finished
                        finished[out.request_id] = out

    threads = [threading.Thread(target=stepper) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check_final(e, finished, {k: expected[k] for k in work}, set())


def test_async_engine_with_64_concurrent_clients_and_cancellations(path, expected):
    work = workload()
    async_engine = AsyncLLMEngine(engine(path))
    finished: dict = {}
    cancelled: set = set()

    async def client(request_id: str):
        prompt, params, abort_after = work[request_id]
        async for out in async_engine.generate(prompt, params, request_id):
            if out.finished:
                finished[request_id] = out

    async def main():
        tasks = {request_id: asyncio.create_task(client(request_id)) for request_id in work}
        for request_id, (_, _, abort_after) in work.items():
            if abort_after is not None:
                asyncio.get_running_loop().call_later(abort_after, tasks[request_id].cancel)
        for request_id, task in tasks.items():
            try:
                await asyncio.wait_for(task, 60)
            except asyncio.CancelledError:
                cancelled.add(request_id)

    asyncio.run(main())
    e = async_engine.engine
    for _ in range(1000):  # the owner thread applies the last aborts
        if not e.has_unfinished_requests():
            break
        threading.Event().wait(0.01)
    async_engine.shutdown()
    assert cancelled and not (cancelled & set(finished))
    for request_id in cancelled:
        finished[request_id] = None
    stats = e.get_stats()
    # A cancelled task's request was aborted, or had finished before the cancel took effect, or
    # was never submitted (cancelled while it waited for a submitting worker thread).
    assert 0 < stats.num_aborted_requests <= len(cancelled)
    assert (len(work) - len(cancelled) + stats.num_aborted_requests
            <= stats.num_finished_requests <= len(work))
    for request_id, out in finished.items():
        if out is not None:
            assert [c.token_ids for c in out.outputs] == expected[request_id]
    blocks = e.block_manager
    assert blocks.num_sequences() == 0 and blocks.num_free_blocks() == blocks.num_usable_blocks()


def test_async_engine_streams_deltas_and_rejects_bad_input(path):
    async_engine = AsyncLLMEngine(path, dtype="float32")

    async def main():
        outs = [o async for o in async_engine.generate("Once upon", SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True), "s")]
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in async_engine.generate([1, 2], SamplingParams(max_tokens=10**9)):
                pass
        return outs

    outs = asyncio.run(main())
    async_engine.shutdown()
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text
    assert sum(len(o.outputs[0].new_token_ids) for o in outs) == 8
