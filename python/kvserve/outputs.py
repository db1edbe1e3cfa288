"""What generate() returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated continuation of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # None while running; "stop", "length" or "abort"
    delta_text: str = ""  # text added since the previous LLMEngine.step() output
    new_token_ids: list[int] = field(default_factory=list)  # ids added since then
    # With SamplingParams(logprobs=N): per token, its logprob, rank and the top-N
    # (kvserve._C.TokenLogprobs: token_id, logprob, rank, top [(id, logprob), ...]).
    logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps in seconds on the monotonic clock (time.monotonic())."""

    arrival_time: float
    first_token_time: float
    finished_time: float  # the last token's time while the request runs
    num_generated_tokens: int
    first_scheduled_time: float | None = None
    last_token_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        """From arrival to the first step that ran the request."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float:
        """TTFT: from arrival to the first sampled token (queueing + prefill + sampling)."""
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float:
        """TPOT: mean gap between tokens after the first; 0 for a single token."""
        if self.num_generated_tokens < 2:
            return 0.0
        last = self.finished_time if self.last_token_time is None else self.last_token_time
        return (last - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
