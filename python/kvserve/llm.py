"""``LLM``: load a Hugging Face checkpoint and generate, vLLM-style, on the continuous-batching
engine."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvserve.engine import LLMEngine
from kvserve.engine_args import EngineArgs
from kvserve.lora_serving import LoRARequest
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


# A prompt: text, token ids, or vLLM's TextPrompt / TokensPrompt dicts ({"prompt": text},
# {"prompt_token_ids": ids}).
PromptType = str | dict | Sequence[str | dict | Sequence[int]]


class LLM:
    """A model loaded for offline generation.

    LLM(model, **options): a Hugging Face directory with config.json, *.safetensors (single or
    sharded) and, for text prompts, tokenizer.json; the options are kvserve.EngineArgs' (dtype,
    max_model_len, device, the KV pool, batching, speculative decoding, LoRA, limits; listed there
    with their defaults). LLM does not print the memory plan unless log_memory_plan=True.
    LLM.from_engine_args(args) takes an EngineArgs.
    """

    def __init__(self, model: str | Path, **options):
        options.setdefault("log_memory_plan", False)
        self._attach(LLMEngine(model, **options))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm._attach(LLMEngine.from_engine_args(args))
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.llm_engine = engine
        e = engine
        self.model_dir, self.config, self.hf_config = e.model_dir, e.config, e.hf_config
        self.dtype, self.max_model_len = e.dtype, e.max_model_len
        self.eos_token_ids = e.eos_token_ids
        self.tokenizer, self.model = e.tokenizer, e.model
        self._next_request_id = 0

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks this LLM started (nothing for one rank); it cannot
        generate afterwards."""
        self.llm_engine.shutdown()

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
                 lora: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Completes every prompt; one RequestOutput per prompt, in order.

        prompts: a string, a list of strings, or a list of token-id lists; vLLM's prompt dicts
            ({"prompt": text} or {"prompt_token_ids": ids}) too, alone or in the list.
        sampling_params: one SamplingParams for all prompts or one per prompt (default:
            get_default_sampling_params(): the checkpoint's generation_config.json, else
            SamplingParams(), i.e. temperature 1, 16 tokens).
        use_tqdm: a progress bar over finished prompts with the output tokens/s.
        lora: a LoRA adapter for all prompts, or one (or None) per prompt (enable_lora=True);
            lora_request is the same, by vLLM's name.
        Raises ValueError / TypeError for bad prompts or parameters before running anything.
        """
        lora = self._one_lora(lora, lora_request)
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
            for out in self.llm_engine.step(finished_only=True):
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

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True,
             lora: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template: str | Path | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, *,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Answers one conversation or several, as vLLM's LLM.chat: each is rendered with the
        checkpoint's chat template (or `chat_template`: template text or a file), tokenized
        without adding special tokens (the template writes them), then run as generate runs
        token-id prompts; one RequestOutput per conversation, in order.

        messages: [{"role": ..., "content": ...}, ...] or a list of such lists; content is a
            string, None, or text parts ([{"type": "text", "text": ...}]); other keys (name,
            tool_calls) reach the template as given.
        add_generation_prompt / continue_final_message / chat_template_kwargs: as
            ChatTemplate.render takes them (continue_final_message continues the last message,
            e.g. a prefilled assistant answer; chat_template_kwargs adds template variables
            such as enable_thinking).
        Raises ValueError for a model without a tokenizer or a chat template, malformed
        messages, or a template that fails on them, before running anything."""
        from kvserve.server.chat_template import ChatTemplate, message_text

        lora = self._one_lora(lora, lora_request)
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer.json to encode messages with")
        if chat_template is not None:
            template = ChatTemplate.from_model_dir(self.model_dir, chat_template)
        else:
            if not hasattr(self, "_chat_template"):
                self._chat_template = ChatTemplate.from_model_dir(self.model_dir)
            template = self._chat_template
        if template is None:
            raise ValueError(f"{self.model_dir} has no chat template (tokenizer_config.json or "
                             "chat_template.jinja): pass chat_template=")
        if isinstance(messages, Sequence) and messages and all(isinstance(m, dict)
                                                               for m in messages):
            conversations = [messages]
        else:
            conversations = list(messages) if isinstance(messages, Sequence) else []
        if not conversations or not all(
                isinstance(c, Sequence) and c and all(isinstance(m, dict) for m in c)
                for c in conversations):
            raise TypeError("messages must be a non-empty list of message dicts, or a list of "
                            "such lists")
        prompts = []
        for conversation in conversations:
            rendered = []
            for m in conversation:
                if not isinstance(m.get("role"), str):
                    raise ValueError(f"every message needs a string role, got {m.get('role')!r}")
                rendered.append({**m, "content": message_text(m.get("content"))})
            text = template.render(rendered, add_generation_prompt, continue_final_message,
                                   chat_template_kwargs)
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm, lora)

    def get_tokenizer(self):
        """The model's tokenizer (kvserve.tokenizer.Tokenizer: encode, decode, vocab), as vLLM's
        LLM.get_tokenizer; None for a checkpoint without tokenizer.json."""
        return self.tokenizer

    @staticmethod
    def _one_lora(lora, lora_request):
        if lora is not None and lora_request is not None:
            raise ValueError("give lora or lora_request (vLLM's name), not both")
        return lora if lora is not None else lora_request

    @staticmethod
    def _prompt_list(prompts: PromptType) -> list:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise TypeError("prompts must be a string, a non-empty list of strings, "
                            "or a non-empty list of token-id lists")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            raise TypeError("prompts must be a list of prompts: wrap one token-id list in a list")
        return [LLM._prompt_of(p) if isinstance(p, dict) else p for p in prompts]

    @staticmethod
    def _prompt_of(prompt: dict):
        """The text or token ids of vLLM's TextPrompt / TokensPrompt."""
        keys = set(prompt)
        if keys == {"prompt"} or keys == {"prompt_token_ids"}:
            return prompt[keys.pop()]
        unsupported = sorted(str(k) for k in keys - {"prompt", "prompt_token_ids"})
        why = (f"; not supported: {', '.join(unsupported)}" if unsupported else
               ", not both" if keys else f", got {prompt!r}")
        raise ValueError('a prompt dict holds either "prompt" (text) or "prompt_token_ids"' + why)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate uses without sampling_params: the checkpoint's generation_config.json
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens;
        EngineArgs.generation_config), SamplingParams' defaults for the rest."""
        return self.llm_engine.get_default_sampling_params()

    def _params_per_prompt(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"expected one SamplingParams or a list of {count}")
        return params
