"""A GGUF file's vocabulary (`tokenizer.ggml.*`) as a `tokenizers` Tokenizer.

`tokenizer.ggml.model` "llama" is a SentencePiece BPE vocabulary: pieces with scores and types
(1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte). It becomes a BPE model whose
merges are every pair of pieces that concatenate to a piece, ranked by that piece's score (how
SentencePiece's BPE picks merges), with byte fallback (the <0xNN> pieces) and SentencePiece's
whitespace handling: spaces as U+2581, one prepended unless `add_space_prefix` is false. Control
and user-defined pieces are special tokens. The BOS is prepended when `add_bos_token` (default
true) says so. Other tokenizer models (`gpt2` byte-level BPE, as Llama 3 files use) are a
ValueError for now.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

_SPACE = "\u2581"
_CONTROL, _USER_DEFINED = 3, 4


def gguf_tokenizer(checkpoint) -> Tokenizer:
    kind = checkpoint.field("tokenizer.ggml.model")
    if kind != "llama":
        raise ValueError(f"{checkpoint.path}: tokenizer model {kind!r} is not supported in GGUF "
                         "yet (kvserve reads 'llama', SentencePiece BPE)")
    tokens = [str(t) for t in checkpoint.field("tokenizer.ggml.tokens")]
    scores = [float(s) for s in checkpoint.field("tokenizer.ggml.scores")]
    types = [int(t) for t in checkpoint.field("tokenizer.ggml.token_type", [1] * len(tokens))]
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = checkpoint.reader.fields.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk.contents())] if unk is not None else None
    tok = Tokenizer(models.BPE(vocab, _merges(tokens, scores, vocab), unk_token=unk_token,
                               fuse_unk=True, byte_fallback=True))
    prefix = bool(checkpoint.field("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(_SPACE)] if prefix else []) + [normalizers.Replace(" ", _SPACE)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)])
    bos = checkpoint.reader.fields.get("tokenizer.ggml.bos_token_id")
    if bos is not None and bool(checkpoint.field("tokenizer.ggml.add_bos_token", True)):
        bos_id = int(bos.contents())
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos_id]} $A", pair=f"{tokens[bos_id]} $A $B",
            special_tokens=[(tokens[bos_id], bos_id)])
    return tok


def _merges(tokens: list[str], scores: list[float], vocab: dict[str, int]
            ) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a piece, best-scored piece first (ties: the
    lower ids first)."""
    ranked = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
