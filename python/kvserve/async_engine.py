"""``AsyncLLMEngine``: one owner thread steps an LLMEngine; coroutines submit requests and stream
their outputs (vLLM's EngineCore / AsyncLLM shape).

    engine = AsyncLLMEngine("models/shakespeare-target")
    async for out in engine.generate("ROMEO:", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].delta_text, end="")

Cancelling the task that iterates generate() (or closing the generator early) aborts the request
and frees its KV blocks. Any number of event loops and threads may submit at once: the C++
engine validates a request in the caller's thread (bad input raises there) and queues it for the
owner thread's next step.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from kvserve.engine import LLMEngine, SamplingParams
from kvserve.lora_serving import LoRARequest
from kvserve.outputs import RequestOutput


@dataclass
class _Stream:
    """Where one request's outputs go: a queue owned by the event loop that awaits them."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


class AsyncLLMEngine:
    """An LLMEngine served by a background thread.

    Args: model (a checkpoint directory) or an LLMEngine, and LLMEngine's keyword arguments.
    """

    def __init__(self, model: str | Path | LLMEngine, **engine_kwargs):
        if isinstance(model, LLMEngine):
            self.engine = model
        else:
            engine_kwargs.setdefault("log_memory_plan", False)
            self.engine = LLMEngine(model, **engine_kwargs)
        self._streams: dict[str, _Stream] = {}  # under _lock
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopped = False
        self._ids = itertools.count()
        self.errors: list[BaseException] = []  # steps that raised (their requests were aborted)
        self._thread = threading.Thread(target=self._serve, name="kvserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ clients
    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       lora: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs, one per step that produced text, the last with
        finished=True. Raises ValueError / TypeError for bad input before yielding anything.
        lora: the LoRA adapter it runs with (an engine made with enable_lora); its first use
        loads it, which waits for the running step."""
        if self._stopped:
            raise RuntimeError("the engine is shut down")
        request_id = f"async-{next(self._ids)}" if request_id is None else request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id '{request_id}' is already in use")
            self._streams[request_id] = stream
        finished = False
        try:
            self.engine.add_request(request_id, prompt, sampling_params, priority=priority,
                                    lora=lora)
            self._wakeup.set()
            while not finished:
                out = await stream.queue.get()
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:  # cancelled, closed early, or add_request raised
                self.engine.abort_request(request_id)
                self._wakeup.set()

    async def abort(self, request_id: str) -> bool:
        """Stops a request; its stream ends with finish_reason "abort"."""
        aborted = self.engine.abort_request(request_id)
        self._wakeup.set()
        return aborted

    def get_stats(self):
        return self.engine.get_stats()

    def shutdown(self) -> None:
        """Stops the owner thread after its current step; unfinished requests are aborted."""
        self._stopped = True
        self._wakeup.set()
        self._thread.join()
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self.engine.abort_request(request_id)
        while self.engine.has_unfinished_requests():
            self._deliver(self.engine.step())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------------ owner thread
    def _serve(self) -> None:
        while not self._stopped:
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()  # a submit after this sees has_unfinished_requests() true
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # the step's requests were aborted; keep serving
                self.errors.append(error)
                traceback.print_exc(file=sys.stderr)
                continue
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands a step's outputs to their event loops: one wake-up per loop per step, not per
        output (a server's step carries hundreds)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody awaits these requests
                for _, out in items:
                    self.engine.abort_request(out.request_id)
