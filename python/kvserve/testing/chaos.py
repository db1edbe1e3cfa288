"""Clients that misbehave, for the server's chaos tests and `bench_serve.py --chaos`: a stream
whose reader never reads (a tiny kernel receive buffer, never drained), a server-sent-events
reader, and the resident memory of a process."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process now (Linux: /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def stalled_stream(port: int, body: dict, path: str = "/v1/completions",
                   headers: dict[str, str] | None = None) -> socket.socket:
    """Sends a POST of `body` to 127.0.0.1:port and never reads the answer: its receive buffer
    is as small as the kernel allows, so the server's writes block after a few KiB. Close the
    returned socket to disconnect."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: sets the window
    s.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(payload)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
    return s


async def sse_events(response) -> AsyncIterator[str]:
    """The `data:` payloads of a streamed httpx response, "[DONE]" included."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]
