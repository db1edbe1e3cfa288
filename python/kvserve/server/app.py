"""The OpenAI-compatible HTTP API over an AsyncLLMEngine (FastAPI):

    POST /v1/completions, POST /v1/chat/completions  (streamed as server-sent events or not)
    GET /v1/models, GET /health, GET /metrics

Every request runs as engine requests (one per prompt; n samples share it); a client that
disconnects, streaming or not, at any moment after it was accepted, aborts them and frees their
blocks. Every error is in OpenAI's JSON shape: 400 bad parameters or prompts, 401 a wrong or
missing API key (checked before the body is read), 404 an unknown model or route, 413 a body
over the limit, 429 (with Retry-After) when too many requests wait, 500 when the engine failed a
request (an error event in a stream), 503 while the model loads or when the engine is down.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from kvserve import _C
from kvserve.server.chat_template import ChatTemplate, ChatTemplateError
from kvserve.server.guard import RequestGuard
from kvserve.server.limits import ServerLimits
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (COMPLETION_MAX_TOKENS, APIError, ChatCompletionRequest,
                                     CompletionRequest)
from kvserve.server.responses import Choices
from kvserve.server.tokenize import add_tokenize_routes


@dataclass
class ServerState:
    """What the endpoints share. engine is None until the model has loaded."""

    model_name: str
    api_key: str | None = None
    # LoRA adapters served by name (the request's "model"), on an engine made with enable_lora.
    lora_modules: dict = field(default_factory=dict)  # name -> LoRARequest
    limits: ServerLimits = field(default_factory=ServerLimits)
    enable_docs: bool = False  # /docs and /openapi.json (behind the API key)
    # POST /fault/step_failures {"count": N}: the next N engine steps fail (chaos testing only;
    # `kvserve serve` turns it on with KVSERVE_FAULT_INJECTION=1).
    fault_injection: bool = False
    engine: object = None  # AsyncLLMEngine
    chat_template: ChatTemplate | None = None
    load_error: BaseException | None = None
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self):
        self.metrics = ServerMetrics(self.model_name)

    def ready(self, engine, chat_template: ChatTemplate | None) -> None:
        """The model has loaded: start serving it."""
        self.chat_template = chat_template
        self.metrics.attach(engine.engine, engine)
        self.engine = engine


def build_app(state: ServerState) -> FastAPI:
    docs = state.enable_docs
    app = FastAPI(title="kvserve", docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.kvserve = state
    app.add_middleware(RequestGuard, api_key=state.api_key,
                       max_body_bytes=state.limits.max_body_bytes)

    def error_response(e: APIError) -> JSONResponse:
        state.metrics.rejected(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        message = first.get("msg", "invalid request")
        return error_response(APIError(400, f"{where}: {message}" if where else message,
                                       param=where))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        return error_response(APIError(e.status_code, str(e.detail), code=code.get(e.status_code),
                                       headers=e.headers))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                       type="internal_error"))

    v1 = APIRouter(prefix="/v1")

    @app.get("/health")
    async def health():
        engine = state.engine
        if engine is None:
            return JSONResponse({"status": "loading" if state.load_error is None else "failed"},
                                status_code=503)
        reason = engine.unhealthy_reason()
        if reason is not None:
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/get_load")
    async def get_load():
        """The worker's load as routers read it (vllm-router's power_of_two policy polls it):
        requests running or waiting."""
        stats = _engine(state).get_stats()
        return {"load": stats.num_running_requests + stats.num_waiting_requests,
                "num_running": stats.num_running_requests,
                "num_waiting": stats.num_waiting_requests}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_tokenize_routes(app, state)

    @v1.get("/models")
    async def models():
        engine = _engine(state)
        card = {"object": "model", "created": 0, "owned_by": "kvserve",
                "max_model_len": engine.engine.max_model_len}
        return {"object": "list", "data": [{"id": state.model_name, **card}] + [
            {"id": name, **card, "parent": state.model_name} for name in state.lora_modules]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        engine = _engine(state)
        lora = _check_model(state, body.model)
        body.check_supported()
        prompts = body.prompts()
        state.limits.check_prompts(prompts)
        max_tokens = body.max_tokens
        if max_tokens is None:  # the model's max_new_tokens, else OpenAI's 16
            max_tokens = engine.engine.default_sampling.get("max_tokens", COMPLETION_MAX_TOKENS)
        params = _params(state, body, max_tokens, body.logprobs, body.requested_prompt_logprobs())
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
        messages = [m.as_template_input() for m in body.messages]
        state.limits.check_chars([m["content"] for m in messages], param="messages")
        # Rendering and tokenizing a long conversation take time: off the event loop.
        prompt = await asyncio.to_thread(_chat_prompt, state, messages, body)
        try:  # before the rest of the context is counted
            prompt = engine.engine.truncate_prompt(prompt, body.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="truncate_prompt_tokens") from e
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:  # the rest of the context, at most the model's max_new_tokens
            max_tokens = max(1, engine.engine.max_model_len - len(prompt))
            max_tokens = min(max_tokens, engine.engine.default_sampling.get("max_tokens",
                                                                            max_tokens))
        params = _params(state, body, max_tokens, body.requested_logprobs())
        return await _serve(state, request, "chatcmpl", "chat.completion", body, params,
                            [prompt], chat=True, lora=lora)

    app.include_router(v1)
    if state.fault_injection:
        @app.post("/fault/step_failures")
        async def step_failures(request: Request):
            try:
                count = int((await request.json())["count"])
            except (ValueError, KeyError, TypeError) as e:
                raise APIError(400, 'expected {"count": N}') from e
            _engine(state).engine.engine.inject_step_failures(count)
            return {"count": count}
    return app


def _engine(state: ServerState):
    engine = state.engine
    if engine is None:
        message = ("the model is still loading" if state.load_error is None
                   else f"the model failed to load: {state.load_error}")
        raise APIError(503, message, type="service_unavailable")
    if not engine.alive:  # failing steps still take requests: one that succeeds ends the fault
        raise APIError(503, "the engine has stopped (see /health)", type="service_unavailable")
    return engine


def _check_model(state: ServerState, model: str | None):
    """The LoRA adapter the request names (a LoRARequest), or None for the base model."""
    if model is None or model == state.model_name:
        return None
    if model in state.lora_modules:
        return state.lora_modules[model]
    served = ", ".join(repr(m) for m in [state.model_name, *state.lora_modules])
    raise APIError(404, f"model {model!r} does not exist; this server serves {served}",
                   param="model", code="model_not_found")


def _chat_prompt(state: ServerState, messages: list[dict], body,
                 add_special_tokens: bool = False) -> list[int]:
    try:
        text = state.chat_template.render(messages, body.add_generation_prompt,
                                          body.continue_final_message,
                                          body.chat_template_kwargs)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param=e.field) from e
    state.limits.check_chars([text], param="messages")
    # The template writes any special tokens itself.
    return state.engine.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)



def _params(state: ServerState, body, max_tokens, logprobs, prompt_logprobs=None):
    try:
        return body.sampling_params(max_tokens, logprobs, prompt_logprobs,
                                    defaults=state.engine.engine.default_sampling)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from e


async def _submit(state: ServerState, prompts: list, params, request_id: str, chat: bool, lora,
                  kv_transfer_params: dict | None = None):
    """Submits one engine request per prompt (delta outputs); all or none: a refusal aborts
    the ones already in."""
    engine = state.engine
    if kv_transfer_params is not None and len(prompts) > 1:
        raise APIError(400, "kv_transfer_params takes one prompt", param="kv_transfer_params")
    bound = engine.engine.engine.config.max_waiting_requests
    if bound and engine.get_stats().num_waiting_requests >= bound:
        # Refused before tokenizing (the engine's own check, at submission, is the exact one):
        # a flood costs the server as little as possible.
        raise APIError(429, f"the engine is at capacity: {bound} requests wait to run "
                       "(max_waiting_requests); retry later", type="rate_limit_error",
                       code="engine_overloaded",
                       headers={"Retry-After": str(state.limits.retry_after_seconds)})
    streams = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(await engine.add_request(prompt, params, f"{request_id}-{i}",
                                                    lora=lora, output_kind="delta",
                                                    kv_transfer_params=kv_transfer_params))
    except BaseException as error:
        for stream in streams:
            await stream.aclose()
        if isinstance(error, _C.EngineOverloadedError):
            retry = str(state.limits.retry_after_seconds)
            raise APIError(429, str(error), type="rate_limit_error", code="engine_overloaded",
                           headers={"Retry-After": retry}) from error
        if isinstance(error, (ValueError, TypeError)):
            raise APIError(400, str(error), param="messages" if chat else "prompt") from error
        if isinstance(error, OSError) and lora is not None:
            raise APIError(500, f"LoRA adapter {lora.name!r} failed to load: {error}",
                           type="internal_error") from error
        if isinstance(error, RuntimeError) and not engine.alive:
            raise APIError(503, str(error), type="service_unavailable") from error
        raise
    return streams


async def _serve(state: ServerState, request: Request, prefix: str, object_name: str, body,
                 params, prompts: list, chat: bool, lora=None):
    """Runs the prompts (n samples each) and answers, streamed or whole. Bad prompts are a 400
    before any byte is sent; a disconnect aborts every request of the call."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    streams = await _submit(state, prompts, params, request_id, chat, lora,
                            body.kv_transfer_params)
    echo = prompts if getattr(body, "echo", False) else None
    choices = Choices(state.engine.engine.tokenizer, params.n, len(prompts), chat, body.stream,
                      echo)
    header = dict(id=request_id, object=object_name, created=int(time.time()),
                  model=lora.name if lora is not None else state.model_name)
    outputs = _merged(streams, request)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream_events(state, outputs, choices, header, include_usage),
                                 media_type="text/event-stream")
    kv_transfer_params = None
    async for i, out in outputs:
        choices.add(i, out)
        if out.finished:
            state.metrics.observe(out)
            kv_transfer_params = out.kv_transfer_params
    if not all(c.finish_reason is not None for c in choices.choices):
        return Response(status_code=499)  # the client left: its requests were aborted
    choices.raise_errors()
    answer = {**header, "choices": choices.final(), "usage": choices.usage()}
    if kv_transfer_params is not None:  # a producer's: where the decode engine pulls the KV
        answer["kv_transfer_params"] = kv_transfer_params
    return answer


async def _stream_events(state, outputs, choices, header, include_usage) -> AsyncIterator[str]:
    async for i, out in outputs:
        deltas = choices.add(i, out)
        if out.finished:
            state.metrics.observe(out)
        for delta in deltas:
            yield _event({**header, "object": _chunk_object(header), "choices": [delta]})
    error = choices.error()
    if error is not None:  # the choices that failed ended with finish_reason "error"
        yield _event(APIError(500, error, type="internal_error").body())
    if include_usage:
        yield _event({**header, "object": _chunk_object(header), "choices": [],
                      "usage": choices.usage()})
    yield "data: [DONE]\n\n"


def _chunk_object(header: dict) -> str:
    return "chat.completion.chunk" if header["object"] == "chat.completion" else "text_completion"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _merged(streams, request: Request) -> AsyncIterator[tuple[int, object]]:
    """(prompt index, output) from every stream as they come, until all finished or the client
    disconnects (watched from the start, also before the first token). One read is outstanding
    per stream, so a slow consumer leaves updates to coalesce in the engine's channels. Ending
    or closing this closes every stream (aborting its request if unfinished)."""
    reads = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        while reads:
            done, _ = await asyncio.wait([*reads, watcher], return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                return
            for read in done:
                i = reads.pop(read)
                out = read.result()
                if not out.finished:
                    reads[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, out
    finally:
        watcher.cancel()
        for read in reads:
            read.cancel()
        await asyncio.gather(watcher, *reads, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
