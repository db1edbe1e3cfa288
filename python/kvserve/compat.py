"""The original minimal API, kept for compatibility: a `ContinuousBatchingEngine` with
`GenerationRequest`s, and the contiguous per-layer `KVCache` with its simple generation loop.
New code uses LLM / LLMEngine (the Python `ContinuousBatchingEngine` here is a thin shape over
LLMEngine, unrelated to the C++ `_C.ContinuousBatchingEngine` that LLMEngine drives).

    engine = ContinuousBatchingEngine(model="models/shakespeare-target", tokenizer=None,
                                      device="cpu", max_batch_size=16, max_seq_len=512)
    engine.add_request(GenerationRequest(prompt="Hello", max_new_tokens=50))
    while engine.scheduler.has_pending_work:
        engine.step()
    print(engine.results)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvserve import _C

from kvserve.engine import LLMEngine, SamplingParams
from kvserve.outputs import RequestOutput
from kvserve.tokenizer import Tokenizer


@dataclass
class GenerationRequest:
    """One prompt for ContinuousBatchingEngine.add_request."""

    prompt: str | list[int]
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    request_id: str | None = None  # assigned by add_request when None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                              stop=self.stop or [])


class ContinuousBatchingEngine:
    """Iteration-level batching of GenerationRequests.

    model: a Hugging Face checkpoint directory (or an LLMEngine to wrap).
    tokenizer: a kvserve Tokenizer or a tokenizer.json path; default: the model directory's.
    max_batch_size: sequences running at once; max_seq_len: prompt + output tokens at most.
    Other keywords go to LLMEngine (block_size, kv_cache_memory, max_num_batched_tokens, ...).
    """

    def __init__(self, model: str | Path | LLMEngine, tokenizer: Tokenizer | str | Path | None = None,
                 device: str = "cpu", max_batch_size: int = 16, max_seq_len: int = 512,
                 **engine_kwargs):
        if isinstance(model, LLMEngine):
            self.llm_engine = model
        else:
            engine_kwargs.setdefault("log_memory_plan", False)
            self.llm_engine = LLMEngine(model, max_model_len=max_seq_len,
                                        max_num_seqs=max_batch_size, device=device,
                                        **engine_kwargs)
        if tokenizer is not None:
            self.llm_engine.tokenizer = (tokenizer if isinstance(tokenizer, Tokenizer)
                                         else Tokenizer(tokenizer))
        self.results: dict[str, RequestOutput] = {}  # finished requests by id
        self._ids = itertools.count()

    @property
    def scheduler(self):
        """The C++ scheduler: has_pending_work, num_running, num_waiting, num_preemptions."""
        return self.llm_engine.scheduler

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.llm_engine.tokenizer

    def add_request(self, request: GenerationRequest) -> str:
        """Queues the request; returns its id. Raises ValueError / TypeError for bad input."""
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"expected a GenerationRequest, got {type(request).__name__}")
        request_id = request.request_id or f"req-{next(self._ids)}"
        self.llm_engine.add_request(request_id, request.prompt, request.sampling_params())
        request.request_id = request_id
        return request_id

    def step(self) -> list[RequestOutput]:
        """One iteration over every active sequence; finished requests also land in results."""
        outputs = self.llm_engine.step()
        for out in outputs:
            if out.finished:
                self.results[out.request_id] = out
        return outputs

    def abort_request(self, request_id: str) -> bool:
        return self.llm_engine.abort_request(request_id)

    def get_stats(self):
        return self.llm_engine.get_stats()


# The contiguous, pre-allocated cache: one buffer per layer, one row per sequence (C++).
KVCache = _C.KVCache


def reset_all_caches(caches: Iterable[KVCache]) -> None:
    """Empties every cache of a model (one per layer) for a new sequence."""
    for cache in caches:
        cache.reset()
