"""What one HTTP request may cost the server, checked before the engine sees it. The engine's own
limits (stop strings, waiting requests) are EngineConfig fields; `kvserve serve` sets both from
its options (docs/serving.md lists every limit and its default)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine_args import add_options, check_types, option

DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_PROMPTS_PER_REQUEST = 128
DEFAULT_MAX_PROMPT_CHARS = 1_000_000
# Requests that may wait for a running slot before more get 429 (the engine's
# max_waiting_requests, which LLM.generate leaves unbounded).
DEFAULT_MAX_WAITING_REQUESTS = 1024


@dataclass(frozen=True)
class ServerLimits:
    """max_body_bytes: a request body at most (413 past it, read or announced);
    max_prompts_per_request: prompts of one completions call (a list of prompts); max_prompt_chars:
    characters of a call's prompts in all (a chat's messages, and its rendered template), before
    tokenizing;
    retry_after_seconds: the Retry-After of a 429."""

    max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES,
                                 "a request body at most in bytes; 413 past it")
    max_prompts_per_request: int = option(DEFAULT_MAX_PROMPTS_PER_REQUEST,
                                          "prompts in one completions call")
    max_prompt_chars: int = option(
        DEFAULT_MAX_PROMPT_CHARS, "characters of a call's prompts or messages before tokenizing")
    retry_after_seconds: int = option(1, "the Retry-After of a 429", cli=False)

    def __post_init__(self):
        check_types(self)
        for name in ("max_body_bytes", "max_prompts_per_request", "max_prompt_chars",
                     "retry_after_seconds"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def add_cli_args(cls, parser):
        return add_options(cls, parser, title="limits of one HTTP request")

    @classmethod
    def from_cli_args(cls, args):
        return cls(**{n: getattr(args, n) for n in cls.__dataclass_fields__ if hasattr(args, n)})

    def check_prompts(self, prompts: list, param: str = "prompt") -> None:
        """APIError(400) for more prompts than max_prompts_per_request, or a text prompt longer
        than max_prompt_chars (token-id prompts are bounded by max_model_len in the engine)."""
        from kvserve.server.protocol import APIError

        if len(prompts) > self.max_prompts_per_request:
            raise APIError(400, f"at most {self.max_prompts_per_request} prompts per request "
                           f"(--max-prompts-per-request), got {len(prompts)}", param=param)
        self.check_chars(prompts, param)

    def check_chars(self, texts: list, param: str) -> None:
        """APIError(400) when the strings among `texts` have more than max_prompt_chars
        characters in all."""
        from kvserve.server.protocol import APIError

        chars = sum(len(p) for p in texts if isinstance(p, str))
        if chars > self.max_prompt_chars:
            raise APIError(400, f"the prompt text has {chars} characters, more than "
                           f"{self.max_prompt_chars} (--max-prompt-chars)", param=param)
