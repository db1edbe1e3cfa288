"""The OpenAI-compatible HTTP API over an AsyncLLMEngine (FastAPI):

    POST /v1/completions, POST /v1/chat/completions  (streamed as server-sent events or not)
    GET /v1/models, GET /health, GET /metrics

Every request runs as engine requests (one per prompt; n samples share it); a client that
disconnects, streaming or not, aborts them and frees their blocks. Errors use OpenAI's JSON error
shape: 400 bad parameters or prompts, 401 a wrong or missing API key, 404 an unknown model, 503
while the model loads.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.server.chat_template import ChatTemplate, ChatTemplateError
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kvserve.server.responses import Choices


@dataclass
class ServerState:
    """What the endpoints share. engine is None until the model has loaded."""

    model_name: str
    api_key: str | None = None
    # LoRA adapters served by name (the request's "model"), on an engine made with enable_lora.
    lora_modules: dict = field(default_factory=dict)  # name -> LoRARequest
    engine: object = None  # AsyncLLMEngine
    chat_template: ChatTemplate | None = None
    load_error: BaseException | None = None
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self):
        self.metrics = ServerMetrics(self.model_name)

    def ready(self, engine, chat_template: ChatTemplate | None) -> None:
        """The model has loaded: start serving it."""
        self.chat_template = chat_template
        self.metrics.attach(engine.engine)
        self.engine = engine


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kvserve", docs_url=None, redoc_url=None)
    app.state.kvserve = state

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return JSONResponse(APIError(400, f"{where}: {first.get('msg', 'invalid request')}",
                                     param=where).body(), status_code=400)

    async def authorize(request: Request) -> None:
        """The /v1 routes need `Authorization: Bearer KEY` when the server has a key."""
        if state.api_key is not None and (
                request.headers.get("authorization") != f"Bearer {state.api_key}"):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @app.get("/health")
    async def health():
        if state.engine is None:
            return JSONResponse({"status": "loading" if state.load_error is None else "failed"},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models():
        engine = _engine(state)
        card = {"object": "model", "created": 0, "owned_by": "kvserve",
                "max_model_len": engine.engine.max_model_len}
        return {"object": "list", "data": [{"id": state.model_name, **card}] + [
            {"id": name, **card, "parent": state.model_name} for name in state.lora_modules]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        _engine(state)
        lora = _check_model(state, body.model)
        body.check_supported()
        params = _params(body, body.max_tokens, body.logprobs)
        prompts = body.prompts()
        return await _serve(state, request, "cmpl", "text_completion", body, params, prompts,
                            chat=False, lora=lora)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        engine = _engine(state)
        lora = _check_model(state, body.model)
        body.check_supported()
        if state.chat_template is None or engine.engine.tokenizer is None:
            raise APIError(400, f"model {state.model_name} has no chat template (none in its "
                                "tokenizer_config.json; start the server with --chat-template)"
                           if state.chat_template is None else
                           f"model {state.model_name} has no tokenizer to encode messages with")
        try:
            text = state.chat_template.render([m.as_template_input() for m in body.messages],
                                              body.add_generation_prompt)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from e
        # The template writes any special tokens itself.
        prompt = engine.engine.tokenizer.encode(text, add_special_tokens=False)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # the rest of the context
            max_tokens = max(1, engine.engine.max_model_len - len(prompt))
        params = _params(body, max_tokens, body.requested_logprobs())
        return await _serve(state, request, "chatcmpl", "chat.completion", body, params,
                            [prompt], chat=True, lora=lora)

    app.include_router(v1)
    return app


def _engine(state: ServerState):
    if state.engine is None:
        message = ("the model is still loading" if state.load_error is None
                   else f"the model failed to load: {state.load_error}")
        raise APIError(503, message, type="service_unavailable")
    return state.engine


def _check_model(state: ServerState, model: str | None):
    """The LoRA adapter the request names (a LoRARequest), or None for the base model."""
    if model is None or model == state.model_name:
        return None
    if model in state.lora_modules:
        return state.lora_modules[model]
    served = ", ".join(repr(m) for m in [state.model_name, *state.lora_modules])
    raise APIError(404, f"model {model!r} does not exist; this server serves {served}",
                   param="model", code="model_not_found")


def _params(body, max_tokens, logprobs):
    try:
        return body.sampling_params(max_tokens, logprobs)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from e


async def _serve(state: ServerState, request: Request, prefix: str, object_name: str, body,
                 params, prompts: list, chat: bool, lora=None):
    """Runs the prompts (n samples each) and answers, streamed or whole. Bad prompts are a 400
    before any byte is sent; a disconnect aborts every request of the call."""
    engine = state.engine
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    streams = [engine.generate(p, params, f"{request_id}-{i}", lora=lora)
               for i, p in enumerate(prompts)]
    # Each stream submits its request at its first step, so all start together; a bad prompt
    # raises there, and the call's other requests are aborted.
    try:
        first = await asyncio.gather(*(stream.__anext__() for stream in streams),
                                     return_exceptions=True)
    except BaseException:  # cancelled (the server stops)
        await _close(streams)
        raise
    failed = next((e for e in first if isinstance(e, BaseException)), None)
    if failed is not None:
        await _close(streams)
        if isinstance(failed, (ValueError, TypeError)):
            raise APIError(400, str(failed), param="messages" if chat else "prompt") from failed
        raise failed
    choices = Choices(engine.engine.tokenizer, params.n, len(prompts), chat)
    header = dict(id=request_id, object=object_name, created=int(time.time()),
                  model=lora.name if lora is not None else state.model_name)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream_events(state, streams, first, choices, header, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    collect = asyncio.ensure_future(_collect(state, streams, first, choices))
    disconnect = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not collect.done():  # the client left: abort its requests
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)
    collect.result()
    return {**header, "choices": choices.final(), "usage": choices.usage()}


async def _collect(state, streams, first, choices) -> None:
    async for i, out in _merged(streams, first):
        choices.add(i, out)
        if out.finished:
            state.metrics.observe(out)
    choices.raise_errors()


async def _stream_events(state, streams, first, choices, header, include_usage
                         ) -> AsyncIterator[str]:
    async for i, out in _merged(streams, first):
        deltas = choices.add(i, out)
        if out.finished:
            state.metrics.observe(out)
        for delta in deltas:
            yield _event({**header, "object": _chunk_object(header), "choices": [delta]})
    if include_usage:
        yield _event({**header, "object": _chunk_object(header), "choices": [],
                      "usage": choices.usage()})
    yield "data: [DONE]\n\n"


def _chunk_object(header: dict) -> str:
    return "chat.completion.chunk" if header["object"] == "chat.completion" else "text_completion"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _merged(streams, first) -> AsyncIterator[tuple[int, object]]:
    """(prompt index, output) from every stream as they come, each stream's first output (already
    read) first. Closing or cancelling this closes every stream (aborting its request)."""
    if len(streams) == 1:  # one prompt (most calls): no pump task or second queue
        try:
            yield 0, first[0]
            if not first[0].finished:
                async for out in streams[0]:
                    yield 0, out
        finally:
            await _close(streams)
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        finally:
            await queue.put((i, done))

    tasks = []
    try:
        for i, out in enumerate(first):
            yield i, out
        live = sum(1 for out in first if not out.finished)
        tasks = [asyncio.ensure_future(pump(i, s)) for i, (s, out) in
                 enumerate(zip(streams, first)) if not out.finished]
        while live:
            i, out = await queue.get()
            if out is done:
                live -= 1
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(streams)


async def _close(streams) -> None:
    for stream in streams:
        await stream.aclose()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
