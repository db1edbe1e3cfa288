"""KV pages between two engines over torch.distributed: the producer hosts a TCPStore where
consumers rendezvous; each consumer that connects forms two Gloo groups of two ranks with it
(producer rank 0): a control group that carries a pull's request (the producer's side waits
there while the pair is idle) and a data group that carries the answer and the pages, bounded
by the transfer timeout. A message carries the pages of as many blocks as fit MESSAGE_BYTES,
layer after layer: every tensor of the pool (each layer's key and value, or latent, and the scales
of an int8/fp8 pool) in turn, as bytes. A dead peer fails the pending
send/recv (Gloo sees the connection close) instead of hanging.

Gloo moves CPU tensors: a pool on a GPU is staged through host memory (NCCL groups between the
GPUs of the two engines are the next step: docs/scaling-out.md)."""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

MESSAGE_BYTES = 8 << 20  # the pages of as many blocks as fit go in one message
MAX_MESSAGE_BYTES = 1 << 20  # a control message longer than this is refused


class KVTransferError(RuntimeError):
    """A transfer failed: the producer refused it, or the connection broke."""


def kv_tensors(kv_cache) -> list[torch.Tensor]:
    """The pool's tensors, each indexed by block id on dim 0, each once: every layer's key and
    value (one tensor for a latent layer; grouped layers share slots) and an int8/fp8 pool's
    scales. Two engines with the same layout list them in the same order."""
    out, seen = [], set()
    for t in itertools.chain(kv_cache.key_caches, kv_cache.value_caches, kv_cache.key_scales,
                             kv_cache.value_scales):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t)
    return out


def state_tensors(kv_cache) -> list[torch.Tensor]:
    """A model with state-space layers: every layer's conv and SSM states, each indexed by
    state slot on dim 0 (none without a state pool)."""
    if not kv_cache.layout.has_state():
        return []
    return list(kv_cache.conv_states) + list(kv_cache.ssm_states)


def layout_fingerprint(kv_cache) -> list:
    """What must agree between producer and consumer for pages to mean the same: the block
    size and every pool tensor's per-block shape and dtype, and the states' per-slot ones."""
    pages = [[list(t.shape[1:]), str(t.dtype)] for t in kv_tensors(kv_cache)]
    states = [["state", list(t.shape[1:]), str(t.dtype)] for t in state_tensors(kv_cache)]
    return [kv_cache.block_size] + pages + states


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()


class Group:
    """One Gloo group of two ranks: send/recv of tensors and of JSON messages."""

    def __init__(self, store, prefix: str, rank: int, timeout: datetime.timedelta):
        self.peer = 1 - rank
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, timeout)

    def send(self, tensor: torch.Tensor) -> None:
        self.group.send([tensor.contiguous()], self.peer, 0).wait()

    def recv(self, tensor: torch.Tensor) -> None:
        self.group.recv([tensor], self.peer, 0).wait()

    def send_json(self, obj) -> None:
        data = json.dumps(obj).encode()
        self.send(torch.tensor([len(data)], dtype=torch.int64))
        self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def recv_json(self):
        size = torch.zeros(1, dtype=torch.int64)
        self.recv(size)
        if not 0 < size.item() <= MAX_MESSAGE_BYTES:
            raise KVTransferError(f"a control message of {size.item()} bytes")
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.recv(data)
        return json.loads(bytes(data.numpy()))


class Channel:
    """One consumer-producer pair: a control group whose receives wait as long as the pair is
    idle (the producer's side waits there for the next pull; a closed connection ends the wait),
    and a data group whose every operation is bounded by the transfer timeout."""

    IDLE = datetime.timedelta(days=365)

    def __init__(self, store, index: int, rank: int, timeout: float):
        self.control = Group(store, f"kvserve/pg/{index}/control", rank, self.IDLE)
        self.data = Group(store, f"kvserve/pg/{index}/data", rank,
                          datetime.timedelta(seconds=timeout))

    def send_pages(self, tensors: list[torch.Tensor], ids: torch.Tensor) -> None:
        if not tensors:  # a model without attention layers: blocks of no bytes
            return
        device = tensors[0].device
        for chunk in ids.split(blocks_per_message(tensors)):
            chunk = chunk.to(device)
            # A pool on a GPU is staged through host memory (Gloo moves CPU tensors).
            self.data.send(torch.cat([t.index_select(0, chunk).view(torch.uint8).reshape(-1)
                                      for t in tensors]).cpu())

    def recv_pages(self, tensors: list[torch.Tensor], ids: torch.Tensor) -> None:
        if not tensors:
            return
        device = tensors[0].device
        for chunk in ids.split(blocks_per_message(tensors)):
            sizes = [len(chunk) * block_bytes(t) for t in tensors]
            message = torch.empty(sum(sizes), dtype=torch.uint8)
            self.data.recv(message)
            message, chunk = message.to(device), chunk.to(device)
            for t, part in zip(tensors, message.split(sizes)):
                if part.storage_offset() % t.element_size():  # a view needs aligned elements
                    part = part.clone()
                t.index_copy_(0, chunk, part.view(t.dtype).view(len(chunk), *t.shape[1:]))
        if device.type == "cuda":  # written before the engine is told the KV is there
            torch.cuda.current_stream(device).synchronize()


def block_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


def blocks_per_message(tensors: list[torch.Tensor]) -> int:
    """Blocks whose pages (every tensor's) fit one message of MESSAGE_BYTES."""
    return max(1, MESSAGE_BYTES // sum(block_bytes(t) for t in tensors))


class KVTransferServer:
    """The producer's end: accepts consumers on host:port (port 0: any free one) and answers
    each pull with `serve(channel, request)`, one connection thread per consumer."""

    def __init__(self, host: str, port: int, timeout: float,
                 serve: Callable[[Channel, dict], None]):
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        self.port = self.store.port
        self.timeout, self.serve = timeout, serve
        self.closed = threading.Event()
        self.accepter = threading.Thread(target=self._accept, name="kvserve-kv-accept",
                                         daemon=True)
        self.accepter.start()

    def _accept(self) -> None:
        # Connections are rare: the store is polled (a blocking wait would log each timeout).
        for index in itertools.count(1):
            key = f"kvserve/conn/{index}"
            while not self.store.check([key]):
                if self.closed.wait(0.05):
                    return
            threading.Thread(target=self._connection, args=(index,),
                             name=f"kvserve-kv-conn-{index}", daemon=True).start()

    def _connection(self, index: int) -> None:
        with torch.inference_mode():
            try:
                channel = Channel(self.store, index, 0, self.timeout)
                while not self.closed.is_set():
                    self.serve(channel, channel.control.recv_json())
            except (RuntimeError, dist.DistError, ValueError):
                return  # the consumer went away: its next pull connects again

    def close(self) -> None:
        self.closed.set()


class KVTransferClient:
    """The consumer's connection to one producer; pulls run one at a time on it."""

    def __init__(self, host: str, port: int, timeout: float):
        self.store = dist.TCPStore(host, port, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        self.index = self.store.add("kvserve/connections", 1)
        self.store.set(f"kvserve/conn/{self.index}", "1")
        self.channel = Channel(self.store, self.index, 1, timeout)

    def pull(self, request: dict, tensors: list[torch.Tensor], ids: torch.Tensor,
             states: list[torch.Tensor] = (), slot: int = -1) -> dict:
        """Asks for `request`'s pages and writes them into blocks `ids` of `tensors` (and, with
        `states`, the producer's state into slot `slot` of them); returns the producer's reply.
        Raises KVTransferError when the producer refuses, RuntimeError / DistError when the
        connection breaks."""
        self.channel.control.send_json(request)
        reply = self.channel.data.recv_json()
        if not reply.get("ok"):
            raise KVTransferError(reply.get("error", "the producer refused the transfer"))
        if reply["num_blocks"] != len(ids):
            raise KVTransferError(f"the producer sends {reply['num_blocks']} blocks, this engine "
                                  f"allocated {len(ids)}")
        self.channel.recv_pages(tensors, ids)
        self.channel.recv_pages(list(states), torch.tensor([slot], dtype=torch.int64))
        return reply
