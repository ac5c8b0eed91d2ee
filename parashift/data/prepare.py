"""Tokenize text files into a flat token file (``*.bin``) with a JSON sidecar, as nanoGPT and Megatron do.

The token file is a little-endian array of ``uint16`` tokens (``uint32`` when the vocabulary has more than
65536 entries). Every document is followed by the tokenizer's end-of-text token, so documents are
separated by EOS in the stream (nanoGPT's ``ids.append(eot)``, Megatron's ``--append-eod``). The sidecar
``NAME.json`` beside ``NAME.bin`` records the dtype, token count, vocabulary size, EOS id, the token offset
of every document boundary, the byte size and the SHA-256 of the ``.bin`` (see :mod:`.tokens`, which
reads and checks both). Tokenizers are read from a local ``tokenizer.json``; nothing is downloaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from ..errors import DataError, InputError
from .tokens import FORMAT, VERSION, dtype_for_vocab, sidecar_path

__all__ = ["prepare", "load_tokenizer", "split_documents", "EOS_CANDIDATES", "SPLITS"]

#: end-of-text tokens tried, in order, when ``eos`` is not given (GPT-2/Qwen, Llama 3, Llama 2/Mistral, others).
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
#: how a file is cut into documents: one document per file, per blank-line-separated paragraph, or per line.
SPLITS = ("file", "paragraph", "line")
_BATCH = 256   # documents encoded per encode_batch call


def load_tokenizer(path: "str | os.PathLike"):
    """A ``tokenizers.Tokenizer`` from ``path`` (a ``tokenizer.json`` or a folder holding one)."""
    p = Path(path).expanduser()
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise InputError(f"--tokenizer {path}: no tokenizer.json there; give a folder holding a Hugging Face "
                         f"tokenizer.json (e.g. a model saved with save_pretrained) or the file itself")
    try:
        from tokenizers import Tokenizer
    except ImportError as e:   # pragma: no cover - a declared dependency
        raise InputError("data prepare needs the `tokenizers` package; pip install tokenizers") from e
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions on malformed files
        raise InputError(f"--tokenizer {f} is not a tokenizer.json the tokenizers library can read "
                         f"({' '.join(str(e).split())[:160]}); give the tokenizer.json of a Hugging Face model") from e


def _eos_id(tok, eos: str | None) -> tuple[str, int]:
    names = (eos,) if eos else EOS_CANDIDATES
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return name, int(i)
    if eos:
        raise InputError(f"--eos {eos!r} is not a token of this tokenizer; give the end-of-text token it defines")
    raise InputError(f"the tokenizer has none of the usual end-of-text tokens ({', '.join(EOS_CANDIDATES)}); "
                     f"name its end-of-text token with --eos")


def split_documents(text: str, split: str) -> list[str]:
    """The documents of one file's ``text``: the whole text, its paragraphs or its lines (empty ones dropped)."""
    if split == "file":
        parts = [text]
    elif split == "paragraph":
        parts = re.split(r"\n\s*\n", text)
    elif split == "line":
        parts = text.splitlines()
    else:
        raise InputError(f"--split {split!r} is not one of {', '.join(SPLITS)}")
    return [p.strip() for p in parts if p.strip()]


def _read(path: Path) -> str:
    if not path.is_file():
        raise InputError(f"{path}: no such text file; give existing UTF-8 text files")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text (byte {e.start}); convert it to UTF-8 first") from e


def _chunks(docs: Sequence[str], n: int) -> Iterator[Sequence[str]]:
    for i in range(0, len(docs), n):
        yield docs[i:i + n]


def prepare(files: Iterable["str | os.PathLike"], tokenizer: "str | os.PathLike", out: "str | os.PathLike",
            split: str = "file", eos: str | None = None) -> dict:
    """Tokenize ``files`` into ``out`` (a ``*.bin``) and its sidecar; return the sidecar's contents.

    Both files are written beside their targets and renamed into place, the sidecar last, so a failed
    run leaves neither a partial ``.bin`` nor a sidecar that describes one.
    """
    files = [Path(f).expanduser() for f in files]
    if not files:
        raise InputError("give at least one text file to tokenize")
    if split not in SPLITS:
        raise InputError(f"--split {split!r} is not one of {', '.join(SPLITS)}")
    out = Path(out).expanduser()
    if out.suffix != ".bin":
        raise InputError(f"--out {out} must end in .bin (the sidecar is written beside it as {out.stem}.json)")
    tok = load_tokenizer(tokenizer)
    eos_name, eos_id = _eos_id(tok, eos)
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    dtype = dtype_for_vocab(vocab)
    tok_file = Path(tokenizer).expanduser()
    tok_file = tok_file / "tokenizer.json" if tok_file.is_dir() else tok_file
    side = sidecar_path(out)
    tmp_bin, tmp_side = out.with_name(f".{out.name}.tmp"), side.with_name(f".{side.name}.tmp")
    sha, offsets, sources, n = hashlib.sha256(), [0], [], 0
    try:
        with open(tmp_bin, "wb") as fh:
            for f in files:
                docs = split_documents(_read(f), split)
                for part in _chunks(docs, _BATCH):
                    for enc in tok.encode_batch(list(part), add_special_tokens=False):
                        ids = np.asarray(enc.ids + [eos_id], dtype=np.int64)
                        if ids.size and ids.max() >= vocab:   # added tokens beyond the reported vocab
                            raise DataError(f"{f}: token id {int(ids.max())} is outside the tokenizer's "
                                            f"vocabulary of {vocab}; check the tokenizer.json")
                        b = ids.astype(dtype).tobytes()
                        fh.write(b)
                        sha.update(b)
                        n += ids.size
                        offsets.append(n)
                sources.append({"path": str(f), "documents": len(docs), "bytes": f.stat().st_size})
        if n == 0:
            raise InputError(f"the files hold no text ({', '.join(map(str, files))}); give non-empty text files")
        meta = {"format": FORMAT, "version": VERSION, "dtype": np.dtype(dtype).name, "byteorder": "little",
                "tokens": n, "bytes": n * np.dtype(dtype).itemsize, "sha256": sha.hexdigest(),
                "vocab_size": vocab, "eos_id": eos_id, "eos": eos_name, "documents": len(offsets) - 1,
                "doc_offsets": offsets, "split": split, "sources": sources,
                "tokenizer": {"path": str(tok_file), "sha256": _sha256_file(tok_file)}}
        tmp_side.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp_bin, out)
        os.replace(tmp_side, side)
    finally:
        for t in (tmp_bin, tmp_side):
            t.unlink(missing_ok=True)
    return meta


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
