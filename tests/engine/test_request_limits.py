"""What one request may cost the engine, validated in one place (the C++ request validation,
a ValueError in Python and a 400 over HTTP): stop strings and stop token ids, the waiting queue
(EngineOverloadedError, a 429), seeds; and LoRA slots that a bad adapter leaves untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvserve
from kvserve import EngineOverloadedError, LLMEngine, SamplingParams

MODEL = Path(__file__).resolve().parents[2] / "models" / "shakespeare-target"


@pytest.fixture(scope="module")
def e():
    return LLMEngine(MODEL, dtype="float32", max_model_len=128, num_blocks=64,
                     log_memory_plan=False, max_stop_strings=4, max_stop_string_length=8)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(stop=["a"] * 5), "at most 4 stop strings"),
    (SamplingParams(stop_token_ids=[1024]), "stop token id 1024 is outside the vocabulary"),
    (SamplingParams(stop_token_ids=[3] * 1025), "at most 1024 stop token ids"),
    (SamplingParams(stop=["x" * 9]), "at most 8 characters.*got one of 9"),
    (SamplingParams(stop=["é" * 9]), "at most 8 characters"),
])
def test_stop_limits_are_a_value_error(e, params, message):
    with pytest.raises(ValueError, match=message):
        e.add_request("r", "ROMEO:", params)
    assert not e.has_unfinished_requests()


def test_stop_limits_count_characters_not_bytes(e):
    e.add_request("ok", "ROMEO:", SamplingParams(stop=["é" * 8, "a", "b", "c"], max_tokens=2))
    while e.has_unfinished_requests():
        e.step()


def test_zero_means_no_limit():
    e = LLMEngine(MODEL, dtype="float32", max_model_len=128, num_blocks=64,
                  log_memory_plan=False, max_stop_strings=0, max_stop_string_length=0)
    e.add_request("r", "ROMEO:", SamplingParams(stop=["zq" * 600] * 100, max_tokens=2))
    while e.has_unfinished_requests():
        e.step()
    with pytest.raises(ValueError, match="max_stop_strings must be >= 0"):
        LLMEngine(MODEL, dtype="float32", log_memory_plan=False, max_stop_strings=-1)


def test_the_waiting_queue_is_bounded():
    e = LLMEngine(MODEL, dtype="float32", max_model_len=128, num_blocks=64,
                  log_memory_plan=False, max_waiting_requests=3, max_num_seqs=2)
    for i in range(3):
        e.add_request(str(i), "ROMEO:", SamplingParams(max_tokens=4))
    with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
        e.add_request("3", "ROMEO:", SamplingParams(max_tokens=4))
    assert issubclass(EngineOverloadedError, RuntimeError)
    e.step()  # two of them run now: room for two more
    e.add_request("3", "ROMEO:", SamplingParams(max_tokens=4))
    e.add_request("4", "ROMEO:", SamplingParams(max_tokens=4))
    with pytest.raises(EngineOverloadedError):
        e.add_request("5", "ROMEO:", SamplingParams(max_tokens=4))
    while e.has_unfinished_requests():
        e.step()
    assert not e._requests


@pytest.mark.parametrize("seed, error, message", [
    (-1, ValueError, r"seed must be in \[0, 2\*\*64\), got -1"),
    (2**64, ValueError, r"seed must be in \[0, 2\*\*64\)"),
    ("7", TypeError, "seed must be None or an integer, got str"),
    (1.5, TypeError, "seed must be None or an integer, got float"),
    (True, TypeError, "got bool"),
])
def test_a_bad_seed_names_the_field(seed, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(seed=seed)
    params = SamplingParams()
    with pytest.raises(error, match=message):
        params.seed = seed
    assert params.seed is None


def test_seeds_span_64_bits():
    for seed in (0, 2**63, 2**64 - 1):
        assert SamplingParams(seed=seed).seed == seed


def test_a_bad_adapter_leaves_its_slot_as_it_was(tmp_path, checkpoint_factory):
    """set_lora checks every projection's factors before writing any: a wrong shape in the
    last one leaves the slot's earlier adapter whole."""
    from tests.models.test_lora import make_adapter

    base = checkpoint_factory("LlamaForCausalLM")
    make_adapter(base, tmp_path / "adapter", seed=0, r=4, lora_alpha=8,
                 target_modules="all-linear")
    llm = kvserve.LLM(base, dtype=torch.float32, enable_lora=True, max_loras=1, max_lora_rank=8)
    lora = kvserve.LoRARequest("a", tmp_path / "adapter")
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    before = llm.generate([[1, 17, 45, 9]], params, use_tqdm=False, lora=lora)[0]
    manager = llm.llm_engine.lora_manager
    factors = manager.factors(tmp_path / "adapter")
    last = sorted(factors)[-1]
    a, b = factors[last]
    factors[last] = (a, b[:, :-1])  # one column short
    with pytest.raises(RuntimeError, match="LoRA factors must be"):
        llm.llm_engine.engine.set_lora(manager.loaded()["a"], factors)
    after = llm.generate([[1, 17, 45, 9]], params, use_tqdm=False, lora=lora)[0]
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert ([lp.logprob for lp in after.outputs[0].logprobs] ==
            [lp.logprob for lp in before.outputs[0].logprobs])
