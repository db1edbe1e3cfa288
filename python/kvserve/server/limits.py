"""What one HTTP request may cost the server, checked before the engine sees it. The engine's own
limits (stop strings, waiting requests) are EngineConfig fields; `kvserve serve` sets both from
its options (docs/serving.md lists every limit and its default)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.server.protocol import APIError

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

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    retry_after_seconds: int = 1

    def __post_init__(self):
        for name in ("max_body_bytes", "max_prompts_per_request", "max_prompt_chars",
                     "retry_after_seconds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check_prompts(self, prompts: list, param: str = "prompt") -> None:
        """APIError(400) for more prompts than max_prompts_per_request, or a text prompt longer
        than max_prompt_chars (token-id prompts are bounded by max_model_len in the engine)."""
        if len(prompts) > self.max_prompts_per_request:
            raise APIError(400, f"at most {self.max_prompts_per_request} prompts per request "
                           f"(--max-prompts-per-request), got {len(prompts)}", param=param)
        self.check_chars(prompts, param)

    def check_chars(self, texts: list, param: str) -> None:
        """APIError(400) when the strings among `texts` have more than max_prompt_chars
        characters in all."""
        chars = sum(len(p) for p in texts if isinstance(p, str))
        if chars > self.max_prompt_chars:
            raise APIError(400, f"the prompt text has {chars} characters, more than "
                           f"{self.max_prompt_chars} (--max-prompt-chars)", param=param)
