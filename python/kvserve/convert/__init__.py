"""Importers that write checkpoints of other formats as Hugging Face directories kvserve loads."""

from kvserve.convert.llama2c import convert_llama2c

__all__ = ["convert_llama2c"]
