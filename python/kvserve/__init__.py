"""kvserve: a small LLM inference engine with a C++ core."""

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from kvserve import _C

__version__ = "0.1.0"
