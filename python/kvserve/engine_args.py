"""``EngineArgs``: every engine option once, with its type, default, help and checks.

``LLM``, ``LLMEngine``, ``AsyncLLMEngine``, the command line (``add_cli_args`` /
``from_cli_args``) and the server are all built from these dataclasses, so an option added here
appears in each of them. The C++ ``EngineConfig`` is filled from it in one place
(``engine_config``), and the range checks that need the model (context length, pool size,
limits) happen once, in C++ (``_C.resolve_engine_config``), as a ValueError naming the option.

    args = EngineArgs("models/shakespeare-target", max_num_seqs=8, kv_cache_dtype="int8")
    engine = LLMEngine.from_engine_args(args)
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve import _C
from kvserve.config import DTYPE_NAMES, KV_CACHE_DTYPE_NAMES, QUANTIZED_ACTIVATIONS

_CONFIG = _C.EngineConfig()  # the C++ defaults

DTYPES = DTYPE_NAMES
KV_CACHE_DTYPES = KV_CACHE_DTYPE_NAMES
# The proposer registry's methods (C++): {name: whether it drafts with speculative_model}.
SPECULATIVE_METHODS = dict(_C.speculative_methods())
# How speculative_quantization may round a drafter's weights as they load (kvserve.speculative).
SPECULATIVE_QUANTIZATIONS = ("int8", "int4")
# Decode steps of up to this many sequences replay CUDA graphs on a GPU (vLLM captures up to 512).
CUDA_GRAPH_MAX_BATCH = 256


def option(default, help: str, *, choices=None, cli: bool = True, flag: str | None = None,
           aliases: tuple[str, ...] = ()):
    """A field of EngineArgs: its default, help text, allowed values and command-line spelling
    (--the-name by default; cli=False keeps it off the command line)."""
    return field(default=default, metadata=dict(help=help, choices=choices, cli=cli, flag=flag,
                                                aliases=aliases))


@dataclass(kw_only=True)
class EngineArgs:
    """The options of an engine. Types are checked when it is made (ValueError naming the
    option); ranges when the engine is (they depend on the model)."""

    model: str | Path = field(kw_only=False, metadata=dict(
        help="a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json), "
        "or a llama.cpp GGUF file",
        cli=True, flag="--model", choices=None, aliases=()))
    dtype: str | torch.dtype = option(
        "auto", "weights and activations: the checkpoint's (auto), float32, bfloat16 or float16",
        choices=DTYPES)
    max_model_len: int | None = option(
        None, "prompt + output tokens at most (default: the config's max_position_embeddings)")
    device: str | torch.device = option(
        "cpu", "cpu, or cuda[:N] (a build with the CUDA kernels and a GPU)")
    block_size: int = option(_CONFIG.block_size, "tokens per KV-cache block")
    num_blocks: int | None = option(
        None, "blocks of the paged KV pool, the null block included (default: sized from "
        "kv_cache_memory)")
    kv_cache_memory: int | None = option(
        None, "bytes of the KV pool (default: room for max_num_seqs sequences of max_model_len "
        f"tokens, at most {_C.DEFAULT_KV_CACHE_MEMORY >> 30} GiB)")
    kv_cache_dtype: str | torch.dtype = option(
        "auto", "KV-cache entries: the model's dtype (auto), or int8 / fp8 (E4M3) with an fp32 "
        "scale per token and KV head (about 2x the tokens of a bf16 pool)",
        choices=KV_CACHE_DTYPES)
    mamba_ssm_cache_dtype: str = option(
        "float32", "state-space layers' SSM states (one per running sequence): float32, or auto "
        "(the model's dtype: half the state memory, a rounding per step)",
        choices=("float32", "auto", "bfloat16", "float16"))
    num_state_snapshots: int = option(
        0, "state-space layers: states saved at block boundaries, beyond one per running "
        "sequence, so that prefix caching can resume from them (prefill chunks then end at block "
        "boundaries); 0: prefix caching off for such models")
    quantized_activation: str = option(
        "auto", "int8 / int4 weights: round each projection's input to int8 blocks of 32 and "
        "multiply in integers (int8, llama.cpp's scheme), or multiply the dequantized weight "
        "exactly (exact); auto: int8 on a CPU, exact on a GPU", choices=QUANTIZED_ACTIVATIONS)
    max_num_seqs: int = option(_CONFIG.max_num_seqs, "sequences running at once")
    max_num_batched_tokens: int = option(
        _CONFIG.max_num_batched_tokens,
        "tokens per step (decodes + prefill chunks; longer prompts are prefilled in chunks)")
    enable_prefix_caching: bool = option(
        _CONFIG.enable_prefix_caching, "reuse the KV of identical prompt prefixes (full blocks)",
        aliases=("--no-prefix-caching",))
    max_logprobs: int = option(_CONFIG.max_logprobs, "logprobs a request may ask for at most")
    generation_config: str = option(
        "auto", "the default sampling parameters of requests that leave them unset: auto (the "
        "checkpoint's generation_config.json: temperature, top_p, top_k, min_p, "
        "repetition_penalty and max_new_tokens, as vLLM reads it), none (SamplingParams' own: "
        "temperature 1; vllm is the same), or a directory holding a generation_config.json")
    speculative_model: str | Path | None = option(
        None, "speculative decoding with this draft checkpoint (the target's tokenizer)")
    speculative_method: str | None = option(
        None, "ngram (prompt lookup), draft_model (implied by --speculative-model), mtp (the "
              "checkpoint's multi-token-prediction modules: DeepSeek-V3, GLM-4.5) or eagle3 "
              "(an EAGLE-3 head in --speculative-model)",
        choices=tuple(SPECULATIVE_METHODS), aliases=("--ngram",))
    num_speculative_tokens: int | None = option(
        None, "draft tokens per step at most (default 3 with a draft model, 4 with an "
        "EAGLE-3 head, else 2)")
    speculative_quantization: str | None = option(
        None, "int8 / int4: the draft model's or EAGLE-3 head's projections and LM head "
              "rounded to int8 per output channel, or int4 per group of 128 inputs, as they load "
              "(cheaper drafts; verification keeps the output the target's)",
        choices=SPECULATIVE_QUANTIZATIONS)
    prompt_lookup_min: int = option(1, "shortest suffix n-gram speculation looks up")
    prompt_lookup_max: int = option(4, "longest suffix n-gram speculation looks up")
    speculative_disable_batch_size: int | None = option(
        None, "no speculation while this many sequences run (default 0: never)")
    speculative_max_verify_tokens: int | None = option(
        None, "per step the drafts shrink to this / running sequences - 1 (default 8; 0: no "
        "limit)")
    log_memory_plan: bool = option(
        True, "print weights, KV capacity and concurrency at start-up (stderr)", cli=False)
    enforce_eager: bool = option(
        False, "on a GPU, launch every decode step's kernels instead of replaying CUDA graphs")
    async_scheduling: bool = option(
        _CONFIG.async_scheduling, "launch each step before the previous one's tokens reach the "
        "host, so that scheduling and output processing overlap the device's forward (vLLM's "
        "--async-scheduling); outputs are the same. Not with speculative decoding")
    enable_lora: bool = option(
        False, "serve LoRA adapters per request (LoRARequest), unmerged")
    max_loras: int = option(4, "LoRA adapters in the model at once")
    max_lora_rank: int = option(16, "LoRA rank at most per projection")
    max_stop_strings: int = option(
        _CONFIG.max_stop_strings, "stop strings of a request at most (0: no limit)")
    max_stop_string_length: int = option(
        _CONFIG.max_stop_string_length, "characters of one stop string at most (0: no limit)")
    tensor_parallel_size: int = option(
        1, "ranks that split the model's heads and MLP columns (Megatron-LM's tensor "
        "parallelism); on one machine the engine starts ranks 1..N-1 itself")
    distributed_backend: str | None = option(
        None, "collectives between the ranks: gloo (CPUs) or nccl (GPUs) (default: by device)",
        choices=("gloo", "nccl"))
    distributed_timeout: float = option(
        600.0, "seconds a collective waits for the other ranks before it fails")
    max_waiting_requests: int = option(
        _CONFIG.max_waiting_requests,
        "requests waiting to run at most; past it add_request raises EngineOverloadedError "
        "(a server's 429) (0: no limit)")
    kv_role: str | None = option(
        None, "prefill/decode disaggregation: producer (prefills requests whose "
        "kv_transfer_params ask do_remote_decode and holds their KV for a consumer to pull), "
        "consumer (pulls the prompt's KV of requests with do_remote_prefill instead of "
        "computing it) or both", choices=("producer", "consumer", "both"))
    kv_host: str = option(
        "127.0.0.1", "where a producer accepts KV pulls (the address its answers name)")
    kv_port: int = option(0, "the port a producer accepts KV pulls on (0: a free one)")
    kv_transfer_timeout: float = option(
        30.0, "seconds a producer holds a request's KV for its pull, and bound on one transfer")

    def __post_init__(self):
        check_types(self)

    # ----------------------------------------------------------------------- command line
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, include: set[str] | None = None,
                     exclude: set[str] = frozenset(), defaults: dict | None = None,
                     title: str = "engine") -> argparse.ArgumentParser:
        """Adds an option per field (those in `include`, all by default, less `exclude`) to
        `parser`, in a group named `title`. `defaults` overrides a field's default for this
        command (the server's max_waiting_requests)."""
        return add_options(cls, parser, include=include, exclude=exclude, defaults=defaults,
                           title=title)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides):
        """The fields parsed by add_cli_args (the others keep their defaults), then
        `overrides`."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                 if hasattr(args, f.name)}
        return cls(**(given | overrides))

    # -------------------------------------------------------------------------- the engine
    def speculative_config(self) -> _C.SpeculativeConfig:
        """The engine's SpeculativeConfig; method "" (off) when neither speculative_model nor
        speculative_method is given."""
        from kvserve.speculative import speculative_config

        return speculative_config(self)

    def engine_config(self, config, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                      eos_token_ids: list[int], draft_config=None) -> _C.EngineConfig:
        """The C++ EngineConfig of these options for a model of `config` (a ModelConfig) loaded
        in `dtype`, checked and resolved (max_model_len, num_blocks) by C++. Raises ValueError
        naming a bad option."""
        on_gpu = torch.device(self.device).type == "cuda"
        c = _C.EngineConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len or 0, block_size=self.block_size,
            num_blocks=self.num_blocks or 0, kv_cache_memory=self.kv_cache_memory or 0,
            enable_prefix_caching=self.enable_prefix_caching, eos_token_ids=eos_token_ids,
            max_logprobs=self.max_logprobs, speculative=self.speculative_config(),
            kv_cache_dtype=kv_cache_dtype,
            # An EAGLE-3 head reads streams the target keeps in eager forwards only.
            cuda_graph_max_batch=(0 if self.enforce_eager or not on_gpu
                                  or self.speculative_method == "eagle3"
                                  else CUDA_GRAPH_MAX_BATCH),
            max_stop_strings=self.max_stop_strings,
            max_stop_string_length=self.max_stop_string_length,
            max_waiting_requests=self.max_waiting_requests,
            ssm_state_dtype=(dtype if self.mamba_ssm_cache_dtype == "auto"
                             else getattr(torch, self.mamba_ssm_cache_dtype)),
            num_state_snapshots=self.num_state_snapshots,
            async_scheduling=self.async_scheduling)
        return _C.resolve_engine_config(c, config, dtype, draft_config)


@dataclass(kw_only=True)
class AsyncEngineArgs(EngineArgs):
    """EngineArgs and what a background-thread engine (AsyncLLMEngine, the server) adds."""

    # A client that stopped reading, or reads far slower than the engine writes, is cut off.
    max_stream_lag: float = option(
        30.0, "seconds an update may wait unread before its request is aborted (0: never)")
    max_consecutive_failures: int = option(
        3, "failed steps in a row that make the engine unhealthy (/health 503)")
    # Far above any step's time (a 2,048-token prefill chunk of an 8B model on a CPU takes
    # seconds): a step this long means a wedged device.
    max_step_seconds: float = option(
        120.0, "seconds a step may run before the engine reports itself unhealthy")

    def __post_init__(self):
        super().__post_init__()
        if not self.max_stream_lag >= 0:
            raise ValueError(f"max_stream_lag must be >= 0 seconds, got {self.max_stream_lag!r}")
        if not self.max_step_seconds > 0:
            raise ValueError(f"max_step_seconds must be > 0, got {self.max_step_seconds!r}")
        if self.max_consecutive_failures < 1:
            raise ValueError("max_consecutive_failures must be a positive integer, got "
                             f"{self.max_consecutive_failures!r}")

    def engine_args(self) -> EngineArgs:
        """The plain EngineArgs among these."""
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        return EngineArgs(**{n: v for n, v in vars(self).items() if n in names})


# The options AsyncEngineArgs adds to EngineArgs.
ASYNC_OPTIONS = frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs)) - frozenset(
    f.name for f in dataclasses.fields(EngineArgs))


# ------------------------------------------------------------------------------- helpers

def _types(annotation) -> tuple[type, ...]:
    """The runtime classes an annotation admits (None for Optional)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(t for a in typing.get_args(annotation) for t in _types(a))
    return (type(None),) if annotation is None else (annotation,)


def check_types(args) -> None:
    """ValueError naming the first field whose value is not of its annotated type (bool is not
    an int; an int is a float)."""
    hints = typing.get_type_hints(type(args))
    for f in dataclasses.fields(args):
        value, allowed = getattr(args, f.name), _types(hints[f.name])
        if isinstance(value, bool) and bool not in allowed:
            ok = False
        elif float in allowed and isinstance(value, int):
            ok = True
        else:
            ok = isinstance(value, allowed)
        if not ok:
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{f.name} must be {names}, got {value!r}")
        choices = f.metadata.get("choices")
        if choices and isinstance(value, str) and value not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}")


def add_options(cls, parser: argparse.ArgumentParser, *, include: set[str] | None = None,
                exclude: set[str] = frozenset(), defaults: dict | None = None,
                title: str = "options") -> argparse.ArgumentParser:
    """An argparse option per field of the dataclass `cls` made with option() (see
    EngineArgs.add_cli_args): --the-name, typed by the field's annotation, a bool as
    --name / --no-name."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        if (not f.metadata.get("cli", True) or f.name in exclude
                or (include is not None and f.name not in include)):
            continue
        _add_argument(group, f, hints[f.name], defaults.get(f.name, f.default))
    return parser


def _add_argument(group, f: dataclasses.Field, annotation, default) -> None:
    meta = f.metadata
    flag = meta.get("flag") or "--" + f.name.replace("_", "-")
    kind = next((t for t in _types(annotation) if t in (bool, int, float)), str)
    if kind is bool:
        group.add_argument(flag, dest=f.name, default=default, help=meta["help"],
                           action=argparse.BooleanOptionalAction)
        for alias in meta.get("aliases", ()):  # --no-prefix-caching
            group.add_argument(alias, dest=f.name, action="store_false", help=argparse.SUPPRESS)
        return
    if default is dataclasses.MISSING:
        default = None  # the model: each command says what it does without one
    group.add_argument(flag, dest=f.name, type=kind, default=default, help=meta["help"],
                       choices=meta.get("choices"))
    for alias in meta.get("aliases", ()):  # --ngram: --speculative-method ngram
        value = alias.removeprefix("--")
        group.add_argument(alias, dest=f.name, action="store_const", const=value,
                           help=f"{flag} {value}")
