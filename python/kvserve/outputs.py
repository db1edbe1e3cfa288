"""What generate() and LLMEngine.step() return, shaped like vLLM's outputs.

They are the C++ engine's outputs (kvserve._C.RequestOutput / CompletionOutput, in token ids)
with the detokenized text added; every field they share means the same thing. RequestMetrics is
the C++ struct itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve import _C

# Times of one request (seconds on the time.monotonic() clock; 0 until the moment happens):
# arrival_time, first_scheduled_time, first_token_time, last_token_time, finished_time,
# num_generated_tokens, and the derived time_to_first_token, queue_time,
# time_per_output_token and e2e_latency.
RequestMetrics = _C.RequestMetrics


@dataclass
class CompletionOutput:
    """One generated continuation of a prompt: _C.CompletionOutput plus its text."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # None while running; "stop", "length", "abort" or "error"
    delta_text: str = ""  # text added since the previous LLMEngine.step() output
    new_token_ids: list[int] = field(default_factory=list)  # ids added since then
    # With SamplingParams(logprobs=N): per token, its logprob, rank and the top-N
    # (kvserve._C.TokenLogprobs: token_id, logprob, rank, top [(id, logprob), ...]).
    logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one prompt: _C.RequestOutput plus the prompt text and the outputs' text."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    error: str | None = None  # why a sample ended with finish_reason "error"
    # With SamplingParams(prompt_logprobs=N), as vLLM's: one entry per prompt token, None for the
    # first (nothing precedes it), then kvserve._C.TokenLogprobs whose token_id is that prompt
    # token. Set from the first output after the prompt was scored (in "delta" outputs, only
    # there).
    prompt_logprobs: list | None = None
    # A KV producer's finished request (kv_transfer_params do_remote_decode): where a consumer
    # pulls its prompt's KV from, in vLLM's kv_transfer_params shape (None otherwise).
    kv_transfer_params: dict | None = None
