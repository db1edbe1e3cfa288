"""DeepSeek-V3's multi-token-prediction (MTP) modules as speculative drafts
(speculative_method="mtp"), on a tiny checkpoint whose two modules the test writes as released
checkpoints store them: each module's outputs equal transformers' MtpModel (which loads the same
files) at every position, fed whole and in chunks (GLM-4.5's too); every step accepts exactly the drafts that
transformers' modules propose; greedy speculative output equals plain decoding, alone and with
mixed arrivals, preemption, chunked prefill and prefix caching, and sampled output follows the
target's distribution; bad pairings are clear errors."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams, _C
from kvserve.config import load_checkpoint_info
from kvserve.loader.mtp_weights import load_mtp_weights, mtp_head
from kvserve.loader.safetensors_loader import load_weights
from kvserve.testing.checkpoints import add_mtp_modules, make_checkpoint
from tests.engine_loop import fp32_engine
from tests.engine_loop import run_arrivals as run

transformers = pytest.importorskip("transformers")

ARCH = "DeepseekV3ForCausalLM"
PROMPT = [1, 17, 5, 9, 42, 7, 30, 12, 8, 3, 25, 14, 6]
BLOCK = 4
UNLIMITED = dict(speculative_disable_batch_size=0, speculative_max_verify_tokens=0)


def two_module_checkpoint(directory, architecture: str = ARCH):
    """Two MTP modules; a vocabulary small enough that random modules' drafts are sometimes
    right."""
    path = make_checkpoint(directory, architecture, vocab_size=48)
    return add_mtp_modules(path, count=2, seed=3)


def load_reference(checkpoint):
    """transformers' model and its MTP modules, read from the checkpoint by MtpModel."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    layers = hf.config.num_hidden_layers
    # transformers finds a checkpoint's modules by the layer numbers of the released models
    # (DeepSeek-V3's 61); this one's follow its two decoder layers.
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layers + d}\..*" for d in (0, 1)]
    return hf, MtpModel.from_pretrained(hf).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return two_module_checkpoint(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)


def reference_rows(reference, tokens: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The target's final hidden states over `tokens`, and each module's outputs over every row
    whose tokens are all known (module d's row j reads token j + d + 1)."""
    from transformers.cache_utils import MtpCache

    hf, mtp = reference
    n = len(tokens)
    with torch.no_grad():
        hidden = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1]
        cache = MtpCache(config=hf.config.get_mtp_config())
        outs, previous = [], hidden[:, :n - 1]
        for d in range(2):
            rows = n - 1 - d
            out = mtp.forward_layer(d, previous[:, :rows], torch.arange(d + 1, n)[None], cache,
                                    input_ids=torch.tensor([tokens[d + 1:]]))
            outs.append(out[0])
            previous = out
    return hidden[0], outs


def reference_drafts(reference, tokens: list[int]) -> list[int]:
    """What transformers' two modules draft after `tokens` (greedy): module 0 from its last row,
    module 1 from its row that reads module 0's draft."""
    from transformers.cache_utils import MtpCache

    hf, mtp = reference
    with torch.no_grad():
        hidden = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1]
        ids, _, _ = mtp(input_ids=torch.tensor([tokens[1:]]), last_hidden_states=hidden[:, :-1],
                        attention_mask=None, position_ids=torch.arange(1, len(tokens))[None],
                        mtp_cache=MtpCache(config=hf.config.get_mtp_config()))
    return ids[0].tolist()


def kvserve_head(checkpoint):
    info = load_checkpoint_info(checkpoint)
    target = _C.create_causal_lm(info.config, load_weights(checkpoint, info.config,
                                                           torch.float32), 64)
    weights = load_mtp_weights(checkpoint, info.hf_config, info.config, torch.float32)
    return info, target, mtp_head(weights, target, 64)


def forward_rows(model_forward, config, tokens: list[int], chunks: list[int], previous=None):
    """Runs `tokens` (positions from 0) through model_forward(batch, rows, cache) in chunks of
    the given sizes over one paged cache; the outputs of every row."""
    cache = _C.PagedKVCache(_C.KVCacheLayout.for_model(config), 16, BLOCK)
    table = list(range(1, 16))
    outs, start = [], 0
    for size in chunks:
        builder = _C.ForwardBatchBuilder(BLOCK)
        builder.add(tokens[start:start + size], start, table)
        batch = builder.build(torch.device("cpu"))
        rows = None if previous is None else previous[start:start + size]
        outs.append(model_forward(batch, rows, cache))
        start += size
    assert start == len(tokens)
    return torch.cat(outs)


@pytest.mark.parametrize("architecture, chunks", [
    (ARCH, None), (ARCH, (5, 1, 6)),
    ("Glm4MoeForCausalLM", (3, 7, 2)),  # GLM-4.5: partial rotary, grouped-query attention
], ids=["whole", "chunks", "glm4-moe"])
def test_modules_equal_transformers_mtp_model(tmp_path, checkpoint, reference, architecture,
                                              chunks):
    if architecture != ARCH:
        checkpoint = two_module_checkpoint(tmp_path, architecture)
        reference = load_reference(checkpoint)
    info, target, head = kvserve_head(checkpoint)
    n = len(PROMPT)
    want_hidden, want = reference_rows(reference, PROMPT)

    def target_forward(batch, _, cache):
        return target.forward(batch.input_ids, batch.positions, batch.metadata, cache)

    hidden = forward_rows(target_forward, info.config, PROMPT, [n])
    # transformers' hidden_states[-1] is after the final norm: what the engine gives the modules.
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-4, atol=1e-4)
    previous = hidden[:n - 1]
    for d in range(2):
        rows = n - 1 - d

        def module(batch, rows_in, cache, d=d):
            for_logits, for_next = head.forward_depth(d, batch.input_ids, rows_in,
                                                      batch.positions, batch.metadata, cache)
            assert for_next is for_logits or torch.equal(for_next, for_logits)  # MTP chains normed
            return for_logits

        # Module d's row j reads token j + d + 1 and sits at position j.
        sizes = [rows] if chunks is None else [*chunks[:-1], rows - sum(chunks[:-1])]
        got = forward_rows(module, head.config, PROMPT[d + 1:], sizes, previous[:rows])
        torch.testing.assert_close(got, want[d], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, d=d: f"module {d}: {m}")
        torch.testing.assert_close(head.compute_logits(got[-1:]),
                                   reference[1]._project_to_logits(want[d][-1:]),
                                   rtol=1e-4, atol=1e-4)
        previous = got


def check_every_step(e, prompt: list[int], params: SamplingParams, final: list[int],
                     propose) -> tuple[int, int]:
    """Steps engine `e` through one greedy request; in every step that drafts, the number of
    drafts it accepted must be where propose(tokens so far, drafts) first differs from the
    output `final`. Returns (steps that drafted, drafts accepted)."""
    e.add_request("0", prompt, params)
    tokens, steps, accepted_total = list(prompt), 0, 0
    while e.has_unfinished_requests():
        before = e.get_stats()
        (out,) = e.step()
        after = e.get_stats()
        drafts = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        if drafts:
            proposed = propose(tokens, drafts)
            rest = final[len(tokens):]
            predicted = next((i for i, (a, b) in enumerate(zip(proposed, rest)) if a != b),
                             len(proposed))
            assert accepted == predicted, (steps, proposed, rest[:drafts])
            accepted_total += accepted
            steps += 1
        tokens = prompt + list(out.outputs[0].token_ids)
    assert tokens == final
    return steps, accepted_total


def test_every_step_accepts_the_drafts_transformers_proposes(checkpoint, reference):
    """One greedy request, two drafts a step (one per module): the drafts accepted in each step
    are those transformers' modules propose after the tokens so far, matched against the output."""
    plain = LLM(checkpoint, dtype="float32", log_memory_plan=False)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    output = plain.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    e = fp32_engine(checkpoint, speculative_method="mtp", num_speculative_tokens=2, **UNLIMITED)
    steps, accepted = check_every_step(
        e, PROMPT, params, PROMPT + output,
        lambda tokens, k: reference_drafts(reference, tokens)[:k])
    assert steps > 5 and accepted > 0  # the check saw drafts accepted


def mixed_requests(count: int = 24, seed: int = 0, vocab: int = 48):
    """(prompt ids, max_tokens, arrival step): half share a 3-block prefix."""
    import random

    rng = random.Random(seed)
    shared = [1] + [rng.randrange(3, vocab) for _ in range(11)]
    requests = []
    for i in range(count):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))]
        requests.append(((shared if i % 2 else [1]) + tail, rng.randrange(8, 40),
                         rng.randrange(0, 8)))
    return requests


@pytest.mark.parametrize("k", [1, 2, 5])
def test_greedy_mtp_equals_plain_decoding(checkpoint, k):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:3], [1, 40, 41, 42]]
    want = [o.outputs[0].token_ids for o in
            LLM(checkpoint, dtype="float32").generate(prompts, params, use_tqdm=False)]
    llm = LLM(checkpoint, dtype="float32", speculative_method="mtp", num_speculative_tokens=k)
    got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == want
    s = llm.llm_engine.get_stats()
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens <= s.num_draft_tokens


def test_greedy_mixed_arrivals_with_preemption_chunking_and_prefix_caching(checkpoint):
    plain = fp32_engine(checkpoint)
    alone = {str(i): run(plain, [(prompt, n, 0)])["0"]
             for i, (prompt, n, _) in enumerate(mixed_requests())}
    e = fp32_engine(checkpoint, num_blocks=24, block_size=BLOCK, max_num_batched_tokens=20,
                    speculative_method="mtp", num_speculative_tokens=3, **UNLIMITED)
    assert run(e, mixed_requests()) == alone
    s = e.get_stats()
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0 and s.num_accepted_tokens > 0


def test_sampled_tokens_follow_the_target_distribution(tmp_path):
    """MTP drafts, drawn from the modules' distributions, against the enumerated target
    distribution (test_speculative_decoding's chi-square test)."""
    from tests.engine.test_speculative_decoding import (FILTERS, NEW_TOKENS, PROMPT as P,
                                                        SAMPLES, VOCAB, chi_square_pvalue,
                                                        conditionals, engine_counts, joint)

    path = make_checkpoint(tmp_path / "tiny", ARCH, vocab_size=VOCAB, with_tokenizer=False,
                           max_position_embeddings=64)
    add_mtp_modules(path, count=1, seed=5)
    speculation = dict(speculative_method="mtp", num_speculative_tokens=2, **UNLIMITED)
    expected = joint(conditionals(path, FILTERS["temperature 1"], torch.float32))
    counts = engine_counts(path, speculation, FILTERS["temperature 1"])
    assert sum(counts.values()) == SAMPLES and len(next(iter(counts))) == NEW_TOKENS and P
    assert chi_square_pvalue(counts, expected, SAMPLES) > 1e-4


def test_bad_pairings_are_clear_errors(tmp_path, checkpoint):
    llama = make_checkpoint(tmp_path / "llama", "LlamaForCausalLM")
    with pytest.raises(ValueError, match="drafts with the multi-token-prediction modules of "
                                         "DeepseekV3ForCausalLM"):
        LLM(llama, speculative_method="mtp")
    bare = make_checkpoint(tmp_path / "bare", ARCH, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="declares no multi-token-prediction modules"):
        LLM(bare, speculative_method="mtp")
    missing = make_checkpoint(tmp_path / "missing", ARCH)  # declares one, holds none
    with pytest.raises(ValueError, match="no tensors of MTP module 0"):
        LLM(missing, speculative_method="mtp")
    with pytest.raises(ValueError, match="speculative_model is a draft model"):
        LLM(checkpoint, speculative_method="mtp", speculative_model=checkpoint)
