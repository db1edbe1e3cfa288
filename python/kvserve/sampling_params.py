"""``SamplingParams``: how one request samples (the C++ struct, kvserve/sampling_params.h, whose
fields and checks are C++'s), with its repr written here, in Python; and the defaults a
checkpoint's generation_config.json gives it (``generation_defaults``)."""

from __future__ import annotations

import json
from pathlib import Path

from kvserve import _C

SamplingParams = _C.SamplingParams

# The fields in the order the constructor takes them.
FIELDS = ("n", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens",
          "ignore_eos", "stop", "stop_token_ids", "include_stop_str_in_output", "logprobs",
          "prompt_logprobs", "logit_bias", "allowed_token_ids", "truncate_prompt_tokens",
          "bad_words")


def _repr(params: SamplingParams) -> str:
    return "SamplingParams(" + ", ".join(f"{f}={getattr(params, f)!r}" for f in FIELDS) + ")"


SamplingParams.__repr__ = _repr

# The fields of a checkpoint's generation_config.json that set its default sampling parameters,
# as vLLM reads them (its --generation-config auto), with max_new_tokens as max_tokens; do_sample
# is not one (vLLM ignores it too).
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                            "max_new_tokens")
GENERATION_CONFIG_OFF = ("none", "vllm")  # "vllm": vLLM's spelling of the engine's own defaults


def generation_defaults(source: str, model: str | Path) -> dict:
    """The default SamplingParams fields that `source` gives (EngineArgs.generation_config):
    "auto" reads generation_config.json beside the model (a GGUF file has none), "none" or
    "vllm" nothing, any other value names a directory that holds one. The fields it does not set
    keep SamplingParams' defaults. Raises ValueError naming the file for a value SamplingParams
    refuses."""
    if source in GENERATION_CONFIG_OFF:
        return {}
    if source == "auto":
        path = Path(model) / "generation_config.json"
        if not path.is_file():
            return {}
    else:
        path = Path(source) / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"generation_config must be auto, none or a directory holding a "
                             f"generation_config.json; {path} does not exist")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    fields = {}
    for name in GENERATION_CONFIG_FIELDS:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: {name} must be a number, got {value!r}")
        integer = name in ("top_k", "max_new_tokens")
        if integer and value != int(value):
            raise ValueError(f"{path}: {name} must be an integer, got {value!r}")
        if name == "max_new_tokens":
            fields["max_tokens"] = int(value)
        else:
            fields[name] = int(value) if integer else float(value)
    try:
        SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from e
    return fields
