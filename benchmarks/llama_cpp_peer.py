"""llama.cpp as a peer in the benchmarks: GGUF files of a benchmark's Hugging Face checkpoint, made
by llama.cpp's own tools, and batch-1 greedy decode timed through llama-cpp-python.

Needs (benchmarks only, not the test suite): `pip install llama-cpp-python gguf sentencepiece
protobuf` (llama-cpp-python compiles llama.cpp, ~10 minutes on 2 cores) and llama.cpp's
`convert_hf_to_gguf.py`, which ships in the llama-cpp-python sdist under vendor/llama.cpp (with its
`conversion/` and `gguf-py/` beside it; `pip download --no-deps --no-binary :all:
llama-cpp-python` fetches it) or in a llama.cpp checkout: pass its path with --llama-cpp-convert
or $LLAMA_CPP_CONVERT.

The F32 GGUF comes from convert_hf_to_gguf.py; BF16, Q8_0 and Q4_0 from it through
llama_model_quantize (llama.cpp's quantizer, its default tensor mix: Q4_0 keeps the output head
in Q6_K). The benchmark checkpoints have a BPE tokenizer.json that the converter does not know, so
the converter is given a sentencepiece tokenizer.model of the same vocabulary size whose pieces
are placeholders: the benchmarks feed token ids, never text.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# llama_ftype values of llama.h.
FTYPES = {"BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}


def convert_script(path: str | None) -> Path | None:
    """The convert_hf_to_gguf.py to use, or None when llama.cpp is not available here."""
    path = path or os.environ.get("LLAMA_CPP_CONVERT")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    return Path(path) if path and Path(path).is_file() else None


@contextlib.contextmanager
def quiet_stderr():
    """llama.cpp logs every tensor it loads or converts to fd 2; silence it."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def placeholder_tokenizer_model(vocab_size: int, out: Path) -> None:
    """A sentencepiece model of vocab_size pieces (<unk>, <s>, </s>, 256 byte pieces, then
    placeholders), for a converter that needs a vocabulary it knows."""
    import sentencepiece.sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    kind = pb.ModelProto.SentencePiece.Type

    def add(piece: str, score: float, type_) -> None:
        p = model.pieces.add()
        p.piece, p.score, p.type = piece, score, type_

    add("<unk>", 0.0, kind.UNKNOWN)
    add("<s>", 0.0, kind.CONTROL)
    add("</s>", 0.0, kind.CONTROL)
    for b in range(256):
        add(f"<0x{b:02X}>", 0.0, kind.BYTE)
    for i in range(vocab_size - len(model.pieces)):
        add(f"\u2581t{i}", -float(i), kind.NORMAL)
    model.trainer_spec.model_type = pb.TrainerSpec.BPE
    model.trainer_spec.vocab_size = vocab_size
    model.trainer_spec.byte_fallback = True
    out.write_bytes(model.SerializeToString())


def gguf_files(checkpoint: Path, script: Path,
               formats=("F32", "BF16", "Q8_0", "Q4_0", "Q4_K_M")
               ) -> dict[str, Path]:
    """{format: GGUF path} for the fp32 checkpoint, built beside it on first use."""
    import llama_cpp

    out_dir = checkpoint.with_name(checkpoint.name + "-gguf")
    out_dir.mkdir(exist_ok=True)
    files = {f: out_dir / f"model-{f.lower()}.gguf" for f in formats}
    f32 = out_dir / "model-f32.gguf"
    if not f32.is_file():
        src = out_dir / "src"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir()
        for name in ("config.json", "model.safetensors"):
            (src / name).symlink_to(checkpoint / name)
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        placeholder_tokenizer_model(vocab, src / "tokenizer.model")
        print(f"converting {checkpoint.name} to GGUF ...", flush=True)
        subprocess.run([sys.executable, str(script), str(src), "--outtype", "f32", "--outfile",
                        str(f32.with_suffix(".tmp"))], check=True, capture_output=True)
        f32.with_suffix(".tmp").rename(f32)
        shutil.rmtree(src)
    for fmt, path in files.items():
        if fmt == "F32" or path.is_file():
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = FTYPES[fmt], os.cpu_count()
        tmp = path.with_suffix(".tmp")
        with quiet_stderr():
            rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(),
                                                ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize to {fmt} failed ({rc})")
        tmp.rename(path)
    return files


def tensor_bytes(path: Path, name: str) -> int:
    """Bytes of tensor `name` in a GGUF file, as stored (read with the gguf package)."""
    import gguf

    for tensor in gguf.GGUFReader(str(path)).tensors:
        if tensor.name == name:
            return int(tensor.n_bytes)
    raise KeyError(f"{path} has no tensor {name!r}")


def decode_tpot(path: Path, prompt: list[int], num_tokens: int, threads: int) -> float:
    """Seconds per output token of batch-1 greedy decode (after the first token), as kvserve's
    time_per_output_token: from the first generated token to the last."""
    import llama_cpp

    with quiet_stderr():
        llm = llama_cpp.Llama(str(path), n_ctx=len(prompt) + num_tokens + 8, n_batch=64,
                              n_threads=threads, n_threads_batch=threads, verbose=False)
    stamps = []
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == num_tokens:
            break
    del llm
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def batched_throughput(path: Path, prompts: list[list[int]], num_tokens: int,
                       threads: int) -> float:
    """Output tokens per second of greedy decode of all `prompts` at once, num_tokens each,
    timed from the start of their prefill to the last token: one llama_decode per step over a
    batch holding one token of every sequence (llama.cpp's batched decoding, as its
    batched-bench and server run it), each sequence in its own KV sequence id."""
    import llama_cpp
    import numpy as np

    n = len(prompts)
    with quiet_stderr():
        model = llama_cpp.llama_model_load_from_file(str(path).encode(),
                                                     llama_cpp.llama_model_default_params())
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = sum(len(p) + num_tokens for p in prompts) + 16
        params.n_batch = params.n_ubatch = max(512, sum(len(p) for p in prompts))
        params.n_seq_max, params.n_threads, params.n_threads_batch = n, threads, threads
        ctx = llama_cpp.llama_init_from_model(model, params)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, n)

    def decode(entries: list[tuple[int, int, int]]) -> list[int]:
        """entries (token, position, sequence), the last of each sequence's read: the greedy
        next token of each sequence, in sequence order."""
        last = {seq: i for i, (_, _, seq) in enumerate(entries)}
        batch.n_tokens = len(entries)
        for i, (token, pos, seq) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, last[seq] == i
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, last[s]),
                                          shape=(vocab,)).argmax()) for s in range(n)]

    started = time.perf_counter()
    nxt = decode([(t, pos, s) for s, p in enumerate(prompts) for pos, t in enumerate(p)])
    for step in range(num_tokens - 1):
        nxt = decode([(t, len(prompts[s]) + step, s) for s, t in enumerate(nxt)])
    elapsed = time.perf_counter() - started
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return n * num_tokens / elapsed
