"""kvserve: a small LLM inference engine with a C++ core.

    from kvserve import LLM, SamplingParams
    llm = LLM("path/to/hf-checkpoint")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)
"""

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from kvserve import _C
from kvserve.async_engine import AsyncLLMEngine
from kvserve.engine import LLMEngine
from kvserve.engine_args import AsyncEngineArgs, EngineArgs
from kvserve.llm import LLM, SamplingParams
from kvserve.lora import merge_lora
from kvserve.lora_serving import AdapterRef, LoRARequest
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
# The original minimal API (kvserve.compat), kept for compatibility.
from kvserve.compat import ContinuousBatchingEngine, GenerationRequest, KVCache, reset_all_caches

# add_request's refusal when the engine's waiting queue is full (a server's 429): retry later.
EngineOverloadedError = _C.EngineOverloadedError

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLMEngine",
    "EngineArgs",
    "AsyncEngineArgs",
    "ContinuousBatchingEngine",
    "GenerationRequest",
    "SamplingParams",
    "EngineOverloadedError",
    "KVCache",
    "reset_all_caches",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "merge_lora",
    "LoRARequest",
    "AdapterRef",
]
