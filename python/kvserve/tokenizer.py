"""Text <-> token ids through a checkpoint's ``tokenizer.json`` (the ``tokenizers`` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


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
        """The directory's tokenizer, or None when it has no tokenizer.json."""
        path = Path(model_dir) / "tokenizer.json"
        return cls(path) if path.is_file() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)
