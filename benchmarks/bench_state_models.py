"""Decode cost against context length: state-space models (a Mamba2, and a Granite 4 style hybrid
of Mamba2 mixers and two attention layers) against a Llama of similar size. A Mamba2 sequence keeps
a fixed state per layer, so its decode step and its memory should stay flat as the context grows;
a Llama's KV cache and attention reads grow with it; the hybrid's grow as two layers' worth.

Random checkpoints (fp32) of 25-31M parameters without the embedding: a Llama of 8 layers
(hidden 512, 8 heads, 4 KV heads of 64, MLP 1536), a Mamba2 of 16 layers (hidden 512, 16 heads
of 64, 1 group of 128 states; Mamba2's layers have no MLP, so it takes twice as many, as its
paper's models do) and a Granite hybrid of 10 layers (the same mixer in 8, NoPE GQA attention like
the Llama's in layers 4 and 9, an MLP of 1024 in each). For each --contexts length, each model
prefills one request of that many tokens through LLMEngine, then decodes --steps tokens: the
table gives the median decode step, and the bytes the request holds (KV blocks, state slot). The
models alternate at each length, so all see the same drift of the machine.

    python benchmarks/bench_state_models.py [--contexts 1024,4096,16384,32768] [--steps 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import kvserve
from kvserve.testing.bench import cached_checkpoint, machine_info, markdown_table, write_json

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MAX_LEN = 32768 + 64
MODELS = {
    "Llama (8 layers, GQA)": ("LlamaForCausalLM", dict(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=MAX_LEN, tie_word_embeddings=False, initializer_range=0.02)),
    "Mamba2 (16 layers)": ("Mamba2ForCausalLM", dict(
        vocab_size=8192, hidden_size=512, num_hidden_layers=16, num_heads=16, head_dim=64,
        expand=2, n_groups=1, state_size=128, conv_kernel=4, chunk_size=256,
        max_position_embeddings=MAX_LEN, tie_word_embeddings=False, residual_in_fp32=False,
        initializer_range=0.02)),
    "Granite hybrid (10 layers, 2 attention)": ("GraniteMoeHybridForCausalLM", dict(
        vocab_size=8192, hidden_size=512, shared_intermediate_size=1024, num_local_experts=0,
        num_hidden_layers=10, layer_types=["attention" if i in (4, 9) else "mamba"
                                           for i in range(10)],
        num_attention_heads=8, num_key_value_heads=4, mamba_n_heads=16, mamba_d_head=64,
        mamba_expand=2, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4,
        mamba_chunk_size=256, position_embedding_type="nope", max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False, initializer_range=0.02)),
}
SHORT = ["Llama", "Mamba2", "hybrid"]


def checkpoint(name: str) -> Path:
    arch, config = MODELS[name]
    return cached_checkpoint(HERE / ".cache", "state-vs-kv", arch, config, "float32")


def decode(path: Path, context: int, steps: int) -> dict:
    """Prefill `context` tokens, then the median of `steps` decode steps and what the request
    holds in the pool."""
    e = kvserve.LLMEngine(path, dtype="float32", max_num_seqs=1, max_model_len=context + steps + 8,
                          max_num_batched_tokens=2048, enable_prefix_caching=False,
                          log_memory_plan=False)
    e.add_request("long", [1] + [3 + j % 8000 for j in range(context - 1)],
                  kvserve.SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    started = time.perf_counter()
    while not any(out.outputs[0].token_ids for out in e.step()):  # through the prefill
        pass
    prefill_s = time.perf_counter() - started
    kv = e.kv_cache
    held = (kv.state_bytes_per_sequence if kv.layout.num_layers == 0 else
            (e.block_manager.num_usable_blocks() - e.block_manager.num_free_blocks())
            * kv.block_size * kv.bytes_per_token + kv.state_bytes_per_sequence)
    times = []
    while e.has_unfinished_requests():
        started = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - started)
    return dict(decode_ms=statistics.median(times) * 1e3, prefill_s=prefill_s, held_bytes=held,
                weight_bytes=e.model.weight_bytes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contexts", default="1024,4096,16384,32768")
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    results: dict[str, dict[int, dict]] = {name: {} for name in MODELS}
    for context in contexts:
        for name in MODELS:  # alternated at each length
            results[name][context] = decode(checkpoint(name), context, args.steps)
            print(name, context, results[name][context], flush=True)
    names = list(MODELS)
    rows = []
    for context in contexts:
        r = [results[name][context] for name in names]
        rows.append([f"{context:,}"] + [f"{x['decode_ms']:.1f}" for x in r]
                    + [f"{r[0]['decode_ms'] / x['decode_ms']:.2f}x" for x in r[1:]]
                    + [f"{x['held_bytes'] / 2**20:.{1 if i == 0 else 2}f}" for i, x in enumerate(r)]
                    + [f"{x['prefill_s']:.1f}" for x in r])
    columns = (["context tokens"] + [f"{n} decode step ms" for n in SHORT]
               + [f"Llama / {n}" for n in SHORT[1:]]
               + [f"{n} {'KV' if i == 0 else 'KV + state'} MiB" for i, n in enumerate(SHORT)]
               + [f"{n} prefill s" for n in SHORT])
    print(markdown_table(columns, rows))
    weights = {name: results[name][contexts[0]]["weight_bytes"] for name in MODELS}
    info = machine_info()
    path = write_json(RESULTS / "state_models_raw.json",
                      dict(args=vars(args), machine=info, weights=weights,
                           results={n: {str(c): r for c, r in v.items()}
                                    for n, v in results.items()}))
    print(f"wrote {path}")
    section = dict(
        title="State-space models: decode cost against context length",
        command=f"python benchmarks/bench_state_models.py --contexts {args.contexts} "
                f"--steps {args.steps}",
        machine=(f"{info['cpu']} {info['logical_cpus']}-vCPU VM "
                 f"({info['kvserve_cpu_capability']}); torch {info['torch']}"),
        date=time.strftime("%Y-%m-%d"),
        description=(
            "One request at each context length, prefilled then decoded for "
            f"{args.steps} steps (median step), on random fp32 checkpoints of similar size: "
            + ", ".join(f"{name} ({weights[name] / 2**20:.0f} MiB of weights)" for name in names)
            + ". The Mamba2 keeps one fixed state per sequence ([models.md](models.md"
            "#state-space-models-mamba-mamba2-and-hybrids)), the hybrid that state "
            "in its mixer layers and KV in its two attention layers; the Llama's KV cache and "
            "attention reads grow with the context in all 8 layers."),
        tables=[dict(title="Decode step and memory per sequence", columns=columns, rows=rows,
                     description="Per context length: the median decode step of each model, the "
                     "bytes the request holds in the pool after its prefill (KV blocks and state "
                     "slot), and the prefill's time.")])
    path = write_json(RESULTS / "state_models.json", section)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
