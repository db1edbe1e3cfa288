"""The OpenAI API's request bodies (completions and chat completions) as pydantic models, their
translation into SamplingParams, and OpenAI's error shape.

Fields outside the API that vLLM also takes: top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, include_stop_str_in_output, allowed_token_ids,
truncate_prompt_tokens.
Fields of the API that kvserve does not implement are a 400 when set to anything but their
default (suffix, best_of != n, tools and the older functions, non-text response_format or
modalities, audio output), never silently ignored; fields outside both are ignored, as vLLM
ignores them, with a warning naming each (once per name). A completion's echo puts the prompt before
each choice's text, and with logprobs its tokens' logprobs before the generated ones' (the first
prompt token's are null): the engine's prompt_logprobs."""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.engine import SamplingParams
from kvserve.server.chat_template import message_text


# Integers as the engine takes them (C++ int64): a larger JSON number is a 400 naming the field,
# not a conversion error. A seed is any 64-bit pattern.
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]
Seed = Annotated[int, Field(ge=0, le=2**64 - 1)]
MaxTokens = Annotated[int, Field(ge=1, le=2**63 - 1)]
# A logit_bias key: a token id as a JSON string (19 digits at most: within int64).
_TOKEN_ID = re.compile(r"-?[0-9]{1,19}")

_logger = logging.getLogger("kvserve.server")
# Names of ignored request fields already warned about: each once, and at most this many, so
# that requests full of made-up names cannot flood the log.
_warned_fields: set[str] = set()
_MAX_WARNED_FIELDS = 256


def _warn_ignored(fields: list[str]) -> None:
    new = sorted({f[:64] for f in fields} - _warned_fields)
    room = _MAX_WARNED_FIELDS - len(_warned_fields)
    if not new or room <= 0:
        return
    new = new[:room]
    _warned_fields.update(new)
    _logger.warning("request fields that kvserve does not take were ignored: %s (each named "
                    "once)", ", ".join(map(repr, new)))


class APIError(Exception):
    """An error the server answers in OpenAI's shape with `status` (and `headers`)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    n: Int64 = 1
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's disaggregated-serving handshake (kvserve.kv_transfer.KVTransferParams).
    kv_transfer_params: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _note_ignored_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            ignored = [k for k in data if isinstance(k, str) and k not in cls.model_fields]
            if ignored:
                _warn_ignored(ignored)
        return data

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        defaults: dict | None = None) -> SamplingParams:
        """The engine's parameters, a field the request leaves unset taken from `defaults` (the
        model's generation_config.json, as vLLM's server takes it) when there; raises
        APIError(400) for unsupported fields and ValueError (SamplingParams' own checks) for bad
        values."""
        defaults = defaults or {}
        if self.n < 1:
            raise APIError(400, f"n must be at least 1, got {self.n}", param="n")
        values: dict[str, Any] = dict(
            n=self.n, stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            seed=self.seed, logit_bias=self.token_biases(), min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                values[name] = value
        if max_tokens is not None:
            values["max_tokens"] = max_tokens
        params = SamplingParams(**values)
        params.validate()
        return params

    def token_biases(self) -> dict[int, float] | None:
        """logit_bias with its keys (token ids as JSON strings, as OpenAI's) as integers."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, value in self.logit_bias.items():
            if not _TOKEN_ID.fullmatch(key):
                raise APIError(400, f"logit_bias keys must be token ids, got {key[:32]!r}",
                               param="logit_bias")
            biases[int(key)] = value
        return biases


# A completion's max_tokens when neither the request nor the model's generation_config.json
# (max_new_tokens) gives one: OpenAI's default.
COMPLETION_MAX_TOKENS = 16


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    max_tokens: MaxTokens | None = None
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string, strings, one token-id list or token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return list(p)

    def requested_prompt_logprobs(self) -> int | None:
        """The prompt's logprobs, wanted when the prompt is echoed with logprobs."""
        return self.logprobs if self.echo else None

    def check_supported(self) -> None:
        if self.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        check_text(self.prompt, "prompt")
        check_text(self.stop, "stop")
        check_text(self.bad_words, "bad_words")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None

    def as_template_input(self) -> dict:
        """The message as chat templates read it: content parts of type text joined."""
        try:
            content = message_text(self.content)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        return {**(self.model_extra or {}), "role": self.role, "content": content}


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[dict] | None = None
    functions: list[dict] | None = None  # the API's older form of tools
    function_call: str | dict | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: continue the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more template variables

    def check_supported(self) -> None:
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if self.functions or self.function_call not in (None, "none"):
            raise APIError(400, "functions are not supported",
                           param="functions" if self.functions else "function_call")
        if self.modalities and any(m != "text" for m in self.modalities):
            raise APIError(400, "only the text modality is supported", param="modalities")
        if self.audio is not None:
            raise APIError(400, "audio output is not supported", param="audio")
        if self.response_format is not None and self.response_format.type != "text":
            raise APIError(400, "only response_format text is supported",
                           param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        check_text([m.model_dump() for m in self.messages], "messages")
        check_text(self.chat_template_kwargs, "chat_template_kwargs")
        check_text(self.stop, "stop")
        check_text(self.bad_words, "bad_words")

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else the older max_tokens; None: the rest of the context."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def check_text(value, param: str) -> None:
    """APIError(400) when a string in `value` (strings, lists and dicts of them) is not valid
    Unicode: JSON can spell a lone surrogate (\\ud800), which no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"{param} holds a lone surrogate (\\u{ord(value[e.start]):04x}) at "
                           f"character {e.start}: not valid Unicode text", param=param) from None
    elif isinstance(value, (list, tuple)):
        if value and isinstance(value[0], int):  # token ids (the schema keeps lists uniform)
            return
        for item in value:
            check_text(item, param)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, param)
            check_text(item, param)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered with the model's template.
    add_special_tokens defaults to true for a prompt and false for messages (the template writes
    them), as in vLLM."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if self.messages is not None and not self.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        check_text(self.prompt, "prompt")
        check_text([m.model_dump() for m in self.messages or []], "messages")
        check_text(self.chat_template_kwargs, "chat_template_kwargs")


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[Int64]
