"""vLLM's token routes on kvserve's server: POST /tokenize (a prompt, or chat messages rendered
as /v1/chat/completions renders them), POST /detokenize and GET /version; behind the API key and
the request limits like every route but /health and /metrics."""

from __future__ import annotations

import asyncio

from kvserve.server.protocol import APIError, DetokenizeRequest, TokenizeRequest


def add_tokenize_routes(app, state) -> None:
    """Adds the routes to `app`, serving `state` (a ServerState)."""
    from kvserve.server.app import _chat_prompt, _check_model, _engine

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        engine = _engine(state)
        _check_model(state, body.model)
        body.check_supported()
        tokenizer = engine.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, f"model {state.model_name} has no tokenizer")
        if body.prompt is not None:
            state.limits.check_prompts([body.prompt])
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, special)
        else:
            if state.chat_template is None:
                raise APIError(400, f"model {state.model_name} has no chat template",
                               param="messages")
            messages = [m.as_template_input() for m in body.messages]
            state.limits.check_chars([m["content"] for m in messages], param="messages")
            ids = await asyncio.to_thread(_chat_prompt, state, messages, body,
                                          bool(body.add_special_tokens))
        answer = {"count": len(ids), "max_model_len": engine.engine.max_model_len,
                  "tokens": ids}
        if body.return_token_strs:
            answer["token_strs"] = tokenizer.token_strings(ids)
        return answer

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        engine = _engine(state)
        _check_model(state, body.model)
        tokenizer = engine.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, f"model {state.model_name} has no tokenizer")
        vocab = engine.engine.config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})",
                           param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
