"""Text <-> token ids through a checkpoint's ``tokenizer.json`` (the ``tokenizers`` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


# Prompt tokens decoded along with a continuation; enough to settle spaces and multi-byte
# characters at the boundary (vLLM's detokenizer uses 5).
_CONTEXT_TOKENS = 6
# Tokens a running output may hold back while its text ends in U+FFFD (an incomplete UTF-8
# character, or a literal replacement character): a character spans at most 4 byte tokens, so
# past this the window stops growing (each step decodes it: unbounded, a step would cost O(L)).
_MAX_HELD_TOKENS = 8


class Tokenizer:
    """Encodes with the tokenizer's own special-token template (e.g. a leading BOS)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "Tokenizer | None":
        """The directory's tokenizer, or None when it has no tokenizer.json; for a GGUF file,
        the vocabulary in its metadata (kvserve.loader.gguf_tokenizer)."""
        model_dir = Path(model_dir)
        if model_dir.suffix == ".gguf" and model_dir.is_file():
            from kvserve.loader.gguf_checkpoint import GGUFCheckpoint

            tokenizer = cls.__new__(cls)
            tokenizer._tok = GGUFCheckpoint(model_dir).tokenizer()
            return tokenizer
        path = model_dir / "tokenizer.json"
        return cls(path) if path.is_file() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_continuation(self, prompt_ids: list[int], token_ids: list[int]) -> str:
        """The text that token_ids add after the prompt.

        Decoding token_ids alone can lose text that depends on what precedes them, e.g. a
        SentencePiece decoder strips the leading space of the first token. So decode the last
        few prompt tokens with and without the continuation and keep the difference."""
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        prefix = self.decode(context)
        full = self.decode(context + list(token_ids))
        if full.startswith(prefix):
            return full[len(prefix):]
        return self.decode(token_ids)  # the boundary changed the prefix (e.g. a split character)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (byte-level marks included)."""
        return [self._tok.id_to_token(i) for i in token_ids]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas, one step at a time.

    Decodes a short window (a few tokens already shown + the new ones) rather than the whole
    output, and holds back text that ends in an incomplete UTF-8 character (U+FFFD) until the
    next token completes it (the scheme of vLLM's detokenizer), for at most _MAX_HELD_TOKENS
    tokens; flush() releases what is held when the output ends."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0            # window start
        self._read_offset = len(self._ids)  # tokens before this are already in `text`
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Appends generated tokens; returns the text they complete (possibly "")."""
        self._ids.extend(token_ids)
        self.last_delta = ""
        held = len(self._ids) - self._read_offset
        shown = self._tok.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset:])
        if held <= _MAX_HELD_TOKENS and (len(full) <= len(shown) or full.endswith("\ufffd")
                                         or not full.startswith(shown)):
            return ""
        return self._emit(shown, full)

    def flush(self) -> str:
        """The output ended: returns (and adds to text) whatever is still held back, as a
        decode of the whole output would show it (U+FFFD for an incomplete character)."""
        self.last_delta = ""
        if self._read_offset == len(self._ids):
            return ""
        shown = self._tok.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset:])
        return self._emit(shown, full)

    def _emit(self, shown: str, full: str) -> str:
        """Takes the window's text past `shown` as shown (where the boundary changed the text
        before it, what follows the common prefix)."""
        delta = full[len(_common_prefix(shown, full)):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > 4 * _CONTEXT_TOKENS:  # the ids list as short as the window
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self.text += delta
        self.last_delta = delta
        return delta

    def add_all(self, token_ids: list[int]) -> str:
        """Appends many tokens at once, with the text add() would give them one at a time: one
        decode of the window instead of two per token. Where the window does not decode to a
        clean continuation (it ends in an incomplete character, or the text before it changes),
        falls back to add() per token."""
        window = self._ids[self._prefix_offset:]
        shown = self._tok.decode(window[:self._read_offset - self._prefix_offset])
        full = self._tok.decode(window + list(token_ids))
        if "\ufffd" in full[len(shown):] or not full.startswith(shown):
            start = len(self.text)
            for t in token_ids:
                self.add([t])
            self.last_delta = self.text[start:]
            return self.last_delta
        self._ids.extend(token_ids)
        # As after add() of the last token: the window restarts at the last few tokens.
        self._read_offset = max(self._read_offset, len(self._ids) - _CONTEXT_TOKENS)
        return self._emit(shown, full)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]
