"""The KVConnector: how an engine takes part in disaggregated serving (vLLM's interface, reduced
to what a pull-based transport needs).

Scheduler side, called by LLMEngine:
- check_request: can this engine serve the request's kv_transfer_params (its role, n = 1, ...);
- request_finished: a producer's request ended; its blocks stay held (the C++ engine keeps them
  out of the pool) until a consumer pulls them or `timeout` passes; returns the parameters the
  consumer needs, for the response;
- start_load: a consumer's request was admitted and its blocks allocated (those its prefix
  cache already holds excluded); the pull fills the others.
Worker side, on the connector's threads: the producer serves pulls (save is a no-op: the pages
stay where the forward wrote them); the consumer pulls page by page and layer by layer while the
engine keeps stepping the other requests, then tells the engine the prompt is computed
(finish_kv_load: the request decodes at its next step, its first token the producer's) or that
the pull failed (fail_kv_load: the request ends with an error and its blocks are freed).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve import _C
from kvserve.kv_transfer.params import KVTransferParams
from kvserve.kv_transfer.transport import (Channel, KVTransferClient, KVTransferError,
                                           KVTransferServer, kv_tensors, layout_fingerprint,
                                           prompt_digest, state_tensors)

KV_ROLES = ("producer", "consumer", "both")
MAX_PRODUCERS = 16  # producers a consumer pulls from at once, each on a thread of its own
LANE_IDLE = 60.0  # seconds a producer's pull thread (and its connection) outlives its last pull


class KVConnector(ABC):
    """What the engine asks of a transport (see the module docstring)."""

    @abstractmethod
    def check_request(self, params: KVTransferParams, sampling) -> None:
        """Raises ValueError when this engine cannot serve the request's part."""

    @abstractmethod
    def request_finished(self, request_id: str, prompt_token_ids: list[int],
                         token_ids: list[int], logprobs: list) -> dict | None:
        """A producer's request finished with `token_ids` (and their _C.TokenLogprobs when it
        asked); the parameters for its consumer, or None when nothing is held."""

    @abstractmethod
    def start_load(self, load) -> None:
        """A consumer's request has its blocks (`load`: _C.KVLoad); pulls them asynchronously."""

    @abstractmethod
    def close(self) -> None:
        """Stops serving and pulling; what is held is released."""


@dataclass
class _Hold:
    prompt_digest: str
    first_token: int
    first_logprobs: dict | None
    block_tables: list[list[int]]
    num_tokens: int
    deadline: float
    state_slot: int = -1


@dataclass
class _Load:
    params: KVTransferParams
    prompt_digest: str


class TorchDistributedConnector(KVConnector):
    """Pages over torch.distributed (transport.py). engine: the C++ ContinuousBatchingEngine.
    role: "producer", "consumer" or "both". host/port: where this producer accepts pulls (port
    0: a free one) and what its answers name (advertise_host, default host). timeout: seconds a
    held request waits to be pulled, and the bound on one transfer. on_loaded: called after a
    pull ends (the async engine's wake-up)."""

    def __init__(self, engine, role: str, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 30.0, advertise_host: str | None = None,
                 on_loaded: Callable[[], None] | None = None):
        if role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {role!r}")
        if not timeout > 0:
            raise ValueError(f"kv_transfer_timeout must be > 0 seconds, got {timeout!r}")
        self.engine, self.role, self.timeout = engine, role, float(timeout)
        self.engine_id = f"kvserve-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tensors = kv_tensors(engine.kv_cache)
        # A model with state-space layers moves each request's state (its slot) after its pages.
        self.states = state_tensors(engine.kv_cache)
        self.layout = layout_fingerprint(engine.kv_cache)
        windows = list(engine.kv_cache.layout.group_windows()) or [0]
        self.windows = windows
        self.on_loaded = on_loaded or (lambda: None)
        self.lock = threading.Lock()
        self.holds: dict[str, _Hold] = {}
        self.loads: dict[str, _Load] = {}
        self.num_pulled = self.num_expired = self.num_loaded = self.num_failed = 0
        self.num_loaded_tokens = 0
        self.transfer_seconds = 0.0  # the successful pulls', summed
        self.closed = threading.Event()
        self.server = None
        if role in ("producer", "both"):
            self.server = KVTransferServer(host, port, self.timeout, self._serve_pull)
            self.host = advertise_host or host
            threading.Thread(target=self._expire, name="kvserve-kv-expire", daemon=True).start()
        if role in ("consumer", "both"):
            # One lane (a queue and its thread) per producer pulled from: a producer that is
            # slow or unreachable delays only the pulls that name it.
            self.lanes: dict[tuple[str, int], queue.Queue] = {}

    @property
    def port(self) -> int | None:
        return self.server.port if self.server is not None else None

    # ------------------------------------------------------------------------------ scheduler
    def check_request(self, params: KVTransferParams, sampling) -> None:
        if params.do_remote_decode and self.server is None:
            raise ValueError("kv_transfer_params.do_remote_decode: this engine is not a KV "
                             "producer (start it with kv_role 'producer')")
        if params.do_remote_prefill and self.role == "producer":
            raise ValueError("kv_transfer_params.do_remote_prefill: this engine is not a KV "
                             "consumer (start it with kv_role 'consumer')")
        if (params.do_remote_decode or params.do_remote_prefill) and sampling.n != 1:
            raise ValueError(f"a disaggregated request takes n = 1, got n = {sampling.n}")
        if params.do_remote_decode and self.states and sampling.max_tokens != 1:
            raise ValueError("kv_transfer_params.do_remote_decode on a model with state-space "
                             "layers takes max_tokens = 1: the state sent is the one at the "
                             f"prompt's end, got max_tokens = {sampling.max_tokens}")
        if params.do_remote_prefill and sampling.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs needs the prompt computed here: not with "
                             "kv_transfer_params.do_remote_prefill")

    def register_load(self, request_id: str, params: KVTransferParams,
                      prompt_token_ids: list[int]) -> None:
        """A consumer request about to be added: what start_load will pull for it."""
        with self.lock:
            self.loads[request_id] = _Load(params, prompt_digest(prompt_token_ids))

    def forget_load(self, request_id: str) -> None:
        with self.lock:
            self.loads.pop(request_id, None)

    def request_finished(self, request_id: str, prompt_token_ids: list[int],
                         token_ids: list[int], logprobs: list) -> dict | None:
        held = self.engine.held_kv(request_id)
        if held is None or not token_ids:
            return None
        first = logprobs[0] if logprobs else None
        hold = _Hold(prompt_digest(prompt_token_ids), int(token_ids[0]),
                     None if first is None else {"logprob": first.logprob, "rank": first.rank,
                                                 "top": [list(t) for t in first.top]},
                     [list(t) for t in held.block_tables], held.num_tokens,
                     time.monotonic() + self.timeout, held.state_slot)
        with self.lock:
            self.holds[request_id] = hold
        return KVTransferParams(do_remote_prefill=True, remote_engine_id=self.engine_id,
                                remote_request_id=request_id, remote_host=self.host,
                                remote_port=self.port,
                                remote_block_ids=hold.block_tables[0]).to_dict()

    def start_load(self, load) -> None:
        with self.lock:
            info = self.loads.pop(load.request_id, None)
            if info is not None:
                key = (info.params.remote_host, info.params.remote_port)
                lane = self.lanes.get(key)
                if lane is None and len(self.lanes) < MAX_PRODUCERS:
                    lane = self.lanes[key] = queue.Queue()
                    threading.Thread(target=self._lane, args=(key, lane), daemon=True,
                                     name=f"kvserve-kv-pull-{key[0]}:{key[1]}").start()
                if lane is not None:
                    lane.put((load, info))
                    return
        self.num_failed += 1
        self.engine.fail_kv_load(load.load_id, "aborted before its KV was pulled" if info is None
                                 else f"this engine pulls from {MAX_PRODUCERS} producers at "
                                 "once already")
        self.on_loaded()

    # ------------------------------------------------------------------------------ producer
    def _serve_pull(self, channel: Channel, request: dict) -> None:
        request_id = str(request.get("request_id"))
        with self.lock:
            hold = self.holds.pop(request_id, None)
        try:
            ids = self._source_blocks(request, hold)
        except ValueError as e:
            channel.data.send_json({"ok": False, "error": str(e)})
            if hold is not None:
                self._release(request_id)
            return
        channel.data.send_json({"ok": True, "first_token": hold.first_token,
                           "first_logprobs": hold.first_logprobs, "num_blocks": len(ids)})
        try:
            channel.send_pages(self.tensors, ids)
            channel.send_pages(self.states, torch.tensor([hold.state_slot], dtype=torch.int64))
            self.num_pulled += 1
        finally:
            self._release(request_id)

    def _source_blocks(self, request: dict, hold: _Hold | None) -> torch.Tensor:
        """The producer's blocks a pull asks for; ValueError saying why it cannot be served."""
        if request.get("engine_id") not in (None, self.engine_id):
            raise ValueError(f"the pull names engine {request.get('engine_id')}, this is "
                             f"{self.engine_id} (restarted since the prefill?)")
        if hold is None:
            raise ValueError(f"no KV is held for request {request.get('request_id')!r} (never "
                             f"prefilled here, already pulled, or freed after its "
                             f"{self.timeout:g} s timeout)")
        if request.get("prompt_digest") != hold.prompt_digest:
            raise ValueError("the consumer's prompt tokens differ from the prefilled ones "
                             "(different tokenizers or chat templates?)")
        if request.get("layout") != self.layout:
            raise ValueError(f"KV layouts differ: the producer's {self.layout}, the consumer's "
                             f"{request.get('layout')} (the same model, dtype, kv_cache_dtype "
                             f"and block_size are needed on both)")
        ranges = request.get("ranges")
        if not isinstance(ranges, list) or len(ranges) != len(hold.block_tables):
            raise ValueError("the pull's block ranges do not match the producer's groups")
        ids = []
        for (first, end), table in zip(ranges, hold.block_tables):
            if not 0 <= first <= end <= len(table):
                raise ValueError(f"blocks [{first}, {end}) are outside the held table")
            if 0 in table[first:end]:
                raise ValueError("the pull asks for blocks that left the sliding window")
            ids += table[first:end]
        return torch.tensor(ids, dtype=torch.int64)

    def _release(self, request_id: str) -> None:
        self.engine.release_kv(request_id)

    def _expire(self) -> None:
        while not self.closed.wait(min(1.0, self.timeout / 4)):
            now = time.monotonic()
            with self.lock:
                expired = [r for r, h in self.holds.items() if h.deadline <= now]
                for r in expired:
                    del self.holds[r]
            for r in expired:
                self.num_expired += 1
                self._release(r)

    # ------------------------------------------------------------------------------ consumer
    def _lane(self, key: tuple[str, int], lane: "queue.Queue") -> None:
        """Pulls from one producer, one at a time on one connection; ends after LANE_IDLE
        seconds without work."""
        client = None
        with torch.inference_mode():
            while not self.closed.is_set():
                try:
                    load, info = lane.get(timeout=LANE_IDLE)
                except queue.Empty:
                    with self.lock:
                        if lane.empty():
                            del self.lanes[key]
                            return
                    continue
                try:
                    client = self._pull(load, info, client)
                except Exception as e:  # noqa: BLE001 - a bug here must not strand the request
                    client = None
                    self.engine.fail_kv_load(load.load_id, f"KV load failed: {e!r}")
                self.on_loaded()

    def _pull(self, load, info: _Load, client: KVTransferClient | None):
        """One pull; the connection to keep using (None after a broken one)."""
        p = info.params
        started = time.monotonic()
        try:
            ranges, ids = self._destination_blocks(load)
            request = {"request_id": p.remote_request_id, "engine_id": p.remote_engine_id,
                       "prompt_digest": info.prompt_digest, "layout": self.layout,
                       "ranges": ranges}
            if client is None:
                client = KVTransferClient(p.remote_host, p.remote_port, self.timeout)
            reply = client.pull(request, self.tensors, ids, self.states, load.state_slot)
            first_token = int(reply["first_token"])
            logprobs = _logprobs(first_token, reply.get("first_logprobs"))
        except Exception as e:  # noqa: BLE001 - any failure ends this request, not the engine
            self.num_failed += 1
            self.engine.fail_kv_load(load.load_id, f"KV transfer from "
                                     f"{p.remote_host}:{p.remote_port} failed: {e}")
            return client if isinstance(e, KVTransferError) else None
        self.num_loaded += 1
        self.num_loaded_tokens += load.num_prompt_tokens - load.num_cached_tokens
        self.transfer_seconds += time.monotonic() - started
        self.engine.finish_kv_load(load.load_id, first_token, logprobs)
        return client

    def _destination_blocks(self, load) -> tuple[list, torch.Tensor]:
        """Per group, the block range to pull: from the prefix-cache hit (the consumer's own
        blocks stay) or, in a sliding-window group, from the window the first decode reads."""
        n, size = load.num_prompt_tokens, self.engine.kv_cache.block_size
        ranges, ids = [], []
        for table, window in zip(load.block_tables, self.windows):
            start = load.num_cached_tokens
            if window:
                start = max(start, n - window + 1, 0)
            first, end = start // size, -(-n // size)
            ranges.append([first, end])
            ids += table[first:end]
        return ranges, torch.tensor(ids, dtype=torch.int64)

    def close(self) -> None:
        self.closed.set()
        if self.server is not None:
            self.server.close()
            with self.lock:
                held, self.holds = list(self.holds), {}
            for r in held:
                self._release(r)


def _logprobs(token: int, entry: dict | None):
    """The producer's logprobs of the first token as the engine takes them."""
    if entry is None:
        return None
    out = _C.TokenLogprobs()
    out.token_id, out.logprob, out.rank = token, float(entry["logprob"]), int(entry["rank"])
    out.top = [(int(t), float(lp)) for t, lp in entry["top"]]
    return out

