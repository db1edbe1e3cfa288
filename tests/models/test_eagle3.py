"""EAGLE-3 heads as speculative drafts (speculative_method="eagle3"), on a tiny Llama target and
a random head written in the published heads' layout, against a pure-torch port of the head's
forward: the target keeps the residual streams the head reads; the head's outputs (after and
before its final norm) and logits over the target's vocabulary equal the port's at every row, fed
whole and in chunks; every step accepts exactly the drafts the port proposes (chained beyond the
first); greedy speculative output equals plain decoding, alone and with mixed arrivals,
preemption, chunked prefill and prefix caching; sampled output follows the target's
distribution; bad heads are clear errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from kvserve import LLM, SamplingParams, _C
from kvserve.config import load_checkpoint_info
from kvserve.loader.eagle3_weights import eagle3_head, load_eagle3_weights
from kvserve.loader.safetensors_loader import load_weights
from kvserve.testing.checkpoints import make_checkpoint, make_eagle3_head
from tests.engine_loop import fp32_engine
from tests.engine_loop import run_arrivals as run
from tests.models.test_mtp import (BLOCK, UNLIMITED, check_every_step, forward_rows,
                                   mixed_requests)

transformers = pytest.importorskip("transformers")

AUX = [1, 2, 3]  # the streams entering layers 1, 2 and 3 of the 4-layer target
VOCAB = 16  # small enough that a random head's drafts are sometimes the target's tokens
PROMPT = [1, 7, 5, 9, 12, 7, 3, 12, 8, 3, 15, 14, 6]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, head): a 4-layer Llama and a head drafting over 14 of its 16 tokens."""
    root = tmp_path_factory.mktemp("eagle3")
    target = make_checkpoint(root / "target", "LlamaForCausalLM", vocab_size=VOCAB,
                             num_hidden_layers=4)
    return target, make_eagle3_head(root / "head", target, draft_vocab_size=14, aux_layers=AUX,
                                    seed=2)


class Port:
    """The head's forward in plain torch, read from its files, over transformers' target."""

    def __init__(self, target_dir, head_dir):
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.config = json.loads((head_dir / "config.json").read_text())
        self.w = load_file(head_dir / "model.safetensors")
        self.aux = self.config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")

    def rms(self, x, name):
        eps = self.config["rms_norm_eps"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.w[name]

    def rope(self, x, positions):  # [R, heads, dim], Llama's halves
        dim = x.shape[-1]
        inv = 1.0 / (self.config.get("rope_theta", 10000.0)
                     ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angle = positions[:, None].double() * inv[None]
        cos, sin = angle.cos().float()[:, None], angle.sin().float()[:, None]
        a, b = x[..., :dim // 2], x[..., dim // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    def target_states(self, tokens):
        """fc of the target's streams entering the AUX layers, per position."""
        with torch.no_grad():
            streams = self.hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        return torch.cat([streams[i][0] for i in self.aux], -1) @ self.w["fc.weight"].T

    def rows(self, tokens, previous, positions):
        """(after the final norm, before it) for rows at consecutive positions from 0, each
        reading its token and previous state, attending causally over the rows before."""
        c, w = self.config, self.w
        heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        dim = c["hidden_size"] // heads
        with torch.no_grad():
            embedded = self.hf.model.embed_tokens(torch.tensor(tokens))
            x = torch.cat([self.rms(embedded, "midlayer.input_layernorm.weight"),
                           self.rms(previous, "midlayer.hidden_norm.weight")], -1)
            r = len(tokens)
            q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(r, heads, dim)
            k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(r, kv_heads, dim)
            v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(r, kv_heads, dim)
            q, k = self.rope(q, positions), self.rope(k, positions)
            k = k.repeat_interleave(heads // kv_heads, 1)
            v = v.repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
            scores = scores.masked_fill(torch.ones(r, r, dtype=torch.bool).triu(1), -math.inf)
            attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(r, -1)
            residual = previous + attended @ w["midlayer.self_attn.o_proj.weight"].T
            h = self.rms(residual, "midlayer.post_attention_layernorm.weight")
            mlp = (torch.nn.functional.silu(h @ w["midlayer.mlp.gate_proj.weight"].T)
                   * (h @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
            residual = residual + mlp
            return self.rms(residual, "norm.weight"), residual

    def logits(self, normed):
        draft = normed @ self.w["lm_head.weight"].T
        ids = torch.arange(draft.shape[-1]) + self.w["d2t"]
        full = torch.full((normed.shape[0], self.config["vocab_size"]), -math.inf)
        full[:, ids] = draft
        return full

    def drafts(self, tokens, k):
        """The k greedy drafts after `tokens`: the rows of every computed position (the last
        token not yet through the target), then the head chained on its own states."""
        states = self.target_states(tokens)[:len(tokens) - 1]
        row_tokens, previous = list(tokens[1:]), states
        out = []
        for _ in range(k):
            normed, prenorm = self.rows(row_tokens, previous, torch.arange(len(row_tokens)))
            out.append(int(self.logits(normed[-1:]).argmax()))
            row_tokens.append(out[-1])
            previous = torch.cat([previous, prenorm[-1:]])
        return out


def kvserve_pair(target_dir, head_dir):
    info = load_checkpoint_info(target_dir)
    target = _C.create_causal_lm(info.config, load_weights(target_dir, info.config,
                                                           torch.float32), 64)
    head = eagle3_head(load_eagle3_weights(head_dir, info.config, torch.float32), target, 64)
    return info, target, head


@pytest.fixture(scope="module")
def whole_vocabulary_head(pair, tmp_path_factory):
    """A head over all 16 tokens in the target's order (d2t all zero: no scatter)."""
    return make_eagle3_head(tmp_path_factory.mktemp("whole") / "head", pair[0],
                            draft_vocab_size=VOCAB, aux_layers=AUX, seed=3)


@pytest.mark.parametrize("chunks", [None, (4, 1, 7)], ids=["whole", "chunks"])
@pytest.mark.parametrize("vocabulary", ["draft", "all"])
def test_head_equals_the_torch_port(pair, whole_vocabulary_head, chunks, vocabulary):
    target_dir, head_dir = pair
    if vocabulary == "all":
        head_dir = whole_vocabulary_head
    port = Port(target_dir, head_dir)
    info, target, head = kvserve_pair(target_dir, head_dir)
    n = len(PROMPT)

    def target_forward(batch, _, cache):
        return target.forward(batch.input_ids, batch.positions, batch.metadata, cache)

    hidden = forward_rows(target_forward, info.config, PROMPT, [n])
    states = head.target_states(hidden)
    torch.testing.assert_close(states, port.target_states(PROMPT), rtol=1e-4, atol=1e-4)
    want_normed, want_prenorm = port.rows(PROMPT[1:], states[:n - 1], torch.arange(n - 1))
    outs = []

    def depth0(batch, rows_in, cache):
        normed, prenorm = head.forward_depth(0, batch.input_ids, rows_in, batch.positions,
                                             batch.metadata, cache)
        outs.append(prenorm)
        return normed

    sizes = [n - 1] if chunks is None else [*chunks[:-1], n - 1 - sum(chunks[:-1])]
    normed = forward_rows(depth0, head.config, PROMPT[1:], sizes, states[:n - 1])
    torch.testing.assert_close(normed, want_normed, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(outs), want_prenorm, rtol=1e-4, atol=1e-4)
    logits = head.compute_logits(normed)
    want = port.logits(want_normed)
    assert torch.equal(torch.isinf(logits), torch.isinf(want))  # only draft-vocabulary ids
    torch.testing.assert_close(logits[~torch.isinf(want)], want[~torch.isinf(want)],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [3, 8])
def test_every_step_accepts_the_drafts_the_port_proposes(pair, k):
    """k = 8: chains far deeper than the head's training-time test steps, as deep as the engine
    takes."""
    target_dir, head_dir = pair
    port = Port(target_dir, head_dir)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(target_dir, dtype="float32", log_memory_plan=False)
    final = PROMPT + list(plain.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)
    e = fp32_engine(target_dir, speculative_method="eagle3", speculative_model=head_dir,
                    num_speculative_tokens=k, **UNLIMITED)
    steps, accepted = check_every_step(e, PROMPT, params, final, port.drafts)
    assert steps > 5 and accepted > 0  # the check saw drafts accepted


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_eagle3_equals_plain_decoding(pair, k):
    target_dir, head_dir = pair
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:3], [1, 10, 11, 12]]
    want = [o.outputs[0].token_ids for o in
            LLM(target_dir, dtype="float32").generate(prompts, params, use_tqdm=False)]
    llm = LLM(target_dir, dtype="float32", speculative_method="eagle3",
              speculative_model=head_dir, num_speculative_tokens=k)
    got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == want
    s = llm.llm_engine.get_stats()
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens <= s.num_draft_tokens


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_head_equals_plain_decoding(pair, scheme):
    """speculative_quantization="int8" / "int4": the head's projections and LM head in int8
    (about a quarter of their fp32 bytes) or int4 (groups of 32 inputs here: under a quarter)
    propose; greedy output stays plain decoding's."""
    target_dir, head_dir = pair
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:3], [1, 10, 11, 12]]
    want = [o.outputs[0].token_ids for o in
            LLM(target_dir, dtype="float32").generate(prompts, params, use_tqdm=False)]
    heads = {q: LLM(target_dir, dtype="float32", speculative_method="eagle3",
                    speculative_model=head_dir, num_speculative_tokens=3,
                    speculative_quantization=q) for q in (None, scheme)}
    llm = heads[scheme]
    got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == want
    s = llm.llm_engine.get_stats()
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens <= s.num_draft_tokens
    fp32_bytes = heads[None].llm_engine.draft_model.weight_bytes
    bound = 0.35 if scheme == "int8" else 0.25  # int4: a byte per two, fp32 scales and zeros
    assert llm.llm_engine.draft_model.weight_bytes < bound * fp32_bytes


def test_default_k_is_the_heads_own(pair):
    """Without num_speculative_tokens an EAGLE-3 head drafts its own default k (4), under the
    batch rule the other proposers follow."""
    from kvserve.speculative import (DEFAULT_MAX_VERIFY_TOKENS,
                                     DEFAULT_NUM_SPECULATIVE_TOKENS_BY_METHOD)
    target_dir, head_dir = pair
    spec = LLM(target_dir, dtype="float32", speculative_method="eagle3",
               speculative_model=head_dir).llm_engine.engine.config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.max_verify_tokens) == (
        "eagle3", DEFAULT_NUM_SPECULATIVE_TOKENS_BY_METHOD["eagle3"], DEFAULT_MAX_VERIFY_TOKENS)
    assert spec.num_speculative_tokens == 4


@pytest.fixture(scope="module")
def alone(pair):
    """Each of mixed_requests' outputs decoded alone, without speculation."""
    plain = fp32_engine(pair[0])
    return {str(i): run(plain, [(prompt, n, 0)])["0"]
            for i, (prompt, n, _) in enumerate(mixed_requests(vocab=VOCAB))}


def test_greedy_mixed_arrivals_with_preemption_chunking_and_prefix_caching(pair, alone):
    target_dir, head_dir = pair
    e = fp32_engine(target_dir, num_blocks=24, block_size=BLOCK, max_num_batched_tokens=20,
                    speculative_method="eagle3", speculative_model=head_dir,
                    num_speculative_tokens=3, **UNLIMITED)
    assert run(e, mixed_requests(vocab=VOCAB)) == alone
    s = e.get_stats()
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0 and s.num_accepted_tokens > 0


def test_greedy_output_when_the_batch_rule_pauses_and_resumes_drafting(pair, alone):
    """With the default rule, speculation stops from 4 running sequences on, and the head with it
    (it drops what it held of the target); it resumes from the states of the step it restarts."""
    target_dir, head_dir = pair
    e = fp32_engine(target_dir, speculative_method="eagle3", speculative_model=head_dir,
                    num_speculative_tokens=3)
    phases = []  # per step: whether it drafted; consecutive duplicates merged
    step = e.step

    def recorded_step():
        before = e.get_stats().num_drafts
        outputs = step()
        drafted = e.get_stats().num_drafts > before
        if not phases or phases[-1] != drafted:
            phases.append(drafted)
        return outputs

    e.step = recorded_step
    assert run(e, mixed_requests(vocab=VOCAB)) == alone
    assert e.get_stats().num_accepted_tokens > 0
    assert [True, False, True] in [phases[i:i + 3] for i in range(len(phases))]


def test_sampled_tokens_follow_the_target_distribution(tmp_path):
    from tests.engine.test_speculative_decoding import (FILTERS, SAMPLES, VOCAB,
                                                        chi_square_pvalue, conditionals,
                                                        engine_counts, joint)

    target = make_checkpoint(tmp_path / "target", "LlamaForCausalLM", vocab_size=VOCAB,
                             hidden_size=32, intermediate_size=64, num_attention_heads=2,
                             num_key_value_heads=1, num_hidden_layers=4,
                             initializer_range=0.08, with_tokenizer=False, seed=1)
    head = make_eagle3_head(tmp_path / "head", target, draft_vocab_size=5, aux_layers=[1, 2, 3])
    speculation = dict(speculative_method="eagle3", speculative_model=head,
                       num_speculative_tokens=3, **UNLIMITED)
    for filters in sorted(FILTERS):
        expected = joint(conditionals(target, FILTERS[filters]))
        counts = engine_counts(target, speculation, FILTERS[filters])
        assert chi_square_pvalue(counts, expected, SAMPLES) > 1e-4, filters


def test_bad_heads_are_clear_errors(tmp_path, pair):
    target_dir, head_dir = pair
    with pytest.raises(ValueError, match='speculative_method="eagle3" needs speculative_model'):
        LLM(target_dir, speculative_method="eagle3")
    with pytest.raises(ValueError, match="reads an EAGLE-3 head"):
        LLM(target_dir, speculative_method="eagle3", speculative_model=target_dir)
    wrong = make_eagle3_head(tmp_path / "vocab", target_dir, draft_vocab_size=10, vocab_size=64)
    with pytest.raises(ValueError, match="vocab_size is 64, the target's 16"):
        LLM(target_dir, speculative_method="eagle3", speculative_model=wrong)
    far = make_eagle3_head(tmp_path / "far", target_dir, draft_vocab_size=10, aux_layers=[1, 9, 2])
    with pytest.raises(ValueError, match=r"must be layers in \[0, 4\] of the target"):
        LLM(target_dir, speculative_method="eagle3", speculative_model=far)
    narrow = make_eagle3_head(tmp_path / "narrow", target_dir, draft_vocab_size=10,
                              aux_layers=[1, 2])  # fc over two streams where config says three?
    config = json.loads((narrow / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    (narrow / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="tensor 'fc.weight' has shape"):
        LLM(target_dir, speculative_method="eagle3", speculative_model=narrow)
