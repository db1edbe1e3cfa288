"""``LLM``: load a Hugging Face checkpoint and generate, vLLM-style."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvserve import _C
from kvserve.config import load_checkpoint_info, resolve_dtype
from kvserve.loader import load_weights
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.tokenizer import Tokenizer

SamplingParams = _C.SamplingParams

PromptType = str | Sequence[str] | Sequence[Sequence[int]]

# Upper bound of the default KV pool (vLLM's CPU backend defaults to 4 GiB too). Pages of the
# pool are only committed when first written.
DEFAULT_KV_CACHE_MEMORY = 4 << 30


class LLM:
    """A model loaded for offline generation.

    Args:
        model: a Hugging Face directory with config.json, *.safetensors (single or sharded) and,
            for text prompts, tokenizer.json.
        dtype: "float32", "bfloat16", "float16", or "auto" (the checkpoint's dtype).
        max_model_len: longest prompt + generation; defaults to the config's
            max_position_embeddings.
        max_num_seqs: prompts run together in one batch.
        device: "cpu" (CUDA kernels are not written yet).
        block_size: tokens per KV-cache block.
        num_kv_blocks: blocks in the paged KV pool (block 0, the null block, included); or
        kv_cache_memory: bytes for the pool. Default: enough for max_num_seqs sequences of
            max_model_len tokens, at most DEFAULT_KV_CACHE_MEMORY.
        enable_prefix_caching: reuse the KV of identical prompt prefixes (full blocks) across
            requests and generate() calls.
    """

    def __init__(self, model: str | Path, dtype: str | torch.dtype = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 device: str | torch.device = "cpu", *, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int | None = None,
                 enable_prefix_caching: bool = True):
        if torch.device(device).type != "cpu":
            raise ValueError(f"device {device!r} is not supported yet: kvserve's kernels run on the CPU")
        info = load_checkpoint_info(model)
        self.model_dir = Path(model)
        self.config = info.config
        self.hf_config = info.hf_config
        self.dtype = resolve_dtype(dtype, info.checkpoint_dtype)
        limit = info.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        if not isinstance(max_model_len, int) or not 2 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be an integer in [2, {limit}], got {max_model_len!r}")
        self.max_model_len = max_model_len
        self.eos_token_ids = info.eos_token_ids
        self.tokenizer = Tokenizer.from_model_dir(model)
        num_blocks = self._kv_blocks(block_size, num_kv_blocks, kv_cache_memory, max_num_seqs)
        weights = load_weights(self.model_dir, info.config, self.dtype, device)
        self.model = _C.create_causal_lm(info.config, weights, max_model_len)
        cache_config = _C.KVCacheConfig(block_size=block_size, num_blocks=num_blocks,
                                        enable_prefix_caching=bool(enable_prefix_caching))
        self._runner = _C.ModelRunner(self.model, max_model_len, max_num_seqs, info.eos_token_ids,
                                      cache_config)
        self._next_request_id = 0

    def _kv_blocks(self, block_size, num_kv_blocks, kv_cache_memory, max_num_seqs) -> int:
        """Blocks of the paged KV pool, from an explicit count, a byte budget or the default."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if num_kv_blocks is not None and kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
        c = self.config
        per_block = _C.PagedKVCache.bytes_per_block(c.num_layers, block_size, c.num_kv_heads,
                                                    c.head_dim, self.dtype)
        if num_kv_blocks is not None:
            if not isinstance(num_kv_blocks, int) or num_kv_blocks < 2:
                raise ValueError(f"num_kv_blocks must be an integer >= 2 (block 0 is reserved), "
                                 f"got {num_kv_blocks!r}")
            return num_kv_blocks
        if kv_cache_memory is None:
            full = max_num_seqs * -(-self.max_model_len // block_size) + 1
            return max(2, min(full, DEFAULT_KV_CACHE_MEMORY // per_block))
        if not isinstance(kv_cache_memory, int) or kv_cache_memory < 2 * per_block:
            raise ValueError(f"kv_cache_memory must be at least 2 blocks ({2 * per_block} bytes), "
                             f"got {kv_cache_memory!r}")
        return kv_cache_memory // per_block

    @property
    def kv_cache(self):
        """The paged KV pool (PagedKVCache): blocks, capacity_tokens, bytes_per_token."""
        return self._runner.kv_cache

    @property
    def block_manager(self):
        """The PagedBlockManager: free blocks, usage, prefix-cache hits, evictions."""
        return self._runner.block_manager

    def generate(self, prompts: PromptType,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Completes every prompt; one RequestOutput per prompt, in order.

        prompts: a string, a list of strings, or a list of token-id lists.
        sampling_params: one SamplingParams for all prompts or one per prompt (default:
            SamplingParams(), i.e. temperature 1, 16 tokens).
        Raises ValueError / TypeError for bad prompts or parameters before running anything.
        """
        texts, token_lists = self._tokenize(prompts)
        params = self._params_per_prompt(sampling_params, len(token_lists))
        requests = [_C.GenerationRequest(ids, p) for ids, p in zip(token_lists, params)]
        arrival = time.monotonic()
        results = self._runner.generate(requests)
        outputs = []
        for text, ids, result in zip(texts, token_lists, results):
            token_ids = list(result.token_ids)
            completion = CompletionOutput(0, self._decode(ids, token_ids), token_ids, result.finish_reason)
            metrics = RequestMetrics(arrival, result.first_token_time, result.finish_time,
                                     len(token_ids))
            outputs.append(RequestOutput(str(self._next_request_id), text, ids, [completion],
                                         True, metrics, result.num_cached_tokens))
            self._next_request_id += 1
        return outputs

    def _tokenize(self, prompts: PromptType) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise TypeError("prompts must be a string, a non-empty list of strings, "
                            "or a non-empty list of token-id lists")
        texts, token_lists = [], []
        for prompt in prompts:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError(f"{self.model_dir} has no tokenizer.json; pass token ids")
                texts.append(prompt)
                token_lists.append(self.tokenizer.encode(prompt))
            elif isinstance(prompt, Sequence) and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                texts.append(None)
                token_lists.append(list(prompt))
            else:
                raise TypeError(f"a prompt must be a string or a list of ints, got {prompt!r:.80}")
        return texts, token_lists

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

    def _decode(self, prompt_ids: list[int], token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode_continuation(prompt_ids, token_ids)
