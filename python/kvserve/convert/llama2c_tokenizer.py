"""A llama2.c tokenizer ``.bin`` as a Hugging Face ``tokenizer.json`` (``tokenizers`` BPE).

The ``.bin`` is llama2.c's export of a SentencePiece BPE model: an int32 ``max_token_len``, then
per token a float32 score, an int32 byte length and the UTF-8 bytes. Ids 0/1/2 are <unk>/<s>/</s>,
3..258 the byte-fallback tokens ``<0x00>``..``<0xFF>``, the rest merged pieces and single
characters with score = minus the merge rank. The export spelled SentencePiece's "▁" as " ".

llama2.c encodes by prepending one space (the dummy prefix), looking up every UTF-8 character
(unknown ones fall back to their bytes, id = byte + 3), then repeatedly merging the adjacent pair
whose concatenation is the highest-scoring vocabulary piece, leftmost on ties. A ``tokenizers``
BPE reproduces that when the whole text is one word (no pre-tokenizer) and every pair of pieces
that concatenates to a piece is a merge, ranked by the score of the piece it makes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

SPACE = "\u2581"  # SentencePiece's "▁"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
NUM_BYTE_TOKENS = 256
BOS_ID = 1
EOS_ID = 2


@dataclass(frozen=True)
class Llama2cVocab:
    """The pieces of a llama2.c tokenizer in SentencePiece spelling, with their scores."""

    pieces: list[str]
    scores: list[float]


def read_llama2c_tokenizer(path: str | Path) -> Llama2cVocab:
    """Reads a llama2.c tokenizer ``.bin``.

    Raises FileNotFoundError when it is missing and ValueError when it is truncated, too small for
    the special and byte tokens, misses a byte token, or has duplicate or non-UTF-8 pieces.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {path} does not exist")
    data = path.read_bytes()
    if len(data) < 4:
        raise ValueError(f"{path} is not a llama2.c tokenizer: {len(data)} bytes")
    pieces, scores, offset = [], [], 4
    while offset < len(data):
        if offset + 8 > len(data):
            raise ValueError(f"{path} is truncated: token {len(pieces)} has no complete record")
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if length <= 0 or offset + length > len(data):
            raise ValueError(f"{path} is truncated or corrupt: token {len(pieces)} claims "
                             f"{length} bytes at offset {offset} of {len(data)}")
        try:
            piece = data[offset:offset + length].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: token {len(pieces)} is not UTF-8: {e}") from e
        offset += length
        pieces.append(piece)
        scores.append(score)
    return Llama2cVocab(_sentencepiece_spelling(pieces, path), scores)


def _sentencepiece_spelling(pieces: list[str], path: Path) -> list[str]:
    num_fixed = len(SPECIAL_TOKENS) + NUM_BYTE_TOKENS
    if len(pieces) < num_fixed:
        raise ValueError(f"{path} has {len(pieces)} tokens; a llama2.c tokenizer has at least "
                         f"{num_fixed} (<unk>, <s>, </s> and 256 byte tokens)")
    byte_pieces = [f"<0x{b:02X}>" for b in range(NUM_BYTE_TOKENS)]
    if pieces[len(SPECIAL_TOKENS):num_fixed] != byte_pieces:
        raise ValueError(f"{path}: ids 3..258 must be the byte tokens <0x00>..<0xFF>")
    # llama2.c's export spells <s> and </s> as "\n<s>\n" and "\n</s>\n"; the ids are what count.
    spelled = [*SPECIAL_TOKENS, *byte_pieces, *(p.replace(" ", SPACE) for p in pieces[num_fixed:])]
    if len(set(spelled)) != len(spelled):
        duplicates = sorted({p for p in spelled if spelled.count(p) > 1})
        raise ValueError(f"{path} has duplicate pieces: {duplicates[:5]}")
    return spelled


def bpe_merges(vocab: Llama2cVocab) -> list[tuple[str, str]]:
    """Every pair of ordinary pieces that concatenates to a piece, best merged score first.

    A piece made by several pairs ranks them by the length of their left part (ranks must be
    distinct in ``tokenizers``; llama2.c's leftmost rule only differs when such pairs overlap).
    """
    first_ordinary = len(SPECIAL_TOKENS) + NUM_BYTE_TOKENS
    ids = {p: i for i, p in enumerate(vocab.pieces) if i >= first_ordinary}
    ranked = []
    for piece, piece_id in ids.items():
        for k in range(1, len(piece)):
            if piece[:k] in ids and piece[k:] in ids:
                ranked.append((-vocab.scores[piece_id], piece_id, k, (piece[:k], piece[k:])))
    ranked.sort()
    return [pair for *_, pair in ranked]


def build_tokenizer(vocab: Llama2cVocab) -> Tokenizer:
    """A ``tokenizers`` BPE that encodes and decodes like llama2.c; its template adds the BOS."""
    model = models.BPE(vocab={p: i for i, p in enumerate(vocab.pieces)}, merges=bpe_merges(vocab),
                       unk_token=SPECIAL_TOKENS[0], byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE),
                                           normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    bos = SPECIAL_TOKENS[BOS_ID]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)])
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """``tokenizer_config.json`` for ``transformers.AutoTokenizer``: load tokenizer.json as is."""
    unk, bos, eos = SPECIAL_TOKENS
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
