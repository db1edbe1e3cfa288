"""EngineArgs: each option written once reaches LLM, LLMEngine, AsyncLLMEngine, both commands
and the server; types are checked when the options are made, ranges by C++ before any weight
loads, and the derived pool size matches an independent computation."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

import kvserve
from kvserve import _C
from kvserve.cli import build_parser
from kvserve.engine_args import AsyncEngineArgs, EngineArgs
from kvserve.server.limits import ServerLimits

MODEL = Path(__file__).resolve().parents[2] / "models" / "shakespeare-target"
ENGINE_FIELDS = [f for f in dataclasses.fields(EngineArgs) if f.name != "model"]
CLI_FIELDS = [f for f in ENGINE_FIELDS if f.metadata["cli"]]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", [("generate", "--prompt", "x"), ("serve", "--model", "m")])
def test_every_engine_option_is_on_both_commands_with_its_default(command):
    args = parse(*command)
    for f in CLI_FIELDS:
        assert hasattr(args, f.name), f"{command[0]} lacks --{f.name.replace('_', '-')}"
        if command[0] == "generate" or f.name != "max_waiting_requests":
            assert getattr(args, f.name) == f.default, f.name
    assert parse("serve", "--model", "m").max_waiting_requests == 1024  # the server bounds it


def test_the_server_has_the_async_options_and_its_limits():
    args = parse("serve", "--model", "m")
    for f in dataclasses.fields(AsyncEngineArgs):
        if f.metadata["cli"]:
            assert hasattr(args, f.name), f.name
    for f in dataclasses.fields(ServerLimits):
        if f.metadata["cli"]:
            assert getattr(args, f.name) == f.default, f.name
    assert not hasattr(parse("generate", "--prompt", "x"), "max_stream_lag")


def test_command_lines_become_the_same_engine_args():
    args = parse("serve", "--model", "m", "--max-num-seqs", "3", "--no-prefix-caching", "--ngram",
                 "--num-speculative-tokens", "4", "--kv-cache-dtype", "int8",
                 "--max-stream-lag", "2.5", "--enforce-eager", "--max-body-bytes", "4096")
    engine = AsyncEngineArgs.from_cli_args(args)
    assert engine == AsyncEngineArgs(
        "m", max_num_seqs=3, enable_prefix_caching=False, speculative_method="ngram",
        num_speculative_tokens=4, kv_cache_dtype="int8", max_stream_lag=2.5, enforce_eager=True,
        max_waiting_requests=1024)
    assert ServerLimits.from_cli_args(args).max_body_bytes == 4096
    # The long spellings of the aliases.
    again = parse("generate", "--prompt", "x", "--speculative-method", "ngram",
                  "--enable-prefix-caching")
    assert again.speculative_method == "ngram" and again.enable_prefix_caching is True


def test_defaults_are_the_cpp_engines():
    cpp = _C.EngineConfig()
    args = EngineArgs("m")
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_logprobs",
                 "max_stop_strings", "max_stop_string_length", "max_waiting_requests",
                 "enable_prefix_caching"):
        assert getattr(args, name) == getattr(cpp, name), name


@pytest.mark.parametrize("options, message", [
    (dict(max_num_seqs="8"), "max_num_seqs must be int"),
    (dict(max_num_seqs=True), "max_num_seqs must be int"),
    (dict(max_model_len=2.5), "max_model_len must be int or None"),
    (dict(enable_prefix_caching=1), "enable_prefix_caching must be bool"),
    (dict(dtype="float64"), "dtype must be one of"),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be one of"),
    (dict(speculative_method="eagle"), "speculative_method must be one of"),
    (dict(device=3), "device must be"),
])
def test_a_mistyped_option_is_named_when_the_options_are_made(options, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(MODEL, **options)
    with pytest.raises(ValueError, match=message):
        kvserve.LLM(MODEL, **options)


def test_async_options_are_checked_too():
    for options, message in [(dict(max_stream_lag=-1.0), "max_stream_lag"),
                             (dict(max_step_seconds=0), "max_step_seconds"),
                             (dict(max_consecutive_failures=0), "max_consecutive_failures"),
                             (dict(max_stream_lag="1"), "max_stream_lag must be float")]:
        with pytest.raises(ValueError, match=message):
            AsyncEngineArgs(MODEL, **options)
    assert AsyncEngineArgs(MODEL, max_stream_lag=3).max_stream_lag == 3  # an int is a float


@pytest.mark.parametrize("options, message", [
    (dict(max_model_len=100_000), r"max_model_len must be in \[2, 1024\]"),
    (dict(max_model_len=1), "max_model_len must be in"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
    (dict(max_num_batched_tokens=-3), "max_num_batched_tokens must be >= 1"),
    (dict(block_size=0), "block_size must be >= 1"),
    (dict(num_blocks=1), "num_blocks must be >= 2"),
    (dict(num_blocks=64, kv_cache_memory=1 << 20), "num_blocks or kv_cache_memory, not both"),
    (dict(kv_cache_memory=1000), "kv_cache_memory must be at least 2 blocks"),
    (dict(max_logprobs=-1), "max_logprobs must be >= 0"),
    (dict(max_stop_strings=-1), "max_stop_strings must be >= 0"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="ngram", speculative_max_verify_tokens=-1),
     "speculative_max_verify_tokens must be >= 0"),
])
def test_ranges_are_checked_by_the_engine_before_weights_load(options, message, monkeypatch):
    import kvserve.engine

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the options were checked")

    monkeypatch.setattr(kvserve.engine, "load_weights", no_loading)
    with pytest.raises(ValueError, match=message):
        kvserve.LLMEngine(MODEL, dtype="float32", **options)


def reference_pool_blocks(config, dtype, max_num_seqs, max_model_len, block_size, max_chunk):
    """The default pool: room for max_num_seqs sequences of max_model_len tokens (a block per
    block_size tokens in every layer, K and V), plus the null block, capped at 4 GiB."""
    per_sequence = -(-max_model_len // block_size)
    bytes_per_block = (2 * config.num_layers * config.num_kv_heads * config.head_dim
                       * block_size * torch.tensor([], dtype=dtype).element_size())
    return max(2, min(max_num_seqs * per_sequence + 1, (4 << 30) // bytes_per_block))


@pytest.mark.parametrize("max_num_seqs, max_model_len", [(3, 100), (7, 1024), (256, 1024)])
def test_the_default_pool_is_sized_as_documented(max_num_seqs, max_model_len):
    engine = kvserve.LLMEngine(MODEL, dtype="float32", max_num_seqs=max_num_seqs,
                               max_model_len=max_model_len, log_memory_plan=False)
    c = engine.config
    want = reference_pool_blocks(c, torch.float32, max_num_seqs, max_model_len, 16, 2048)
    assert engine.engine.kv_cache.num_blocks == want
    budget = 123 * engine.engine.kv_cache.nbytes // engine.engine.kv_cache.num_blocks
    sized = kvserve.LLMEngine(MODEL, dtype="float32", kv_cache_memory=budget + 5,
                              log_memory_plan=False)
    assert sized.engine.kv_cache.num_blocks == 123


def test_engines_are_made_from_engine_args_alike():
    args = EngineArgs(MODEL, dtype="float32", max_num_seqs=2, max_model_len=64,
                      log_memory_plan=False)
    for made in (kvserve.LLMEngine.from_engine_args(args), kvserve.LLM.from_engine_args(args)):
        engine = getattr(made, "llm_engine", made)
        assert engine.args == args
        assert engine.engine.config.max_num_seqs == 2 and engine.max_model_len == 64
    plain = kvserve.LLMEngine(MODEL, dtype="float32", max_num_seqs=2, max_model_len=64,
                              log_memory_plan=False)
    async_engine = kvserve.AsyncLLMEngine(plain, max_stream_lag=5.0)
    try:
        assert async_engine.max_stream_lag == 5.0 and async_engine.engine is plain
        with pytest.raises(TypeError, match="max_num_seqs"):
            kvserve.AsyncLLMEngine(plain, max_num_seqs=4)
    finally:
        async_engine.shutdown()
