"""A GGUF file's vocabulary (`tokenizer.ggml.*`) as a `tokenizers` Tokenizer.

`tokenizer.ggml.model` "llama" is a SentencePiece BPE vocabulary: pieces with scores and types
(1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte). It becomes a BPE model whose
merges are every pair of pieces that concatenate to a piece, ranked by that piece's score (how
SentencePiece's BPE picks merges), with byte fallback (the <0xNN> pieces) and SentencePiece's
whitespace handling: spaces as U+2581, one prepended unless `add_space_prefix` is false. Control
and user-defined pieces are special tokens. The BOS is prepended when `add_bos_token` (default
true) says so.

`tokenizer.ggml.model` "gpt2" is a byte-level BPE (Llama 3 files): tokens spelled in GPT-2's
byte alphabet, ranked merges (`tokenizer.ggml.merges`, "left right"), and text split before the
merges by the regular expression its `tokenizer.ggml.pre` names (llama.cpp's names: `llama-bpe`
for Llama 3's, `default` / `gpt-2` for GPT-2's, `qwen2`); a word that is a whole token is taken
as it is (ignore_merges, as llama.cpp does for Llama 3). The BOS is prepended when
`add_bos_token` says so (by default for Llama 3's splitting only). Control tokens are special.
Any other tokenizer model or `pre` is a ValueError naming it.
"""

from __future__ import annotations

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors)

_SPACE = "\u2581"
_CONTROL, _USER_DEFINED = 3, 4


# Pre-tokenizer splits by llama.cpp's `tokenizer.ggml.pre` names (None: GPT-2's own, which the
# ByteLevel pre-tokenizer applies). The patterns are the models' own tokenizer.json ones.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PRES = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")
_SPLITS = {**{name: _LLAMA3_SPLIT for name in _LLAMA3_PRES}, "qwen2": _QWEN2_SPLIT,
           "default": None, "gpt-2": None}


def gguf_tokenizer(checkpoint) -> Tokenizer:
    kind = checkpoint.field("tokenizer.ggml.model")
    if kind == "gpt2":
        return _byte_level(checkpoint)
    if kind != "llama":
        raise ValueError(f"{checkpoint.path}: tokenizer model {kind!r} is not supported in GGUF "
                         "yet (kvserve reads 'llama', SentencePiece BPE, and 'gpt2', byte-level "
                         "BPE)")
    tokens = [str(t) for t in checkpoint.field("tokenizer.ggml.tokens")]
    scores = [float(s) for s in checkpoint.field("tokenizer.ggml.scores")]
    types = [int(t) for t in checkpoint.field("tokenizer.ggml.token_type", [1] * len(tokens))]
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = checkpoint.special_token_id("unknown")
    unk_token = tokens[unk] if unk is not None else None
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
    _prepend_bos(tok, checkpoint, tokens, True)
    return tok


def _byte_level(checkpoint) -> Tokenizer:
    pre = str(checkpoint.field("tokenizer.ggml.pre", "default"))
    if pre not in _SPLITS:
        raise ValueError(f"{checkpoint.path}: pre-tokenizer {pre!r} is not supported in GGUF yet "
                         f"(kvserve splits as {', '.join(_SPLITS)})")
    tokens = [str(t) for t in checkpoint.field("tokenizer.ggml.tokens")]
    types = [int(t) for t in checkpoint.field("tokenizer.ggml.token_type", [1] * len(tokens))]
    merges = [tuple(str(m).split(" ", 1)) for m in checkpoint.field("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges,
                               ignore_merges=pre in _LLAMA3_PRES))
    split = _SPLITS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == _USER_DEFINED])
    _prepend_bos(tok, checkpoint, tokens, pre in _LLAMA3_PRES)
    return tok


def _prepend_bos(tok: Tokenizer, checkpoint, tokens: list[str], default: bool) -> None:
    """The BOS before every encoding when the file's add_bos_token (else `default`) says so."""
    bos_id = checkpoint.special_token_id("bos")
    if bos_id is not None and bool(checkpoint.field("tokenizer.ggml.add_bos_token", default)):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos_id]} $A", pair=f"{tokens[bos_id]} $A $B",
            special_tokens=[(tokens[bos_id], bos_id)])


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
