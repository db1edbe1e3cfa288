"""What each architecture supports, found by trying: every feature of the support table
(docs/models.md) is run on the architecture's tiny random checkpoint and compared with a
reference, and the outcome (what worked, or the error that refused it) is one cell of the table.

    cell = try_feature("GptOssForCausalLM", "lora", checkpoint_dir, work_dir)

scripts/support_matrix.py runs every cell and writes the table; tests/models/test_support_matrix.py
runs them again and fails when one no longer gives what the table says.

A cell maps each variant tried to "ok" or to why it failed (the error that refused it, its first
sentence). What "ok" means, per feature:

- weights: the checkpoint quantized by `kvserve quantize` (each method) loads, and fed the
  unquantized model's greedy continuation it ranks the same token first at a quarter of the
  positions or more (MIN_AGREEMENT; chance is 1 / vocabulary).
- kv_cache: the same for an int8 / fp8 KV pool.
- lora: a peft adapter on the attention and dense MLP projections that transformers' model has as
  `nn.Linear` (attention's only when those are refused), served per request: its greedy tokens
  equal transformers' with peft's merged weights.
- speculative: n-gram lookup, a draft model (the checkpoint drafting for itself; a Llama of its
  vocabulary for a model with state-space layers) and, for the architectures whose checkpoints
  carry multi-token-prediction modules, those (random modules written into a copy): greedy
  tokens equal plain decoding's.
- prefix_caching: a repeated prompt reuses cached blocks and gives the same tokens (a model with
  state-space layers with 4 state snapshots, its states saved at block boundaries).
- cuda_graphs: whether the engine's resolved config keeps decode graphs for the model (the rule
  the engine applies; replay itself needs a GPU: tests/e2e/test_cuda_engine.py).
- tensor_parallel: two Gloo ranks (`tensor_parallel_size=2`) give plain decoding's greedy tokens.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

FEATURES = ("weights", "kv_cache", "lora", "speculative", "prefix_caching", "cuda_graphs",
            "tensor_parallel")
WEIGHT_METHODS = ("int8", "fp8", "int4", "w8a8", "llm.int8", "awq")
KV_DTYPES = ("int8", "fp8")
# The projections an adapter targets, attention's first: the names transformers' models give them.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj",
                   "input_linear", "output_linear")  # Granite 4's shared MLP

PROMPT = [1, 17, 5, 99, 42, 7, 120, 12, 8, 3, 250, 64, 17, 5, 99, 42]
NEW_TOKENS = 16
# Lossy features: the share of the plain model's greedy tokens they also rank first. Random tiny
# models spread their probability thinly (top tokens near 10%), so rounding flips many argmaxes;
# a broken load agrees on about 1 / vocabulary.
MIN_AGREEMENT = 0.25
OK = "ok"
NOT_APPLICABLE = "n/a"  # the model has no such part (a LoRA scope: no dense MLP)


def _llm(path, **options):
    import kvserve

    return kvserve.LLM(path, dtype=torch.float32, log_memory_plan=False, **options)


def greedy(path, prompt=PROMPT, lora=None, **options) -> list[int]:
    from kvserve import SamplingParams

    llm = _llm(path, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        return llm.generate([prompt], params, use_tqdm=False, lora=lora)[0].outputs[0].token_ids
    finally:
        llm.llm_engine.shutdown()


def refusal(error: Exception) -> str:
    """An error's first sentence, without the paths of the run that raised it or a detail in
    parentheses that the sentence's end cuts."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^/\S+: ", "", text)  # "<path>: <what is wrong with it>"
    text = re.sub(r"(?<![\w/])/(?:[^\s/]+/)+", "", text)  # directories of a path
    text = re.split(r"(?<=[a-z0-9)'])[.:;] ", text)[0].rstrip(".:")
    if text.count("(") > text.count(")"):
        text = text[:text.rfind("(")].rstrip()
    return text


def agreement(path, plain: list[int], prompt=PROMPT, **options) -> float:
    """The share of the plain model's greedy continuation `plain` that the model at `path` (with
    `options`) also ranks first when fed it (teacher-forced: one flip does not derail the rest)."""
    from kvserve import SamplingParams

    llm = _llm(path, **options)
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=1)
        ranked = llm.generate([prompt + plain], params, use_tqdm=False)[0].prompt_logprobs
    finally:
        llm.llm_engine.shutdown()
    firsts = [entry.top[0][0] for entry in ranked[len(prompt):]]
    return sum(a == b for a, b in zip(firsts, plain)) / len(plain)


def _lossy(path, plain: list[int], **options) -> str:
    share = agreement(path, plain, **options)
    return OK if share >= MIN_AGREEMENT else f"agrees with the model on {share:.0%} of tokens"


def _weights(path: Path, work: Path, plain: list[int]) -> dict[str, str]:
    from kvserve.quantization.quantize import quantize_checkpoint

    calibration = work / "calibration.txt"
    calibration.write_text("Once upon a time there was a little engine that served tokens. " * 40)
    cell = {}
    for method in WEIGHT_METHODS:
        out = work / f"quantized-{method}"
        try:
            quantize_checkpoint(path, out, method, group_size=32,
                                calibration=calibration if method == "awq" else None)
            cell[method] = _lossy(out, plain)
        except (ValueError, RuntimeError) as e:
            cell[method] = refusal(e)
    return cell


def _kv_cache(path: Path, work: Path, plain: list[int]) -> dict[str, str]:
    cell = {}
    for dtype in KV_DTYPES:
        try:
            cell[dtype] = _lossy(path, plain, kv_cache_dtype=dtype)
        except (ValueError, RuntimeError) as e:
            cell[dtype] = refusal(e)
    return cell


def _linear_names(model, wanted: tuple[str, ...]) -> list[str]:
    """The full names of `model`'s nn.Linear modules named one of `wanted`, outside experts."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in wanted
            and "expert" not in name]


def _lora(path: Path, work: Path, plain: list[int]) -> dict[str, str]:
    import peft
    import transformers

    from kvserve import LoRARequest

    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    scopes = {"attention": _linear_names(base, ATTENTION_PROJECTIONS),
              "MLP": _linear_names(base, MLP_PROJECTIONS)}
    cell = {}
    for scope, targets in scopes.items():
        if not targets:
            cell[scope] = NOT_APPLICABLE
            continue
        out = work / f"lora-{scope}"
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        exactly = "|".join(re.escape(t) for t in targets)  # a string: matched whole, by peft
        peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                                target_modules=exactly))
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.05)
        peft_model.save_pretrained(out)
        merged = peft_model.merge_and_unload().eval()
        with torch.no_grad():
            want = merged.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(PROMPT):]
        try:
            tokens = greedy(path, lora=LoRARequest(scope, out), enable_lora=True,
                            max_lora_rank=4)
        except (ValueError, RuntimeError) as e:
            cell[scope] = refusal(e)
            continue
        cell[scope] = OK if tokens == want.tolist() else "tokens differ from peft's merged model"
    return cell


def _speculative(path: Path, work: Path, plain: list[int]) -> dict[str, str]:
    import json
    import shutil

    from kvserve.config import load_checkpoint_info
    from kvserve.loader.mtp_weights import MTP_ARCHITECTURES
    from kvserve.testing.checkpoints import add_mtp_modules, make_checkpoint, make_eagle3_head

    cell = {}
    target = load_checkpoint_info(path).config
    # The checkpoint drafts for itself; a model with state-space layers, which a draft cannot
    # have, gets a Llama of its vocabulary.
    draft = (make_checkpoint(work / "draft", "LlamaForCausalLM", vocab_size=target.vocab_size)
             if target.num_ssm_layers() > 0 else path)
    trials = [("n-gram", path, dict(speculative_method="ngram", num_speculative_tokens=3)),
              ("draft model", path, dict(speculative_model=draft, num_speculative_tokens=3))]
    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    if architecture in MTP_ARCHITECTURES:  # the checkpoint with MTP modules written in
        with_modules = work / "mtp"
        shutil.copytree(path, with_modules, dirs_exist_ok=True)
        add_mtp_modules(with_modules, count=1)
        trials.append(("MTP", with_modules, dict(speculative_method="mtp",
                                                 num_speculative_tokens=3)))
    else:
        cell["MTP"] = NOT_APPLICABLE
    # A random EAGLE-3 head in the published layout, reading three of the target's streams.
    config = json.loads((path / "config.json").read_text())
    layers = config.get("num_hidden_layers") or config.get("text_config", {}).get(
        "num_hidden_layers", 2)
    try:
        head = make_eagle3_head(work / "eagle3", path, draft_vocab_size=64,
                                aux_layers=[0, layers // 2, layers - 1])
    except KeyError as e:  # a config without the Llama fields the head copies
        cell["EAGLE-3"] = f"no head for this config: it lacks {e}"
    else:
        trials.append(("EAGLE-3", path, dict(speculative_method="eagle3",
                                             speculative_model=head, num_speculative_tokens=3)))
    for name, checkpoint, options in trials:
        try:
            tokens = greedy(checkpoint, **options)
        except (ValueError, RuntimeError) as e:
            cell[name] = refusal(e)
            continue
        cell[name] = OK if tokens == plain else "tokens differ from plain decoding"
    return cell


def _prefix_caching(path: Path, work: Path, plain: list[int]) -> dict[str, str]:
    from kvserve import SamplingParams

    prompt = [1] + [(7 * i) % 200 + 3 for i in range(40)]  # two full blocks of 16
    llm = _llm(path, enable_prefix_caching=True)
    if llm.llm_engine.config.num_ssm_layers():  # states saved at block boundaries
        llm = _llm(path, enable_prefix_caching=True, num_state_snapshots=4)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first, again = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    if again.num_cached_tokens == 0:
        return {"yes": "a repeated prompt reused no block"}
    if again.outputs[0].token_ids != first.outputs[0].token_ids:
        return {"yes": "a cached prefix changed the tokens"}
    return {"yes": OK}


def _cuda_graphs(path: Path, work: Path, plain: list[int]) -> dict[str, str]:
    from kvserve.config import load_checkpoint_info
    from kvserve.engine_args import EngineArgs

    info = load_checkpoint_info(path)
    resolved = EngineArgs(path, device="cuda").engine_config(  # as on a GPU
        info.config, torch.float32, torch.float32, info.eos_token_ids, None)
    return {"decode": OK if resolved.cuda_graph_max_batch > 0
            else "the engine runs state-space layers' decode steps eagerly"}


def _tensor_parallel(path: Path, work: Path, plain: list[int]) -> dict[str, str]:
    try:
        tokens = greedy(path, tensor_parallel_size=2, distributed_backend="gloo")
    except (ValueError, RuntimeError) as e:
        return {"2 ranks": refusal(e)}
    return {"2 ranks": OK if tokens == plain else "tokens differ from one rank's"}


_TRIALS = {"weights": _weights, "kv_cache": _kv_cache, "lora": _lora,
           "speculative": _speculative, "prefix_caching": _prefix_caching,
           "cuda_graphs": _cuda_graphs, "tensor_parallel": _tensor_parallel}


def try_feature(architecture: str, feature: str, path: str | Path, work: str | Path,
                plain: list[int] | None = None) -> dict[str, str]:
    """The cell of `feature` for the tiny checkpoint of `architecture` at `path` (work: a
    scratch directory). plain: the checkpoint's greedy tokens, when already known."""
    path, work = Path(path), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    plain = plain if plain is not None else greedy(path)
    return _TRIALS[feature](path, work, plain)
