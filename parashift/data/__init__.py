"""Real training data: tokenize text into a flat token file, memory-map it, and order its sequences.

:func:`prepare` writes ``NAME.bin`` + ``NAME.json``; :func:`open_tokens` checks and maps them;
:class:`Sampler` gives every step's global batch from the seed and the step alone; :class:`DataPosition`
is the small state saved with a checkpoint. ``tokenizers`` is imported only by :func:`prepare`.
"""
from __future__ import annotations

from .prepare import prepare
from .sampler import DataPosition, Sampler, rank_rows
from .tokens import TokenFile, open_tokens

__all__ = ["prepare", "open_tokens", "TokenFile", "Sampler", "DataPosition", "rank_rows"]
