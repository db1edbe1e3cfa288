"""`python -m kvserve serve`: the HTTP server on uvicorn. The port opens at once and answers 503
while the model loads in a background thread."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time
from pathlib import Path

from kvserve.engine_args import AsyncEngineArgs
from kvserve.server.app import ServerState, build_app
from kvserve.server.chat_template import ChatTemplate
from kvserve.server.limits import DEFAULT_MAX_WAITING_REQUESTS, ServerLimits


def load_into(state: ServerState, args: AsyncEngineArgs, chat_template: str | Path | None) -> None:
    """Loads the engine and the chat template, then marks the server ready; a failure is kept in
    state.load_error (the server then answers 503 saying why)."""
    from kvserve.async_engine import AsyncLLMEngine

    try:
        template = ChatTemplate.from_model_dir(args.model, chat_template)
        engine = AsyncLLMEngine.from_engine_args(args)
        state.ready(engine, template)
        if engine.engine.default_sampling:  # as vLLM warns: requests may sample otherwise
            print(f"kvserve serve: {engine.engine.default_sampling_note()}", file=sys.stderr)
    except BaseException as e:  # reported on every request instead
        state.load_error = e
        print(f"kvserve serve: the model failed to load: {e}", file=sys.stderr)


def server_engine_args(model: str | Path | AsyncEngineArgs, **options) -> AsyncEngineArgs:
    """The engine options of a server: those given, and max_waiting_requests
    DEFAULT_MAX_WAITING_REQUESTS unless given (a server bounds its queue; LLM.generate does
    not)."""
    if isinstance(model, AsyncEngineArgs):
        return dataclasses.replace(model, **options)
    options.setdefault("max_waiting_requests", DEFAULT_MAX_WAITING_REQUESTS)
    options.setdefault("log_memory_plan", False)
    return AsyncEngineArgs(model, **options)


def lora_requests(modules: dict[str, str | Path]) -> dict:
    """{name: LoRARequest} for the adapters a server offers, each checked to be a PEFT adapter."""
    from kvserve.lora_serving import LoRARequest

    out = {}
    for name, path in modules.items():
        if not (Path(path) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"LoRA module {name}: {path} has no adapter_config.json")
        out[name] = LoRARequest(name, Path(path))
    return out


def serve(model: str | Path | AsyncEngineArgs, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, served_model_name: str | None = None,
          chat_template: str | Path | None = None, log_level: str = "info",
          lora_modules: dict[str, str | Path] | None = None, limits: ServerLimits | None = None,
          enable_docs: bool = False, **engine_options) -> None:
    """Serves until interrupted; the engine shuts down (aborting what runs) on exit.
    model: a checkpoint directory (with AsyncEngineArgs' options as engine_options, see
    server_engine_args) or an AsyncEngineArgs. lora_modules: {name: PEFT adapter directory},
    served as models of their own name (LoRA on, adapters loaded at first use). limits: what one
    HTTP request may cost (ServerLimits); enable_docs: serve /docs and /openapi.json (behind the
    API key). Raises ValueError for a bad option, FileNotFoundError for an adapter directory
    without adapter_config.json or a chat template file that does not exist."""
    import uvicorn

    args = server_engine_args(model, **engine_options)
    if chat_template is not None:  # a mistyped path fails now, not after the model loads
        ChatTemplate.from_model_dir(args.model, chat_template)
    state = ServerState(served_model_name or str(args.model), api_key,
                        lora_modules=lora_requests(lora_modules or {}),
                        limits=limits or ServerLimits(), enable_docs=enable_docs,
                        fault_injection=os.environ.get("KVSERVE_FAULT_INJECTION") == "1")
    if state.lora_modules and not args.enable_lora:
        args = dataclasses.replace(args, enable_lora=True)
    loader = threading.Thread(target=load_into, args=(state, args, chat_template),
                              name="kvserve-load", daemon=True)
    loader.start()
    try:
        uvicorn.run(build_app(state), host=host, port=port, log_level=log_level)
    finally:
        loader.join()
        if state.engine is not None:
            state.engine.shutdown()


class BackgroundServer:
    """The app on a loopback port in a thread of this process (tests and benchmarks).
    send_buffer_bytes: the kernel send buffer of every connection (accepted sockets inherit the
    listening socket's), so that a client that stops reading blocks the server's writes after a
    few KiB instead of the kernel's default megabytes (the chaos tests' slow readers)."""

    def __init__(self, state: ServerState, port: int | None = None,
                 send_buffer_bytes: int | None = None):
        import uvicorn

        self.state = state
        self.socket = socket.socket()
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer_bytes is not None:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        self.socket.bind(("127.0.0.1", port or 0))
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(build_app(state), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="kvserve-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.socket.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
