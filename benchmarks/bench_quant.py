"""Weight-only quantization: what fewer bytes buy in decode, against bf16, llama.cpp and the
memory limit.

1. Op: `quantized_linear` (int8, int4 groups of 128 and of 32, fp8; int8 and int4 also with
   quantize_input, "a8": inputs rounded to int8 blocks, integer dot products) against `linear`
   (fp32, bf16, on the weights packed as the engine keeps them) on one [n, k] projection for 1,
   2, 4 and 8 tokens: milliseconds, speed-up over bf16, and weight GB/s against a `torch.sum`
   read of 1 GiB (`memory_read_bandwidth`). Variants interleaved per repeat; medians. `--only
   prefill`: the same for 32, 128 and 512 tokens with bf16 activations (as a bf16 model runs),
   where W8A8 (int8 activations per token) runs int8 x int8.
2. Model: batch-1 greedy decode (TPOT over --decode-tokens tokens of an 8-token prompt) of one
   random checkpoint quantized each way by `kvserve quantize`: fp32, bf16, int8, fp8, int4 (g128
   and g32), int8 and int4 both "exact" and "a8" (quantized_activation), and int8 / int4 with
   the LM head quantized too ("+head", `--lm-head`, a8); the quantized ones run in bf16 like the
   bf16 baseline (activations, embeddings, LM head unless quantized); and kvserve loading
   llama.cpp's Q8_0, Q4_0 and Q4_K_M files as they are ("GGUF a8"). Weights in MB as the engine
   holds them, TPOT, speed-up over bf16, weight GB/s (bytes held / TPOT) and its share of the
   bandwidth probe (taken before every round and after the last; a row's share is the median
   over rounds of its rate against its round's probes). In the same run, llama.cpp
   (llama-cpp-python) on the same weights as F32, BF16, Q8_0, Q4_0 and Q4_K_M GGUF files
   (benchmarks/llama_cpp_peer.py; its file size as MB). Variants interleaved per repeat; medians.
   `--only throughput`: batched greedy decode of --batch sequences, tokens per second, the same
   variants and llama.cpp's batched decoding.

3. Quality: perplexity of the trained models (models/shakespeare-target on the held-out last 10%
   of Tiny Shakespeare; stories260K, converted from ../shared/data, on the second half of the
   TinyStories validation sample) in fp32 and quantized each way at groups of 32 (the group size
   both models' shapes allow), AWQ calibrated on training text (the first 200,000 characters of
   Tiny Shakespeare; the first half of the TinyStories sample), against round to nearest int4;
   and with fp32 weights over an int8 / fp8 KV cache ("kv int8", "kv fp8").
4. KV cache: `paged_attention` decode of a batch at long context over caches of fp32, bf16,
   int8 and fp8 entries (bf16 queries for the last three): milliseconds, cache GB/s, speed-up
   over bf16, and the tokens a 1 GiB pool holds.
5. MoE: `fused_moe` (bf16 experts, packed as the engine keeps them) against `fused_moe_quantized`
   (int8, int4 g128, fp8 experts; bf16 activations) on one Qwen1.5-MoE / DeepSeek-V2-Lite-sized
   layer (--moe-experts experts of [1408, 2048], top --moe-top-k, 16 and 4 by default) for 1, 4
   and 16 tokens: milliseconds, speed-up over bf16, and GB/s of the expert weights the tokens
   touch.

    python benchmarks/bench_quant.py [--model tinyllama-1.1b | llama-100m] [--repeats 3]
        [--llama-cpp-convert path/to/convert_hf_to_gguf.py]
    python benchmarks/bench_quant.py --quick          # small shapes, a smoke run
    python benchmarks/bench_quant.py --only perplexity
    python benchmarks/bench_quant.py --only moe
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import kvserve
from kvserve.quantization import quantize_fp8, quantize_int4, quantize_int8
from kvserve.quantization.quantize import quantize_checkpoint
from kvserve.testing.bench import (cached_checkpoint, machine_info, markdown_table,
                                   memory_read_bandwidth, write_json)

import llama_cpp_peer  # noqa: E402  (benchmarks/, beside this file)

HERE = Path(__file__).resolve().parent
ops = torch.ops.kvserve
COMMON = dict(initializer_range=0.02, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, max_position_embeddings=2048)
MODELS = {  # memory-bound shapes
    "tinyllama-1.1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                           num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4),
    "llama-100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                       num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
    "quick": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
}
METHODS = ("int8", "w8a8", "llm.int8", "fp8", "int4")


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def op_variants(n: int, k: int, activations: torch.dtype) -> dict[str, tuple[object, int]]:
    """name -> (function of x, weight bytes); weight-only quantized weights take x in
    `activations` (LLM.int8() and W8A8 in bf16)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) / k ** 0.5
    plain = {}
    for dtype in (torch.float32, torch.bfloat16):
        wd = w.to(dtype)
        packed = ops.linear_prepack(wd)
        plain[dtype] = (wd if packed is None else packed, wd.nbytes)
    q = {"int8": quantize_int8(w), "fp8": quantize_fp8(w), "int4": quantize_int4(w, 128)}

    def quantized(qw, int8_input=False):
        z = qw.zeros
        return lambda x: ops.quantized_linear(x.to(activations), qw.qweight, qw.scales, z,
                                              qw.group_size, None, int8_input)

    int8 = q["int8"]
    int8_scales = int8.scales.view(-1).contiguous()
    fp32, bf16 = plain[torch.float32], plain[torch.bfloat16]
    out = {"fp32": (lambda x: ops.linear(x, fp32[0], None), fp32[1]),
           "bf16": (lambda x: ops.linear(x.bfloat16(), bf16[0], None), bf16[1])}
    q["int4 g32"] = quantize_int4(w, 32)  # Q4_0's groups
    for name, qw in q.items():
        extra = qw.scales.nbytes + (qw.zeros.nbytes if qw.zeros is not None else 0)
        out[name] = (quantized(qw), qw.qweight.nbytes + extra)
        if name != "fp8":  # inputs rounded to int8 blocks, integer dot products
            out[name + " a8"] = (quantized(qw, True), qw.qweight.nbytes + extra)
    out["llm.int8"] = (
        lambda x: ops.llm_int8_linear(x.bfloat16(), int8.qweight, int8_scales, 6.0, None),
        int8.qweight.nbytes + int8.scales.nbytes)
    out["w8a8"] = (  # the same op with no outliers: every activation rounded to int8 per token
        lambda x: ops.llm_int8_linear(x.bfloat16(), int8.qweight, int8_scales, 0.0, None),
        int8.qweight.nbytes + int8.scales.nbytes)
    return out


def bench_op(args, tokens=(1, 2, 4, 8), activations=torch.float32, calls=50) -> list[list]:
    n, k = args.op_shape
    variants = op_variants(n, k, activations)
    bandwidth = memory_read_bandwidth()
    rows = []
    for m in tokens:
        x = torch.randn(m, k)
        runs = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, (fn, _) in variants.items():
                runs[name].append(timed(lambda: fn(x), calls))
        bf16 = statistics.median(runs["bf16"])
        for name, (_, nbytes) in variants.items():
            t = statistics.median(runs[name])
            rows.append([m, name, f"{nbytes / 2**20:.1f}", f"{t * 1e3:.3f}", f"{bf16 / t:.2f}x",
                         f"{nbytes / t / 1e9:.1f}", f"{nbytes / t / bandwidth:.2f}"])
    print(f"\nquantized_linear [{n}, {k}], weight-only with {activations} activations, "
          f"{args.repeats} repeats; torch.sum reads "
          f"{bandwidth / 1e9:.1f} GB/s:")
    print(markdown_table(["tokens", "weight", "MiB", "ms", "vs bf16", "GB/s", "of torch.sum"],
                         rows))
    return rows


def bench_prefill(args) -> list[list]:
    """The op table at prefill sizes, where W8A8's int8 x int8 product competes with the
    dequantize-and-GEMM path of weight-only int8; bf16 activations as a bf16 model runs them."""
    return bench_op(args, tokens=(32, 128, 512), activations=torch.bfloat16, calls=5)


def checkpoints(args) -> dict[str, tuple[Path, str, str]]:
    """variant -> (directory, dtype to run it in, quantized_activation). int8 / int4 run both
    ways: "exact" (the dequantizing GEMV) and "a8" (inputs rounded to int8 blocks, integer dot
    products: the default on a CPU); int4 also at groups of 32, Q4_0's."""
    cfg = {**COMMON, **MODELS[args.model]}
    base = cached_checkpoint(args.cache_dir, "quant-" + args.model, "LlamaForCausalLM", cfg,
                             "float32")
    out = {"fp32": (base, "float32", "exact"), "bf16": (base, "bfloat16", "exact")}
    specs = [*((m, 128, False) for m in METHODS), ("int4", 32, False),
             ("int8", 128, True), ("int4", 128, True), ("int4", 32, True)]
    for method, group, head in specs:
        suffix = (method + (f"-g{group}" if group != 128 else "")
                  + ("+head" if head else ""))
        path = base.with_name(base.name + "-" + suffix)
        if not (path / "config.json").is_file():
            print(f"quantizing {path.name} ...", flush=True)
            quantize_checkpoint(base, path, method, group_size=group, lm_head=head)
        # activations, norms, embeddings (and the LM head but with --lm-head) as bf16
        if head:
            out[suffix + " a8"] = (path, "bfloat16", "int8")
        elif method in ("int8", "int4"):
            out[suffix + " exact"] = (path, "bfloat16", "exact")
            out[suffix + " a8"] = (path, "bfloat16", "int8")
        else:
            out[suffix] = (path, "bfloat16", "exact")
    return out


def decode_tpot(path: Path, dtype: str, args, prompt: list[int],
                activation: str = "exact") -> tuple[float, int, int]:
    """(TPOT, bytes of weights held, of which the embedding's) of a batch-1 greedy decode."""
    llm = kvserve.LLM(path, dtype=dtype, max_model_len=len(prompt) + args.decode_tokens,
                      enable_prefix_caching=False, max_num_seqs=1,
                      quantized_activation=activation)
    params = kvserve.SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate([prompt], kvserve.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    out = llm.generate([prompt], params)[0]
    nbytes, embedding = llm.model.weight_bytes, llm.model.embedding_bytes
    del llm
    gc.collect()
    return out.metrics.time_per_output_token, nbytes, embedding


def llama_cpp_peer_of(name: str) -> str | None:
    """The llama.cpp format a kvserve row of bench_model compares with: the same bits (int4 in
    groups of 128 against Q4_0 too), or the same file."""
    if name.startswith("llama.cpp"):
        return None
    if name.endswith(" GGUF a8"):
        return name.split()[0]
    if name in ("fp32", "bf16"):
        return {"fp32": "F32", "bf16": "BF16"}[name]
    return "Q4_0" if name.startswith("int4") else "Q8_0"


def bench_model(args) -> list[list]:
    paths = checkpoints(args)
    prompt = [1] + list(range(3, 10))  # 8 tokens: the GEMV's path in every format
    script = llama_cpp_peer.convert_script(args.llama_cpp_convert)
    gguf = llama_cpp_peer.gguf_files(paths["fp32"][0], script) if script else {}
    if not script:
        print("llama.cpp columns left out: needs llama-cpp-python and --llama-cpp-convert "
              "(see benchmarks/llama_cpp_peer.py)")
    for fmt in ("Q8_0", "Q4_0", "Q4_K_M"):  # kvserve reading llama.cpp's own files
        if fmt in gguf:
            paths[f"{fmt} GGUF a8"] = (gguf[fmt], "bfloat16", "int8")
    runs = {name: [] for name in [*paths, *(f"llama.cpp {f}" for f in gguf)]}
    weights = {f"llama.cpp {f}": path.stat().st_size for f, path in gguf.items()}
    # Bytes a decode step reads: what is held but the embedding, of which it reads one row
    # (kvserve's as its model holds it: a GGUF file's quantized embedding stays quantized).
    embedding = {f"llama.cpp {f}": llama_cpp_peer.tensor_bytes(path, "token_embd.weight")
                 for f, path in gguf.items()}
    threads = torch.get_num_threads()
    # The probe before every round and after the last: a row's share of it is taken against its
    # own round's (the mean of the probes either side), since this VM's bandwidth moves by up to
    # 1.6x within a run.
    bandwidth = [memory_read_bandwidth()]
    for _ in range(args.repeats):
        if len(bandwidth) > 1:
            print(f"probe {bandwidth[-1] / 1e9:.1f} GB/s", flush=True)
        for name, (path, dtype, activation) in paths.items():
            tpot, weights[name], embedding[name] = decode_tpot(path, dtype, args, prompt,
                                                               activation)
            runs[name].append(tpot)
            print(name, f"{tpot * 1e3:.1f} ms", flush=True)
        for fmt, path in gguf.items():
            tpot = llama_cpp_peer.decode_tpot(path, prompt, args.decode_tokens, threads)
            runs[f"llama.cpp {fmt}"].append(tpot)
            print(f"llama.cpp {fmt}", f"{tpot * 1e3:.1f} ms", flush=True)
        bandwidth.append(memory_read_bandwidth())
    round_probe = [(a + b) / 2 for a, b in zip(bandwidth, bandwidth[1:])]
    peer = {name: statistics.median(r) for name, r in runs.items() if name.startswith("llama")}
    rows = []
    for name, r in runs.items():
        t = statistics.median(r)
        read = weights[name] - embedding[name]
        rate = read / t  # every weight byte but the embedding's read once per token
        # Against bf16 and llama.cpp: the median of each round's ratio, so that the VM's drift
        # from one round to the next does not enter it.
        over_bf16 = statistics.median(b / k for b, k in zip(runs["bf16"], r))
        peer_runs = runs.get(f"llama.cpp {llama_cpp_peer_of(name)}")
        versus = (f"{statistics.median(p / k for p, k in zip(peer_runs, r)):.2f}x "
                  f"{llama_cpp_peer_of(name)}" if peer_runs else "")
        share = statistics.median(read / k / b for k, b in zip(r, round_probe))
        rows.append([name, f"{weights[name] / 1e6:.0f}", f"{read / 1e6:.0f}", f"{t * 1e3:.1f}",
                     f"{over_bf16:.2f}x", versus, f"{rate / 1e9:.1f}", f"{share:.2f}"])
    print(f"\n{args.model}: batch-1 decode, {args.decode_tokens} tokens after an 8-token prompt, "
          f"medians of {args.repeats}; torch.sum reads "
          f"{', '.join(f'{b / 1e9:.1f}' for b in bandwidth)} GB/s before each round and after "
          f"the last; peers: "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in peer.items()))
    print(markdown_table(["weights", "MB held", "MB read a token", "TPOT ms", "vs bf16",
                          "vs llama.cpp", "weight GB/s", "of probe"], rows))
    return rows


PPL_METHODS = ("int8", "w8a8", "llm.int8", "fp8", "int4", "awq")
# Weight-only methods whose projections can take int8 inputs (quantized_activation="int8").
A8_METHODS = ("int8", "int4", "awq")


def bench_throughput(args) -> list[list]:
    """Batched greedy decode: args.batch 8-token prompts, args.decode_tokens each, output tokens
    per second from submission to the last token (prefill included). kvserve: LLM.generate of
    the batch (continuous batching, every sequence in each step); llama.cpp: one llama_decode
    per step over a batch of all sequences. Each variant loads once, warms up, then times
    args.repeats runs; medians."""
    paths = checkpoints(args)
    prompts = [[1] + [3 + (7 * i + j) % 1000 for j in range(7)] for i in range(args.batch)]
    script = llama_cpp_peer.convert_script(args.llama_cpp_convert)
    gguf = llama_cpp_peer.gguf_files(paths["fp32"][0], script) if script else {}
    threads = torch.get_num_threads()
    params = kvserve.SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    rates = {}
    for name, (path, dtype, activation) in paths.items():
        llm = kvserve.LLM(path, dtype=dtype, max_model_len=8 + args.decode_tokens,
                          enable_prefix_caching=False, max_num_seqs=args.batch,
                          quantized_activation=activation, log_memory_plan=False)
        llm.generate(prompts, kvserve.SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        runs = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            runs.append(args.batch * args.decode_tokens / (time.perf_counter() - started))
        rates[name] = statistics.median(runs)
        print(name, f"{rates[name]:.1f} tokens/s", flush=True)
        del llm
        gc.collect()
    for fmt, path in gguf.items():
        llama_cpp_peer.batched_throughput(path, prompts, 2, threads)  # warm-up
        rates[f"llama.cpp {fmt}"] = statistics.median(
            llama_cpp_peer.batched_throughput(path, prompts, args.decode_tokens, threads)
            for _ in range(args.repeats))
        print(f"llama.cpp {fmt}", f"{rates[f'llama.cpp {fmt}']:.1f} tokens/s", flush=True)
    rows = [[name, f"{rate:.1f}", f"{rate / rates['bf16']:.2f}x"] for name, rate in rates.items()]
    print(f"\nbatched greedy decode, {args.batch} sequences x {args.decode_tokens} tokens, "
          f"medians of {args.repeats}:")
    print(markdown_table(["weights", "tokens/s", "vs kvserve bf16"], rows))
    return rows


def text_splits(data: Path, cache: Path,
                stdlib: Path | None = None) -> dict[str, tuple[Path, Path, Path]]:
    """model -> (checkpoint, calibration text, evaluation text). stdlib: the stdlib pair's
    target (scripts/build_speculative_pair.sh), evaluated on the first 120,000 characters of its
    own held-out 10% of the standard library's sources, calibrated on the first 200,000 of its
    training 90%."""
    from kvserve.convert.llama2c import convert_llama2c

    cache.mkdir(parents=True, exist_ok=True)
    shakespeare = (data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    (cache / "shakespeare-calibration.txt").write_text(shakespeare[:200_000])
    (cache / "shakespeare-validation.txt").write_text(shakespeare[-111_558:])
    stories = (data / "tinystories-sample" / "TinyStories-valid.txt").read_text(encoding="utf-8")
    (cache / "stories-calibration.txt").write_text(stories[:len(stories) // 2])
    (cache / "stories-evaluation.txt").write_text(stories[len(stories) // 2:])
    stories260k = cache / "stories260K"
    if not (stories260k / "config.json").is_file():
        convert_llama2c(data / "stories260K" / "stories260K.bin",
                        data / "stories260K" / "tok512.bin", stories260k)
    out = {
        "shakespeare-target": (HERE.parent / "models" / "shakespeare-target",
                               cache / "shakespeare-calibration.txt",
                               cache / "shakespeare-validation.txt"),
        "stories260K": (stories260k, cache / "stories-calibration.txt",
                        cache / "stories-evaluation.txt"),
    }
    if stdlib is not None:
        from kvserve.training import read_split

        # scripts/train_tiny.py --corpus stdlib: this Python's sources, cached here
        corpus = (Path.home() / ".cache" / "kvserve"
                  / "python{}.{}-stdlib.txt".format(*sys.version_info[:2]))
        if not corpus.is_file():
            raise SystemExit(f"{corpus} not found: scripts/train_tiny.py --corpus stdlib writes it")
        train, held_out = read_split(corpus)
        (cache / "stdlib-calibration.txt").write_text(train[:200_000])
        (cache / "stdlib-evaluation.txt").write_text(held_out[:120_000])
        out["stdlib-target"] = (stdlib, cache / "stdlib-calibration.txt",
                                cache / "stdlib-evaluation.txt")
    return out


def perplexity(path: Path, text: Path, kv_cache_dtype: str = "auto",
               activation: str = "exact") -> float:
    from kvserve.perplexity import evaluate_perplexity

    # 512-token windows (511 for stories260K, whose context is 512), and room for the token
    # each window's request samples.
    context = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    window = min(512, context - 1)
    llm = kvserve.LLM(path, dtype="float32", max_model_len=window + 1,
                      kv_cache_dtype=kv_cache_dtype, quantized_activation=activation,
                      log_memory_plan=False)
    ids = llm.tokenizer.encode(text.read_text(encoding="utf-8"))
    return evaluate_perplexity(llm, ids, max_length=window, stride=window // 2).perplexity


def bench_perplexity(args) -> list[list]:
    data = Path(os.environ.get("KVSERVE_SHARED_DATA", HERE.parent.parent / "shared" / "data"))
    rows = []
    splits = text_splits(data, args.cache_dir / "ppl", args.ppl_stdlib)
    for name, (path, calibration, evaluation) in splits.items():
        if args.ppl_models and name not in args.ppl_models:
            continue
        base = perplexity(path, evaluation)
        results = {"fp32": base}
        for method in PPL_METHODS:
            out = args.cache_dir / "ppl" / f"{name}-{method}-g32"
            if not (out / "config.json").is_file():
                quantize_checkpoint(path, out, method, 32,
                                    calibration if method == "awq" else None)
            results[method] = perplexity(out, evaluation)
            if method in A8_METHODS:  # the same weights, inputs rounded to int8 blocks
                results[method + " a8"] = perplexity(out, evaluation, activation="int8")
        for kv, dtype in (("kv int8", "int8"), ("kv fp8", "fp8")):
            results[kv] = perplexity(path, evaluation, dtype)  # fp32 weights
        rtn_gap = results["int4"] - base
        for method, ppl in results.items():
            recovered = (f"{1 - (ppl - base) / rtn_gap:.0%}" if method == "awq" and rtn_gap > 0
                         else "")
            weights = method.removesuffix(" a8")
            a8 = (f"{ppl / results[weights] - 1:+.3%}" if method.endswith(" a8") else "")
            rows.append([name, method, f"{ppl:.4f}", f"{ppl / base - 1:+.2%}", recovered, a8])
        print(name, results, flush=True)
    print("\nperplexity, fp32 compute, weights quantized at groups of 32 (int4, awq):")
    print(markdown_table(["model", "weights", "perplexity", "vs fp32",
                          "of int4's loss AWQ wins back", "int8 inputs vs exact"], rows))
    return rows


def kv_variants(args) -> dict[str, tuple]:
    """name -> (query, key cache, value cache, key scales, value scales) of a TinyLlama-shaped
    layer (32 query heads, 4 KV heads of 64) for args.kv_batch sequences of args.kv_context."""
    from kvserve.testing.reference import quantize_kv_rows

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block = 32, 4, 64, 16
    num_blocks = args.kv_batch * args.kv_context // block + 1
    keys = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g)
    values = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g)
    query = torch.randn(args.kv_batch, heads, head_dim, generator=g)
    out = {"fp32": (query, keys, values, None, None),
           "bf16": (query.bfloat16(), keys.bfloat16(), values.bfloat16(), None, None)}
    for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        (kq, ks), (vq, vs) = quantize_kv_rows(keys, dtype), quantize_kv_rows(values, dtype)
        out[name] = (query.bfloat16(), kq, vq, ks, vs)
    return out


def bench_kv(args) -> list[list]:
    variants = kv_variants(args)
    block = 16
    per_seq = args.kv_context // block
    tables = (torch.randperm(args.kv_batch * per_seq, generator=torch.Generator().manual_seed(1))
              + 1).int().view(args.kv_batch, per_seq)
    meta = (torch.arange(args.kv_batch + 1, dtype=torch.int32),
            torch.full((args.kv_batch,), args.kv_context, dtype=torch.int32), tables)
    runs = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (q, kc, vc, ks, vs) in variants.items():
            out = torch.empty_like(q)
            runs[name].append(timed(lambda: ops.paged_attention(
                out, q, kc, vc, *meta, 0.125, 0, 0.0, ks, vs), 20))
    bf16 = statistics.median(runs["bf16"])
    rows = []
    for name, (_, kc, vc, ks, vs) in variants.items():
        t = statistics.median(runs[name])
        nbytes = sum(x.nbytes for x in (kc, vc, ks, vs) if x is not None)
        per_token = nbytes / (kc.size(0) * block)
        rows.append([name, f"{per_token:.0f}", f"{t * 1e3:.2f}", f"{bf16 / t:.2f}x",
                     f"{nbytes / t / 1e9:.1f}", f"{2**30 / per_token / 1e6:.2f}"])
    print(f"\npaged_attention decode, {args.kv_batch} sequences x {args.kv_context} tokens, "
          f"32 query / 4 KV heads of 64 (one layer), medians of {args.repeats}:")
    print(markdown_table(["KV entries", "bytes/token", "ms", "vs bf16", "cache GB/s",
                          "M tokens per GiB"], rows))
    return rows


def moe_variants(args) -> dict[str, tuple[object, float]]:
    """name -> (function of (x, weights, ids), bytes of one expert's weights)."""
    hidden, inter = 2048, 1408
    g = torch.Generator().manual_seed(0)
    w13 = [torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5
           for _ in range(args.moe_experts)]
    w2 = [torch.randn(hidden, inter, generator=g) / inter ** 0.5 for _ in range(args.moe_experts)]
    def engine_form(w):  # as SparseMoE keeps it: packed where the device's GEMM has a layout
        packed = ops.linear_prepack(w.bfloat16())
        return w.bfloat16() if packed is None else packed
    plain13, plain2 = [engine_form(w) for w in w13], [engine_form(w) for w in w2]
    out = {"bf16": (lambda x, tw, ti: ops.fused_moe(x, plain13, plain2, tw, ti),
                    (w13[0].numel() + w2[0].numel()) * 2)}
    for name, quantize in (("int8", quantize_int8), ("fp8", quantize_fp8),
                           ("int4", lambda w: quantize_int4(w, 128))):
        a, b = [quantize(w) for w in w13], [quantize(w) for w in w2]

        def lists(qs):
            return ([q.qweight for q in qs], [q.scales for q in qs],
                    [q.zeros for q in qs if q.zeros is not None], qs[0].group_size)
        la, lb = lists(a), lists(b)
        nbytes = sum(t.nbytes for q in (a[0], b[0]) for t in (q.qweight, q.scales, q.zeros)
                     if t is not None)
        out[name] = ((lambda la, lb: lambda x, tw, ti: ops.fused_moe_quantized(
            x, *la, *lb, tw, ti))(la, lb), nbytes)
    del w13, w2
    return out


def bench_moe(args) -> list[list]:
    variants = moe_variants(args)
    rows = []
    for m in (1, 4, 16):
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, 2048, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(args.moe_experts, generator=g)[:args.moe_top_k]
                           for _ in range(m)])
        tw = torch.rand(m, args.moe_top_k, generator=g)
        touched = len(ids.unique())
        runs = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, (fn, _) in variants.items():
                runs[name].append(timed(lambda: fn(x, tw, ids), 10))
        bf16 = statistics.median(runs["bf16"])
        for name, (_, nbytes) in variants.items():
            t = statistics.median(runs[name])
            rows.append([m, touched, name, f"{t * 1e3:.2f}", f"{bf16 / t:.2f}x",
                         f"{touched * nbytes / t / 1e9:.1f}"])
    print(f"\nfused_moe, {args.moe_experts} experts of [1408, 2048], top-{args.moe_top_k}, "
          f"medians of {args.repeats}:")
    print(markdown_table(["tokens", "experts touched", "experts", "ms", "vs bf16", "GB/s"], rows))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tinyllama-1.1b", choices=list(MODELS))
    p.add_argument("--op-shape", type=int, nargs=2, default=[5632, 2048], metavar=("N", "K"))
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache-dir", type=Path, default=HERE / ".cache")
    p.add_argument("--only", choices=["op", "prefill", "model", "throughput", "perplexity", "kv",
                                             "moe"], default=None)
    p.add_argument("--batch", type=int, default=16, help="sequences of --only throughput")
    p.add_argument("--moe-experts", type=int, default=16)
    p.add_argument("--moe-top-k", type=int, default=4)
    p.add_argument("--kv-batch", type=int, default=8)
    p.add_argument("--kv-context", type=int, default=4096)
    p.add_argument("--ppl-models", nargs="*", default=None,
                   help="--only perplexity: these models only (shakespeare-target, stories260K)")
    p.add_argument("--ppl-stdlib", type=Path, default=None, metavar="DIR",
                   help="--only perplexity: also the stdlib pair's target in DIR "
                        "(scripts/build_speculative_pair.sh)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--llama-cpp-convert", default=None, metavar="convert_hf_to_gguf.py",
                   help="llama.cpp's converter: adds llama.cpp F32 / BF16 / Q8_0 / Q4_0 to the "
                        "model table (default: $LLAMA_CPP_CONVERT)")
    args = p.parse_args()
    if args.quick:
        args.model, args.op_shape, args.decode_tokens, args.repeats = "quick", [512, 256], 8, 1
        args.kv_context, args.moe_experts = 256, 4
    runs = {"op": bench_op, "prefill": bench_prefill, "model": bench_model,
            "throughput": bench_throughput,
            "perplexity": bench_perplexity, "kv": bench_kv, "moe": bench_moe}
    rows = {name: run(args) for name, run in runs.items() if args.only in (None, name)}
    name = "quant.json" if args.only is None else f"quant-{args.only}.json"
    path = write_json(HERE / "results" / name,
                      dict(args={k: str(v) for k, v in vars(args).items()},
                           machine=machine_info(), **rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
