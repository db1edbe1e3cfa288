"""``SamplingParams``: how one request samples (the C++ struct, kvserve/sampling_params.h, whose
fields and checks are C++'s), with its repr written here, in Python."""

from __future__ import annotations

from kvserve import _C

SamplingParams = _C.SamplingParams

# The fields in the order the constructor takes them.
FIELDS = ("n", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens",
          "ignore_eos", "stop", "stop_token_ids", "include_stop_str_in_output", "logprobs",
          "prompt_logprobs", "logit_bias")


def _repr(params: SamplingParams) -> str:
    return "SamplingParams(" + ", ".join(f"{f}={getattr(params, f)!r}" for f in FIELDS) + ")"


SamplingParams.__repr__ = _repr
