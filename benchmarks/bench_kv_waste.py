"""KV-cache waste: paged blocks vs per-request max-length pre-allocation.

Simulates serving a few hundred requests with a realistic length mix (log-normal prompt and output
lengths, roughly the ShareGPT shape the vLLM paper used, capped at the context) through
kvserve's real PagedBlockManager: up to --max-running requests decode together, one token each per
step, and a finished request's place goes to the next one. At every step it records

    waste = (reserved - used) / reserved

where `used` is the tokens held by running requests and `reserved` is the KV slots set aside for
them: whole blocks for the paged cache (the partly filled last block is the only waste), and
max_model_len slots per request for pre-allocation (what a static engine must reserve, since it
cannot know the output length). Reports the step-weighted mean and the value at peak usage.

Then, per request and sequence length, the KV bytes one request holds in the engine's pool for
models of one shape (24 layers, 8 KV heads of 128, bf16: a 7B-class Llama) that differ only in
how their layers attend: full attention, a 4096-token window everywhere (Mistral), local and
global layers alternating (Gemma 2), five local (window 1024) to one global (Gemma 3), and
cross-layer KV sharing between layer pairs (CLA). The pool is laid out as the engine lays it out
(KVCacheLayout.for_model with sliding-window groups) and the request is driven through the real
PagedBlockManager: a 512-token prompt in one chunk, then one token per step; the bytes are the
blocks it holds times the bytes of a block. The last table divides a 16 GiB KV budget by them:
how many such requests fit at once.

    python benchmarks/bench_kv_waste.py [--requests 300] [--block-sizes 8 16 32]
"""

from __future__ import annotations

import argparse
import math
import random
from collections import deque
from pathlib import Path

import kvserve  # noqa: F401  (loads libtorch before the extension)
from kvserve import _C
from kvserve._C import PagedBlockManager
from kvserve.testing.bench import markdown_table, write_json

RESULTS = Path(__file__).resolve().parent / "results"


def length_mix(n: int, max_model_len: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths: log-normal, medians ~ 100 and ~ 200 tokens, long tails."""
    rng = random.Random(seed)
    mix = []
    for _ in range(n):
        prompt = max(4, min(int(rng.lognormvariate(math.log(100), 0.9)), max_model_len // 2))
        output = max(1, min(int(rng.lognormvariate(math.log(200), 0.8)), max_model_len - prompt))
        mix.append((prompt, output))
    return mix


def simulate(mix, block_size: int, max_running: int, max_model_len: int) -> dict:
    usable = max_running * -(-max_model_len // block_size)  # never the bottleneck here
    manager = PagedBlockManager(usable + 1, block_size, enable_prefix_caching=False, watermark=0.0)
    waiting = deque(enumerate(mix))
    running: dict[int, int] = {}  # seq id -> tokens still to generate
    paged, prealloc = [], []
    peak = (0, 0.0, 0.0)
    rng = random.Random(0)
    while waiting or running:
        while waiting and len(running) < max_running:
            seq_id, (prompt, output) = waiting.popleft()
            manager.allocate(seq_id, [rng.randrange(32000) for _ in range(prompt)])
            manager.mark_computed(seq_id, prompt)
            running[seq_id] = output
        used = sum(manager.num_tokens(s) for s in running)
        reserved_paged = sum(len(manager.block_table(s)) for s in running) * block_size
        reserved_prealloc = len(running) * max_model_len
        paged.append((reserved_paged - used) / reserved_paged)
        prealloc.append((reserved_prealloc - used) / reserved_prealloc)
        if used > peak[0]:
            peak = (used, paged[-1], prealloc[-1])
        for seq_id in list(running):  # one decode step
            manager.append_slots(seq_id, [rng.randrange(32000)])
            manager.mark_computed(seq_id, manager.num_tokens(seq_id))
            running[seq_id] -= 1
            if running[seq_id] == 0:
                manager.free(seq_id)
                del running[seq_id]
    manager.check_invariants()
    assert manager.num_free_blocks() == manager.num_usable_blocks()
    return dict(block_size=block_size, steps=len(paged),
                paged_mean=sum(paged) / len(paged), prealloc_mean=sum(prealloc) / len(prealloc),
                peak_tokens=peak[0], paged_at_peak=peak[1], prealloc_at_peak=peak[2])


LAYERS, KV_HEADS, HEAD_DIM, BYTES = 24, 8, 128, 2  # bf16
VARIANTS = {
    "full attention": dict(windows=[0] * LAYERS),
    "window 4096 (Mistral)": dict(windows=[4096] * LAYERS),
    "1:1 local 4096 / global (Gemma 2)": dict(
        windows=[4096 if i % 2 == 0 else 0 for i in range(LAYERS)]),
    "5:1 local 1024 / global (Gemma 3)": dict(
        windows=[1024 if (i + 1) % 6 else 0 for i in range(LAYERS)]),
    "CLA, layer pairs share KV": dict(windows=[0] * LAYERS,
                                      sources=[i - i % 2 for i in range(LAYERS)]),
}
LENGTHS = [1024, 4096, 8192, 16384, 32768]
BUDGET = 16 << 30


def variant_config(windows, sources=None) -> _C.ModelConfig:
    c = _C.ModelConfig()
    c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size = (
        "LlamaForCausalLM", 32000, 4096, 11008)
    c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim = LAYERS, 32, KV_HEADS, HEAD_DIM
    c.max_position_embeddings = max(LENGTHS)
    c.sliding_windows = windows
    if sources:
        c.kv_sources = sources
    c.validate()
    return c


def bytes_per_request(config: _C.ModelConfig, block_size: int = 16) -> dict[int, int]:
    """{sequence length: KV bytes the request holds} through the engine's pool layout."""
    import torch

    layout = _C.KVCacheLayout.for_model(config, True)
    block_bytes = _C.PagedKVCache.bytes_per_block(layout, block_size, torch.bfloat16)
    usable = len(layout.group_windows()) * (max(LENGTHS) // block_size + 2)
    m = PagedBlockManager(usable + 1, block_size, enable_prefix_caching=False, watermark=0.0,
                          group_windows=layout.group_windows())
    prompt = 512
    m.allocate(0, [7] * prompt, num_scheduled=prompt)
    m.mark_computed(0, prompt)
    held, length = {}, prompt
    for target in LENGTHS:
        while length < target:
            m.append_slots(0, [7])
            length += 1
            m.mark_computed(0, length)
        held[target] = (m.num_usable_blocks() - m.num_free_blocks()) * block_bytes
    m.check_invariants()
    return held


def per_request_tables() -> tuple[str, str, dict]:
    results = {name: bytes_per_request(variant_config(**v)) for name, v in VARIANTS.items()}
    full = results["full attention"]
    rows = [[name] + [f"{held[n] / 2**20:,.0f} MiB ({full[n] / held[n]:.1f}x)" for n in LENGTHS]
            for name, held in results.items()]
    memory = markdown_table(["layers attend"] + [f"{n:,} tokens" for n in LENGTHS], rows)
    rows = [[name] + [f"{BUDGET // held[n]:,}" for n in LENGTHS] for name, held in results.items()]
    capacity = markdown_table(["layers attend"] + [f"{n:,} tokens" for n in LENGTHS], rows)
    return memory, capacity, results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    mix = length_mix(args.requests, args.max_model_len, args.seed)
    prompts = sorted(m[0] for m in mix)
    outputs = sorted(m[1] for m in mix)
    print(f"{args.requests} requests, up to {args.max_running} running, max_model_len "
          f"{args.max_model_len}; prompt tokens median {prompts[len(mix) // 2]} / max "
          f"{prompts[-1]}, output tokens median {outputs[len(mix) // 2]} / max {outputs[-1]}")
    results = [simulate(mix, bs, args.max_running, args.max_model_len) for bs in args.block_sizes]
    rows = [[r["block_size"], f"{r['paged_mean'] * 100:.2f}%", f"{r['paged_at_peak'] * 100:.2f}%",
             f"{r['prealloc_mean'] * 100:.1f}%", f"{r['prealloc_at_peak'] * 100:.1f}%"]
            for r in results]
    print(markdown_table(["block size", "paged waste (mean)", "paged waste (at peak)",
                          "pre-allocated waste (mean)", "pre-allocated waste (at peak)"], rows))
    memory, capacity, per_request = per_request_tables()
    print(f"\nKV bytes one request holds ({LAYERS} layers, {KV_HEADS} KV heads x {HEAD_DIM}, "
          f"bf16, blocks of 16), and how much less than full attention:")
    print(memory)
    print(f"\nRequests of that length that fit in a {BUDGET >> 30} GiB KV budget at once:")
    print(capacity)
    path = write_json(RESULTS / "kv_waste.json", dict(args=vars(args), results=results,
                                                      per_request=per_request))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
