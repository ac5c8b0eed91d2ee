"""A prepared token file, memory-mapped and checked: ``NAME.bin`` (flat little-endian tokens) + ``NAME.json``.

Sequence ``i`` of length ``L`` is the ``L + 1`` tokens ``[i*L, i*L + L]``: the first ``L`` are the inputs
and the last ``L`` the next-token targets, so consecutive sequences share one token (nanoGPT's
``x = data[i:i+L]; y = data[i+1:i+1+L]`` at stride ``L``; Megatron's GPT dataset reads ``seq_length + 1``
tokens per sample). A file of ``N`` tokens holds ``(N - 1) // L`` sequences. Every check runs in
:func:`open_tokens`, before any process starts, and fails with one :class:`~parashift.errors.DataError`.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import DataError

if TYPE_CHECKING:  # pragma: no cover
    from .sampler import Sampler

__all__ = ["TokenFile", "open_tokens", "sidecar_path", "dtype_for_vocab", "FORMAT", "VERSION"]

FORMAT = "parashift-tokens"
VERSION = 1
_DTYPES = {"uint16": "<u2", "uint32": "<u4"}
_KEYS = ("dtype", "tokens", "bytes", "sha256", "vocab_size", "eos_id", "doc_offsets")


def dtype_for_vocab(vocab: int) -> str:
    """``"<u2"`` when every id of a ``vocab``-entry vocabulary fits 16 bits, else ``"<u4"``."""
    if vocab > 1 << 32:
        raise DataError(f"a vocabulary of {vocab} tokens does not fit uint32 ids")
    return "<u2" if vocab <= 1 << 16 else "<u4"


def sidecar_path(path: "str | os.PathLike") -> Path:
    """The JSON sidecar of token file ``path``: ``NAME.json`` beside ``NAME.bin``."""
    return Path(path).with_suffix(".json")


@dataclass(frozen=True, eq=False)
class TokenFile:
    """An opened token file: ``tokens`` is a read-only memory map; ``meta`` the sidecar's contents."""

    path: Path
    meta: dict
    tokens: np.ndarray

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    @property
    def doc_offsets(self) -> np.ndarray:
        """Token offset of every document start, and the end (``documents + 1`` ascending offsets)."""
        return np.asarray(self.meta["doc_offsets"], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def num_sequences(self, seq_len: int) -> int:
        """Sequences of ``seq_len`` inputs (plus one target token) the file holds: ``(N - 1) // seq_len``."""
        if seq_len < 1:
            raise DataError(f"sequence length {seq_len} must be at least 1")
        return (len(self) - 1) // seq_len

    def sampler(self, seq_len: int, seed: int = 0) -> "Sampler":
        """The :class:`~parashift.data.sampler.Sampler` over this file's sequences of ``seq_len``, tied to
        the file by its SHA-256."""
        from .sampler import Sampler
        return Sampler(self.num_sequences(seq_len), seed, source=str(self.meta["sha256"]))

    def sequences(self, indices: "np.ndarray | list[int]", seq_len: int) -> np.ndarray:
        """Tokens ``[B, seq_len + 1]`` (int64) of sequences ``indices``; ``[:, :-1]`` are the inputs and
        ``[:, 1:]`` the targets."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self.num_sequences(seq_len)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise DataError(f"sequence index {int(idx.max() if idx.max() >= n else idx.min())} is outside the "
                            f"{n} sequences of length {seq_len} in {self.path}")
        rows = idx[:, None] * seq_len + np.arange(seq_len + 1)
        return self.tokens[rows].astype(np.int64)


def _fail(path: Path, what: str) -> DataError:
    return DataError(f"token file {path}: {what}")


def _read_meta(path: Path) -> dict:
    side = sidecar_path(path)
    if not side.is_file():
        raise _fail(path, f"its sidecar {side.name} is missing; make both with `parashift data prepare`")
    try:
        meta = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(path, f"its sidecar {side.name} is not valid JSON ({e}); prepare the file again") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _fail(path, f"{side.name} is not a {FORMAT} sidecar; make it with `parashift data prepare`")
    if meta.get("version") != VERSION:
        raise _fail(path, f"{side.name} has format version {meta.get('version')}, this parashift reads "
                          f"{VERSION}; prepare the file again")
    missing = [k for k in _KEYS if k not in meta]
    if missing:
        raise _fail(path, f"{side.name} lacks {', '.join(missing)}; prepare the file again")
    if meta["dtype"] not in _DTYPES:
        raise _fail(path, f"dtype {meta['dtype']!r} is not one of {', '.join(_DTYPES)}")
    return meta


def open_tokens(path: "str | os.PathLike", seq_len: int | None = None, checksum: bool = False) -> TokenFile:
    """Open and check token file ``path``: sidecar present and well-formed, byte size as recorded (a
    truncated or overwritten file fails here), document offsets ascending from 0 to the token count;
    with ``seq_len``, at least one sequence; with ``checksum``, the SHA-256 and every id below the
    vocabulary size (one pass over the file)."""
    path = Path(path).expanduser()
    if path.suffix != ".bin":
        raise _fail(path, "the name must end in .bin (its sidecar is NAME.json); give the .bin that "
                          "`parashift data prepare` wrote")
    if not path.is_file():
        raise _fail(path, "no such file; make it with `parashift data prepare FILES --tokenizer DIR --out PATH`")
    meta = _read_meta(path)
    dt = np.dtype(_DTYPES[meta["dtype"]])
    n, size = int(meta["tokens"]), path.stat().st_size
    if size != int(meta["bytes"]) or size != n * dt.itemsize:
        raise _fail(path, f"holds {size} bytes but its sidecar records {n} {meta['dtype']} tokens "
                          f"({n * dt.itemsize} bytes): the file is truncated or was overwritten; prepare it again")
    off = np.asarray(meta["doc_offsets"], dtype=np.int64)
    if off.size < 2 or off[0] != 0 or off[-1] != n or np.any(np.diff(off) <= 0):
        raise _fail(path, "the sidecar's doc_offsets do not rise from 0 to the token count; prepare it again")
    if int(meta["vocab_size"]) > np.iinfo(dt).max + 1:
        raise _fail(path, f"a vocabulary of {meta['vocab_size']} does not fit {meta['dtype']}; prepare it again")
    tokens = np.memmap(path, dtype=dt, mode="r", shape=(n,))
    tf = TokenFile(path, meta, tokens)
    if seq_len is not None and tf.num_sequences(seq_len) < 1:
        raise _fail(path, f"its {n} tokens hold no sequence of {seq_len} + 1 tokens; use a shorter "
                          f"--seq-len or more text")
    if checksum:
        _verify(tf)
    return tf


def _verify(tf: TokenFile, block: int = 1 << 24) -> None:
    h, top = hashlib.sha256(), 0
    for i in range(0, len(tf), block):
        part = np.asarray(tf.tokens[i:i + block])
        h.update(part.tobytes())
        top = max(top, int(part.max()))
    if h.hexdigest() != tf.meta["sha256"]:
        raise _fail(tf.path, "its SHA-256 differs from the sidecar's: the tokens were changed or corrupted; "
                             "prepare the file again")
    if top >= tf.vocab_size:
        raise _fail(tf.path, f"token id {top} is outside the vocabulary of {tf.vocab_size}; prepare it again")
