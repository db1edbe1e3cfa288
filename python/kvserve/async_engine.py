"""``AsyncLLMEngine``: one owner thread steps an LLMEngine; coroutines submit requests and stream
their outputs (vLLM's EngineCore / AsyncLLM shape).

    engine = AsyncLLMEngine("models/shakespeare-target")
    async for out in engine.generate("ROMEO:", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].delta_text, end="")

Cancelling the task that iterates generate() (or closing the generator early) aborts the request
and frees its KV blocks. Any number of event loops and threads may submit at once: tokenizing,
validating and queueing a request (and loading its LoRA adapter) run in a worker thread, so an
event loop never waits on them; bad input raises there.

Backpressure: a request's outputs go through a channel that holds at most one pending update.
A step's output merges into the unread one (deltas concatenated, the rest the latest), so a
consumer that reads slowly costs memory for the text it has not read, not a copy of its output
per step; one that leaves an update unread for more than max_stream_lag seconds is aborted.

Failures: a step that raises ends its requests with finish_reason "error" (RequestOutput.error
says why); `healthy` turns False after max_consecutive_failures failed steps in a row, while one
step has run longer than max_step_seconds (a wedged device), or when the owner thread has died,
whose requests then end with an error too.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator
from pathlib import Path

from kvserve.engine import LLMEngine, SamplingParams
from kvserve.engine_args import ASYNC_OPTIONS, AsyncEngineArgs
from kvserve.lora_serving import LoRARequest
from kvserve.outputs import CompletionOutput, RequestOutput

def merge_outputs(pending: RequestOutput, new: RequestOutput, delta: bool) -> RequestOutput:
    """One update for a consumer that has not read `pending` yet: the deltas of both, and the
    rest as of `new` (delta: text, token_ids and logprobs are deltas too)."""
    by_index = {c.index: c for c in pending.outputs}
    merged = []
    for c in new.outputs:
        old = by_index.pop(c.index, None)
        if old is None:
            merged.append(c)
            continue
        logprobs = c.logprobs
        if delta and old.logprobs is not None:
            logprobs = old.logprobs + (c.logprobs or [])
        merged.append(CompletionOutput(
            c.index, old.text + c.text if delta else c.text,
            old.token_ids + c.token_ids if delta else c.token_ids, c.finish_reason,
            old.delta_text + c.delta_text, old.new_token_ids + c.new_token_ids, logprobs))
    merged.extend(by_index.values())  # samples this step did not touch
    merged.sort(key=lambda c: c.index)
    return RequestOutput(new.request_id, new.prompt, new.prompt_token_ids, merged, new.finished,
                         new.metrics, new.num_cached_tokens, new.error or pending.error,
                         pending.prompt_logprobs or new.prompt_logprobs)


class _Channel:
    """One request's pending update. The owner thread writes it under the engine's lock; the
    event loop that awaits it is woken through `ready`, which only that loop touches."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delta: bool, n: int):
        self.loop = loop
        self.delta = delta
        self.n = n  # samples of the request
        self.ready = asyncio.Event()
        self.pending: RequestOutput | None = None
        self.since = 0.0  # time.monotonic() when `pending` appeared unread
        self.lagging = False  # aborted for falling behind


def _wake(channels: list[_Channel]) -> None:
    for channel in channels:
        channel.ready.set()


class RequestStream:
    """The outputs of one submitted request (AsyncLLMEngine.add_request): iterate it, or close it
    to abort the request."""

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, channel: _Channel):
        self.engine, self.request_id, self._channel = engine, request_id, channel
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self.engine._next_output(self.request_id, self._channel)
        except BaseException:  # cancelled: the consumer is gone
            await self.aclose()
            raise
        if out.finished:
            self.finished = True
            self.engine._forget(self.request_id)
        return out

    async def aclose(self) -> None:
        """Aborts the request if it has not finished (its blocks are freed by the next step)."""
        if not self.finished:
            self.finished = True
            self.engine._forget(self.request_id)
            self.engine.engine.abort_request(self.request_id)
            self.engine._wakeup.set()


class AsyncLLMEngine:
    """An LLMEngine served by a background thread.

    AsyncLLMEngine(model, **options): the options of kvserve.AsyncEngineArgs (EngineArgs' and
    max_stream_lag, max_consecutive_failures, max_step_seconds); or AsyncLLMEngine(engine,
    **async_options) around an LLMEngine already made; or from_engine_args(args).
    """

    def __init__(self, model: str | Path | LLMEngine, **options):
        if isinstance(model, LLMEngine):
            engine_only = set(options) - ASYNC_OPTIONS
            if engine_only:
                raise TypeError(f"AsyncLLMEngine over an LLMEngine takes only "
                                f"{sorted(ASYNC_OPTIONS)}; the engine's own options "
                                f"({', '.join(sorted(engine_only))}) were set when it was made")
            self._start(model, AsyncEngineArgs(**(vars(model.args) | options)))
        else:
            options.setdefault("log_memory_plan", False)
            args = AsyncEngineArgs(model, **options)
            self._start(LLMEngine.from_engine_args(args.engine_args()), args)

    @classmethod
    def from_engine_args(cls, args: AsyncEngineArgs) -> "AsyncLLMEngine":
        engine = cls.__new__(cls)
        engine._start(LLMEngine.from_engine_args(args.engine_args()), args)
        return engine

    def _start(self, engine: LLMEngine, args: AsyncEngineArgs) -> None:
        self.engine = engine
        self.max_stream_lag = args.max_stream_lag
        self.max_consecutive_failures = args.max_consecutive_failures
        self.max_step_seconds = args.max_step_seconds
        self._step_started: float | None = None  # time.monotonic() of the running step
        self._channels: dict[str, _Channel] = {}  # under _lock
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        if engine.kv_connector is not None:  # a finished KV load makes its request runnable
            engine.kv_connector.on_loaded = self._wakeup.set
        self._stopped = False
        self._dead = False  # the owner thread ended by an exception
        self._ids = itertools.count()
        # The last failed steps, as (time.monotonic(), "Type: message"): bounded, and holding no
        # traceback (whose frames would keep a step's tensors alive).
        self.errors: collections.deque[tuple[float, str]] = collections.deque(maxlen=32)
        self.num_failed_steps = 0
        self.num_consecutive_failures = 0
        self.num_lagging_aborts = 0  # requests aborted because their consumer fell behind
        self._thread = threading.Thread(target=self._serve, name="kvserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ clients
    async def add_request(self, prompt: str | list[int],
                          sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0,
                          lora: LoRARequest | None = None,
                          output_kind: str = "cumulative",
                          kv_transfer_params: dict | None = None) -> RequestStream:
        """Submits a request and returns the stream of its outputs. Tokenizing, validating and
        (for a LoRA adapter's first request) loading the adapter run in a worker thread. Raises
        ValueError / TypeError for bad input, kvserve.EngineOverloadedError when the engine's
        waiting queue is full, RuntimeError when the engine is shut down or has died."""
        if self._stopped or self._dead:
            raise RuntimeError("the engine is shut down" if self._stopped else
                               "the engine thread has died")
        request_id = f"async-{next(self._ids)}" if request_id is None else request_id
        channel = _Channel(asyncio.get_running_loop(), output_kind == "delta",
                           sampling_params.n if isinstance(sampling_params, SamplingParams) else 1)
        with self._lock:
            if request_id in self._channels:
                raise ValueError(f"request id '{request_id}' is already in use")
            self._channels[request_id] = channel
        withdrawn = threading.Event()

        def submit() -> None:
            self.engine.add_request(request_id, prompt, sampling_params, priority=priority,
                                    lora=lora, output_kind=output_kind,
                                    kv_transfer_params=kv_transfer_params)
            if withdrawn.is_set():  # the caller gave up while this ran: take it back
                self.engine.abort_request(request_id)

        try:
            await asyncio.to_thread(submit)
        except BaseException:
            self._forget(request_id)
            # Cancelled while the worker may still add it: whichever of the two sees the request
            # in the engine second aborts it (an abort of an unknown id is a no-op).
            withdrawn.set()
            self.engine.abort_request(request_id)
            raise
        self._wakeup.set()
        return RequestStream(self, request_id, channel)

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       lora: LoRARequest | None = None,
                       output_kind: str = "cumulative",
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs, one per update that produced text, the last with
        finished=True (updates the consumer was too slow to read apart are merged). Raises
        as add_request before yielding anything."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority, lora,
                                        output_kind, kv_transfer_params)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> bool:
        """Stops a request; its stream ends with finish_reason "abort"."""
        aborted = self.engine.abort_request(request_id)
        self._wakeup.set()
        return aborted

    @property
    def alive(self) -> bool:
        """False once the owner thread has died (or the engine was shut down): nothing will
        run any more."""
        return not self._dead and not self._stopped and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """False when the owner thread has died, the last max_consecutive_failures steps all
        failed (a step that succeeds makes it True again), or the running step has taken more
        than max_step_seconds."""
        started = self._step_started
        return (not self._dead and self._thread.is_alive() and
                self.num_consecutive_failures < self.max_consecutive_failures and
                (started is None or time.monotonic() - started <= self.max_step_seconds))

    def unhealthy_reason(self) -> str | None:
        """Why `healthy` is False (None when it is True)."""
        started = self._step_started
        if self._dead or not self._thread.is_alive():
            return "the engine thread has died" + (f" ({self.errors[-1][1]})" if self.errors
                                                   else "")
        if started is not None and time.monotonic() - started > self.max_step_seconds:
            return (f"a step has run for {time.monotonic() - started:.0f} s (max_step_seconds "
                    f"{self.max_step_seconds:g}): the device may be wedged")
        if self.num_consecutive_failures >= self.max_consecutive_failures:
            return (f"the last {self.num_consecutive_failures} steps failed: "
                    f"{self.errors[-1][1] if self.errors else 'unknown error'}")
        return None

    def get_stats(self):
        return self.engine.get_stats()

    def shutdown(self) -> None:
        """Stops the owner thread after its current step; unfinished requests are aborted;
        then the tensor-parallel ranks the engine started stop too."""
        self._stopped = True
        self._wakeup.set()
        self._thread.join()
        with self._lock:
            ids = list(self._channels)
        for request_id in ids:
            self.engine.abort_request(request_id)
        while self.engine.has_unfinished_requests():
            self._deliver(self.engine.step())
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------------ channels
    async def _next_output(self, request_id: str, channel: _Channel) -> RequestOutput:
        while True:
            await channel.ready.wait()
            with self._lock:
                out, channel.pending = channel.pending, None
            channel.ready.clear()  # only this loop sets it, in a callback: no wake-up is lost
            if out is not None:
                return out

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._channels.pop(request_id, None)

    # ------------------------------------------------------------------------------ owner thread
    def _serve(self) -> None:
        forwards = self.engine.get_stats().num_steps
        try:
            while not self._stopped:
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()  # a submit after this sees has_unfinished_requests()
                    continue
                self._step_started = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception as error:  # its requests end with an error at the next step
                    self._step_started = None
                    self.num_failed_steps += 1
                    self.num_consecutive_failures += 1
                    self.errors.append((time.monotonic(), f"{type(error).__name__}: {error}"))
                    traceback.print_exc(file=sys.stderr)
                    del error
                    continue
                self._step_started = None
                # Only a forward that ran clears the failures (a step that just reports the
                # failed requests does not show the model works again).
                stats = self.engine.get_stats()
                if stats.num_steps > forwards:
                    self.num_consecutive_failures = 0
                elif not outputs and stats.num_loading_requests:
                    # Only KV loads are in flight: wait for one to end instead of spinning.
                    self._wakeup.wait(timeout=0.05)
                    self._wakeup.clear()
                forwards = stats.num_steps
                self._deliver(outputs)
        except BaseException as error:  # the thread dies: nobody would ever answer its streams
            self._dead = True
            self.errors.append((time.monotonic(), f"{type(error).__name__}: {error}"))
            self._fail_all(f"the engine thread died: {type(error).__name__}: {error}")
            raise

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Merges a step's outputs into their channels and wakes each event loop once for the
        channels that became readable (a server's step carries hundreds of outputs)."""
        now = time.monotonic()
        wake: dict[asyncio.AbstractEventLoop, list[_Channel]] = {}
        lagging = []
        with self._lock:
            for out in outputs:
                channel = self._channels.get(out.request_id)
                if channel is None:
                    continue
                if channel.pending is None:
                    channel.pending, channel.since = out, now
                    wake.setdefault(channel.loop, []).append(channel)
                    continue
                channel.pending = merge_outputs(channel.pending, out, channel.delta)
                if (not out.finished and not channel.lagging and self.max_stream_lag > 0
                        and now - channel.since > self.max_stream_lag):
                    channel.lagging = True
                    lagging.append(out.request_id)
        for loop, channels in wake.items():
            try:
                loop.call_soon_threadsafe(_wake, channels)
            except RuntimeError:  # that event loop is closed: nobody awaits these requests
                for channel in channels:
                    lagging.append(channel.pending.request_id)
        for request_id in lagging:
            self.num_lagging_aborts += 1
            self.engine.abort_request(request_id)

    def _fail_all(self, message: str) -> None:
        """Ends every stream with an error (the owner thread is gone)."""
        with self._lock:
            channels = list(self._channels.items())
        outputs = []
        for request_id, channel in channels:
            self.engine.abort_request(request_id)
            outputs.append(RequestOutput(
                request_id, None, [],
                [CompletionOutput(i, "", [], "error") for i in range(channel.n)],
                True, None, 0, message))
        with self._lock:
            for out in outputs:
                channel = self._channels.get(out.request_id)
                if channel is not None:  # replaces whatever was unread: the stream ends now
                    channel.pending, channel.since = out, time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list[_Channel]] = {}
        for _, channel in channels:
            by_loop.setdefault(channel.loop, []).append(channel)
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(_wake, group)
            except RuntimeError:
                pass
