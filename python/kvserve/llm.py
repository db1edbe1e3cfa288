"""``LLM``: load a Hugging Face checkpoint and generate, vLLM-style, on the continuous-batching
engine."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvserve import _C
from kvserve.engine import LLMEngine
from kvserve.lora_serving import LoRARequest
from kvserve.outputs import RequestOutput

SamplingParams = _C.SamplingParams

PromptType = str | Sequence[str] | Sequence[Sequence[int]]


class LLM:
    """A model loaded for offline generation.

    Args:
        model: a Hugging Face directory with config.json, *.safetensors (single or sharded) and,
            for text prompts, tokenizer.json.
        dtype: "float32", "bfloat16", "float16", or "auto" (the checkpoint's dtype).
        max_model_len: longest prompt + generation; defaults to the config's
            max_position_embeddings.
        max_num_seqs: sequences running at once; max_num_batched_tokens: tokens per engine step
            (decodes + prefill chunks; longer prompts are prefilled in chunks).
        device: "cpu", or "cuda[:N]" when this build holds the CUDA kernels and torch sees a
            GPU: weights, KV pool and per-step metadata then live on that GPU.
        block_size: tokens per KV-cache block.
        num_blocks: blocks in the paged KV pool (block 0, the null block, included); or
        kv_cache_memory: bytes for the pool. Default: enough for max_num_seqs sequences of
            max_model_len tokens, at most kvserve.engine.DEFAULT_KV_CACHE_MEMORY.
        kv_cache_dtype: "auto" (the model's dtype), "int8" or "fp8" (E4M3): the pool stores
            keys and values quantized, one fp32 scale per token and KV head, so it holds about
            twice the tokens of a bf16 pool (4x fp32) in the same memory.
        enable_prefix_caching: reuse the KV of identical prompt prefixes (full blocks) across
            requests and generate() calls.
        speculative_model: a draft checkpoint directory with the target's tokenizer, for
            speculative decoding; or speculative_method="ngram" for prompt lookup (suffixes of
            prompt_lookup_min..prompt_lookup_max tokens). num_speculative_tokens: draft tokens per
            step at most (default 2). speculative_max_verify_tokens: per step k shrinks to this / running
            sequences - 1, so verification stays cheap (default 8; 0: no limit);
            speculative_disable_batch_size: speculation pauses while this many sequences run
            (default 0: never).
            Outputs keep the target's distribution exactly.
        log_memory_plan: print the weights / KV-cache plan at start-up.
        enforce_eager: on a GPU, False (the default) replays CUDA graphs for decode steps of
            up to 256 sequences (see kvserve.engine.LLMEngine); True launches every step's
            kernels one by one.
        enable_lora: serve LoRA adapters per request (generate(..., lora=LoRARequest(name,
            path))), up to max_loras at once of rank up to max_lora_rank (see
            kvserve.lora_serving).
    """

    def __init__(self, model: str | Path, dtype: str | torch.dtype = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 device: str | torch.device = "cpu", *, block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_memory: int | None = None,
                 kv_cache_dtype: str | torch.dtype = "auto",
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 speculative_model: str | Path | None = None,
                 speculative_method: str | None = None,
                 num_speculative_tokens: int | None = None, prompt_lookup_min: int = 1,
                 prompt_lookup_max: int = 4, speculative_disable_batch_size: int | None = None,
                 speculative_max_verify_tokens: int | None = None,
                 log_memory_plan: bool = False, enforce_eager: bool = False,
                 enable_lora: bool = False, max_loras: int = 4, max_lora_rank: int = 16):
        self.llm_engine = LLMEngine(
            model, dtype, max_model_len, block_size=block_size, num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, device=device,
            speculative_model=speculative_model, speculative_method=speculative_method,
            num_speculative_tokens=num_speculative_tokens, prompt_lookup_min=prompt_lookup_min,
            prompt_lookup_max=prompt_lookup_max,
            speculative_disable_batch_size=speculative_disable_batch_size,
            speculative_max_verify_tokens=speculative_max_verify_tokens,
            log_memory_plan=log_memory_plan, enforce_eager=enforce_eager,
            enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank)
        e = self.llm_engine
        self.model_dir, self.config, self.hf_config = e.model_dir, e.config, e.hf_config
        self.dtype, self.max_model_len, self.eos_token_ids = e.dtype, e.max_model_len, e.eos_token_ids
        self.tokenizer, self.model = e.tokenizer, e.model
        self._next_request_id = 0

    @property
    def kv_cache(self):
        """The paged KV pool (PagedKVCache): blocks, capacity_tokens, bytes_per_token."""
        return self.llm_engine.kv_cache

    @property
    def block_manager(self):
        """The PagedBlockManager: free blocks, usage, prefix-cache hits, evictions."""
        return self.llm_engine.block_manager

    def generate(self, prompts: PromptType,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Completes every prompt; one RequestOutput per prompt, in order.

        prompts: a string, a list of strings, or a list of token-id lists.
        sampling_params: one SamplingParams for all prompts or one per prompt (default:
            SamplingParams(), i.e. temperature 1, 16 tokens).
        use_tqdm: a progress bar over finished prompts with the output tokens/s.
        lora: a LoRA adapter for all prompts, or one (or None) per prompt (enable_lora=True).
        Raises ValueError / TypeError for bad prompts or parameters before running anything.
        """
        prompts = self._prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        if lora is None or isinstance(lora, LoRARequest):
            loras = [lora] * len(prompts)
        else:
            loras = list(lora)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA adapters for {len(prompts)} prompts")
        ids = [str(self._next_request_id + i) for i in range(len(prompts))]
        self._next_request_id += len(prompts)
        arrival = time.monotonic()
        added = []
        try:
            for request_id, prompt, p, adapter in zip(ids, prompts, params, loras):
                self.llm_engine.add_request(request_id, prompt, p, arrival_time=arrival,
                                            lora=adapter)
                added.append(request_id)
        except Exception:
            for request_id in added:  # nothing runs: take the accepted ones back out
                self.llm_engine.abort_request(request_id)
            self.llm_engine.step()
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="prompt", file=sys.stderr,
                       dynamic_ncols=True, disable=None)
        started, out_tokens = time.monotonic(), 0
        while len(finished) < len(ids):
            # Only finished requests come back, their text detokenized once (see LLMEngine.step).
            for out in self.llm_engine.step(final_only=True):
                out_tokens += sum(len(c.token_ids) for c in out.outputs)
                finished[out.request_id] = out
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.set_postfix_str(f"{out_tokens / max(time.monotonic() - started, 1e-9):.1f} "
                                    "tokens/s", refresh=False)
        if bar is not None:
            bar.close()
        return [finished[request_id] for request_id in ids]

    @staticmethod
    def _prompt_list(prompts: PromptType) -> list:
        if isinstance(prompts, str):
            return [prompts]
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise TypeError("prompts must be a string, a non-empty list of strings, "
                            "or a non-empty list of token-id lists")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            raise TypeError("prompts must be a list of prompts: wrap one token-id list in a list")
        return list(prompts)

    @staticmethod
    def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"expected one SamplingParams or a list of {count}")
        return params
