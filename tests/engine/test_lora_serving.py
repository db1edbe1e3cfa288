"""LoRA adapters served per request (LLM(enable_lora=True)) against the same adapters merged into
their base by kvserve.merge_lora (itself checked against peft's merge_and_unload in
tests/models/test_lora.py): greedy tokens and their logprobs agree, for batches that mix
adapters and the base model, across slot reuse, with requests waiting for a busy slot, with the
prefix cache keyed by adapter."""

from __future__ import annotations

import shutil

import pytest
import torch

import kvserve
from kvserve import LoRARequest, SamplingParams
from tests.models.test_lora import make_adapter
from tests.models.test_parity import hf_greedy

PROMPTS = [[1, 17, 45, 9, 200, 31], [1, 5, 5, 90], [1, 300, 2, 8, 8, 64, 12, 7, 99]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=0)

ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-linear-rslora": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "patterns": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "down_proj", "up_proj"],
                     rank_pattern={"down_proj": 2},
                     alpha_pattern={r"layers\.0\.self_attn\.q_proj": 32}),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, checkpoint_factory):
    """{architecture: (base, {adapter name: (adapter dir, merged dir)})}."""
    out = {}
    for architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        base = checkpoint_factory(architecture)
        made = {}
        for i, (name, args) in enumerate(ADAPTERS.items()):
            tmp = tmp_path_factory.mktemp(f"{architecture}-{name}")
            make_adapter(base, tmp / "adapter", seed=i, **args)
            kvserve.merge_lora(base, tmp / "adapter", tmp / "merged")
            made[name] = (tmp / "adapter", tmp / "merged")
        out[architecture] = (base, made)
    return out


def greedy(llm, prompts, lora=None):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora=lora)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
            for o in outs]


def assert_same(ours, want):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(ours, want):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                   atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_each_adapter_equals_its_merged_model(adapters, architecture):
    base, made = adapters[architecture]
    llm = kvserve.LLM(base, dtype=torch.float32, enable_lora=True, max_loras=3, max_lora_rank=8)
    for name, (adapter, merged) in made.items():
        want = greedy(kvserve.LLM(merged, dtype=torch.float32), PROMPTS)
        assert_same(greedy(llm, PROMPTS, LoRARequest(name, adapter)), want)
    assert_same(greedy(llm, PROMPTS), greedy(kvserve.LLM(base, dtype=torch.float32), PROMPTS))


def test_vllms_lora_request_form_is_the_same_adapter(adapters):
    # vLLM scripts: LoRARequest(lora_name, lora_int_id, lora_path) passed as lora_request=.
    base, made = adapters["LlamaForCausalLM"]
    adapter = made["qv"][0]
    llm = kvserve.LLM(base, dtype=torch.float32, enable_lora=True, max_loras=1, max_lora_rank=8)
    want = greedy(llm, PROMPTS, LoRARequest("qv", adapter))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                        lora_request=LoRARequest("qv", 1, str(adapter)))
    assert_same([(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
                 for o in outs], want)
    assert LoRARequest(lora_name="qv", lora_int_id=7, lora_path=adapter) == LoRARequest("qv",
                                                                                       adapter)
    for args, kwargs, error in [(("qv",), {}, TypeError), (("qv", 0, adapter), {}, ValueError),
                                (("qv", adapter), dict(lora_path=adapter), TypeError),
                                (("", adapter), {}, ValueError)]:
        with pytest.raises(error):
            LoRARequest(*args, **kwargs)


def test_one_batch_mixes_adapters_and_the_base_model(adapters):
    base, made = adapters["LlamaForCausalLM"]
    names = list(made)
    llm = kvserve.LLM(base, dtype=torch.float32, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompts = PROMPTS * 2
    first, second = (LoRARequest(n, made[n][0]) for n in names[:2])
    loras = [first, None, second, None, second, first]
    ours = greedy(llm, prompts, loras)
    references = {None: kvserve.LLM(base, dtype=torch.float32)}
    for lora, prompt, got in zip(loras, prompts, ours):
        key = lora.name if lora else None
        if key not in references:
            references[key] = kvserve.LLM(made[key][1], dtype=torch.float32)
        assert_same([got], greedy(references[key], [prompt]))


def test_slots_are_reused_least_recently_used_first(adapters):
    base, made = adapters["LlamaForCausalLM"]
    llm = kvserve.LLM(base, dtype=torch.float32, enable_lora=True, max_loras=2, max_lora_rank=8)
    refs = {n: greedy(kvserve.LLM(m, dtype=torch.float32), PROMPTS[:1])
            for n, (_, m) in made.items()}
    order = ["qv", "patterns", "qv", "all-linear-rslora", "patterns", "qv"]
    for name in order:  # three adapters through two slots
        assert_same(greedy(llm, PROMPTS[:1], LoRARequest(name, made[name][0])), refs[name])
    assert set(llm.llm_engine.lora_manager.loaded()) == {"patterns", "qv"}


def test_prefix_cache_is_keyed_by_adapter(adapters):
    base, made = adapters["LlamaForCausalLM"]
    adapter, merged = made["all-linear-rslora"]
    lora = LoRARequest("a", adapter)
    prompt = [1] + list(range(3, 60))  # several full 16-token blocks
    llm = kvserve.LLM(base, dtype=torch.float32, enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate([prompt], params, use_tqdm=False, lora=lora)[0]
    base_run = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False, lora=lora)[0]
    assert first.num_cached_tokens == 0
    assert base_run.num_cached_tokens == 0, "the base model reused an adapter's KV blocks"
    assert again.num_cached_tokens >= 48, "the adapter's own prefix was not reused"
    want = kvserve.LLM(merged, dtype=torch.float32).generate([prompt], params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    assert base_run.outputs[0].token_ids != want.outputs[0].token_ids


def test_requests_wait_for_a_slot_first_come_first_served(adapters):
    """Three adapters through one slot: a request whose adapter finds every slot held waits,
    counted among the waiting requests, while the base model's behind it runs; the loaded
    adapter drains (its later request waits too), and the waiting ones take the slot in turn;
    an abort while it waits ends a request cleanly."""
    base, made = adapters["LlamaForCausalLM"]
    engine = kvserve.LLMEngine(base, dtype=torch.float32, enable_lora=True, max_loras=1,
                               max_lora_rank=8, log_memory_plan=False)
    requests = [("qv", PROMPTS[0]), ("patterns", PROMPTS[1]), (None, PROMPTS[2]),
                ("qv", PROMPTS[1]), ("all-linear-rslora", PROMPTS[0]),
                ("patterns", PROMPTS[2])]
    for i, (name, prompt) in enumerate(requests):
        engine.add_request(str(i), prompt, GREEDY,
                           lora=LoRARequest(name, made[name][0]) if name else None)
    engine.abort_request("4")  # while it waits for its slot
    finished, first_step = [], []
    while engine.has_unfinished_requests():
        step = engine.step()
        if not first_step:
            first_step = sorted(o.request_id for o in step)
            # 1, 3 (qv drains) and 5 wait; 0 and the base model run; 4's abort is reported.
            assert first_step == ["0", "2", "4"]
            assert engine.get_stats().num_waiting_requests >= 2
        finished += [o for o in step if o.finished]
    order = [o.request_id for o in finished]
    assert sorted(order) == [str(i) for i in range(6)]
    # 1 takes the slot qv frees; 5, waiting for patterns too, runs beside it; 3 (qv) after them.
    assert order.index("0") < order.index("1") < order.index("3")
    assert order.index("0") < order.index("5") < order.index("3")
    outputs = {o.request_id: o for o in finished}
    assert outputs["4"].outputs[0].finish_reason == "abort"
    assert outputs["4"].outputs[0].token_ids == []
    references = {None: kvserve.LLM(base, dtype=torch.float32)}
    for i, (name, prompt) in enumerate(requests):
        if i == 4:
            continue
        if name not in references:
            references[name] = kvserve.LLM(made[name][1], dtype=torch.float32)
        got = outputs[str(i)].outputs[0]
        assert_same([(got.token_ids, [lp.logprob for lp in got.logprobs])],
                    greedy(references[name], [prompt]))
    bm = engine.block_manager
    assert bm.num_sequences() == 0 and bm.num_free_blocks() == bm.num_usable_blocks()
    assert engine._lora_waiting == {}
    assert all(a.users == 0 for a in engine.lora_manager._loaded.values())


def test_busy_slots_and_bad_adapters_are_clear_errors(adapters, tmp_path, checkpoint_factory):
    base, made = adapters["LlamaForCausalLM"]
    engine = kvserve.LLMEngine(base, dtype=torch.float32, enable_lora=True, max_loras=1,
                               max_lora_rank=4, log_memory_plan=False)
    engine.add_request("a", PROMPTS[0], GREEDY, lora=LoRARequest("qv", made["qv"][0]))
    # Its adapter is checked before it waits for the busy slot.
    with pytest.raises(ValueError, match="above max_lora_rank 4"):  # rank 8 > 4, slot busy too
        engine.add_request("c", PROMPTS[0], GREEDY,
                           lora=LoRARequest("r", made["all-linear-rslora"][0]))
    with pytest.raises(ValueError, match="one name, one adapter"):
        engine.add_request("d", PROMPTS[0], GREEDY, lora=LoRARequest("qv", made["patterns"][0]))
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter"):
        engine.add_request("e", PROMPTS[0], GREEDY, lora=LoRARequest("x", tmp_path / "none"))
    with pytest.raises(TypeError, match="LoRARequest"):
        engine.add_request("f", PROMPTS[0], GREEDY, lora="qv")
    outputs = []
    while engine.has_unfinished_requests():  # the first request is served all the same
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["a"]
    # Its slot is free again: another adapter now loads.
    engine.add_request("g", PROMPTS[1], GREEDY, lora=LoRARequest("p", made["patterns"][0]))
    # One that waits for the busy slot, its directory gone when the slot frees: an error
    # output, and the engine serves on.
    gone = tmp_path / "gone"
    shutil.copytree(made["qv"][0], gone)
    engine.add_request("w", PROMPTS[0], GREEDY, lora=LoRARequest("gone", gone))
    shutil.rmtree(gone)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    ended = {o.request_id: o for o in outputs if o.finished}
    assert ended["g"].outputs[0].finish_reason == "length"
    assert ended["w"].outputs[0].finish_reason == "error"
    assert "LoRA adapter 'gone' failed to load" in ended["w"].error
    with pytest.raises(ValueError, match="enable_lora"):
        kvserve.LLM(base).generate(PROMPTS[:1], GREEDY, lora=LoRARequest("qv", made["qv"][0]))
    with pytest.raises(ValueError, match="max_loras"):
        kvserve.LLM(base, enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="lora_slot 3 is outside"):
        engine.engine.add_request("h", PROMPTS[0], GREEDY, lora_slot=3)
    # One rank: factors for workers it does not have are refused, the slot left as it was.
    with pytest.raises(ValueError, match="factors for 1 workers, and the model has 0"):
        engine.engine.set_lora(0, {}, [{}])
    embedding = tmp_path / "embedding"
    make_adapter(base, embedding, r=2, lora_alpha=2, target_modules=["embed_tokens"])
    with pytest.raises(ValueError, match="embedding"):
        engine.add_request("i", PROMPTS[0], GREEDY, lora=LoRARequest("emb", embedding))
    # Latent attention and experts only: nothing to put an adapter on.
    moe_only = checkpoint_factory("DeepseekV2ForCausalLM", first_k_dense_replace=0)
    with pytest.raises(ValueError, match="no projection for LoRA"):
        kvserve.LLM(moe_only, enable_lora=True)


@pytest.mark.parametrize("architecture, targets", [
    ("Phi3ForCausalLM", ["qkv_proj", "gate_up_proj", "o_proj"]),  # stored fused: all parts
    ("BambaForCausalLM", ["q_proj", "v_proj", "gate_proj", "down_proj"]),  # feed_forward = mlp
    ("NemotronHForCausalLM", ["q_proj", "o_proj", "up_proj", "down_proj"]),  # MLP, no gate
])
def test_adapters_on_a_checkpoints_own_module_names(tmp_path, checkpoint_factory, architecture,
                                                    targets):
    """An adapter names the checkpoint's modules: Phi-3's fused qkv_proj / gate_up_proj (its B
    covers every part), Bamba's feed_forward (kvserve's mlp), Nemotron-H's mixer.* (kvserve's
    self_attn and mlp; up_proj unfused, there being no gate). Greedy tokens equal transformers'
    with peft's merge of the adapter."""
    base = checkpoint_factory(architecture)
    reference = make_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8,
                             target_modules=targets)
    llm = kvserve.LLM(base, dtype=torch.float32, enable_lora=True, max_lora_rank=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, params, use_tqdm=False, lora=LoRARequest("a", tmp_path / "adapter"))]
    assert got == [hf_greedy(reference, prompt, 12) for prompt in PROMPTS]
    assert got != [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_a_stream_of_requests_for_the_loaded_adapter_cannot_starve_a_waiting_one(adapters):
    """One slot, a new request for its adapter every step: the request for another adapter
    that waits gets the slot once the loaded adapter drains (its new requests wait too), and
    everything ends, each as its merged model."""
    base, made = adapters["LlamaForCausalLM"]
    engine = kvserve.LLMEngine(base, dtype=torch.float32, enable_lora=True, max_loras=1,
                               max_lora_rank=8, log_memory_plan=False)
    qv, patterns = (LoRARequest(n, made[n][0]) for n in ("qv", "patterns"))
    engine.add_request("q0", PROMPTS[0], GREEDY, lora=qv)
    engine.add_request("p", PROMPTS[1], GREEDY, lora=patterns)
    finished, step = {}, 0
    while engine.has_unfinished_requests():
        if step < 40:
            engine.add_request(f"q{step + 1}", PROMPTS[step % 3], GREEDY, lora=qv)
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = (o, step)
        step += 1
        assert step < 400
    assert finished["p"][1] < 40, "the waiting adapter's request starved"
    references = {name: kvserve.LLM(made[name][1], dtype=torch.float32)
                  for name in ("qv", "patterns")}
    for request_id, (out, _) in finished.items():
        c = out.outputs[0]
        prompt = PROMPTS[1] if request_id == "p" else PROMPTS[(int(request_id[1:]) - 1) % 3]
        if request_id == "q0":
            prompt = PROMPTS[0]
        assert_same([(c.token_ids, [lp.logprob for lp in c.logprobs])],
                    greedy(references["patterns" if request_id == "p" else "qv"], [prompt]))
    assert engine._lora_waiting == {}
    assert all(a.users == 0 for a in engine.lora_manager._loaded.values())
