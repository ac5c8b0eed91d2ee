"""Where the shipped traces live: the repository's ``traces/`` folder (or ``$PARASHIFT_TRACES``)."""
from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import pandas as pd

from ..errors import TraceFormatError

__all__ = ["ENV", "root", "shipped", "resolve", "index"]

#: environment variable naming a folder of traces to use instead of the shipped one
ENV = "PARASHIFT_TRACES"
_SUFFIXES = {".csv", ".txt", ".json", ".out"}
_DOCS = ("README", "PROVENANCE", "LICENSE", "index")


def root() -> Path:
    """The trace folder: ``$PARASHIFT_TRACES``, else ``traces/`` next to the package."""
    env = os.environ.get(ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_dir():
            raise TraceFormatError(f"${ENV}={env!r} is not a folder; point it at a folder of traces or unset it")
        return p
    here = Path(__file__).resolve().parent
    for cand in (here.parents[1] / "traces", here / "data"):
        if cand.is_dir():
            return cand
    raise TraceFormatError("no shipped traces found (looked for traces/ beside the parashift package); "
                           f"set ${ENV} to a folder of traces")


def index() -> pd.DataFrame:
    """The shipped traces' ``index.csv`` (path, format, source, license, nodes, about), if present."""
    f = root() / "index.csv"
    if not f.is_file():
        return pd.DataFrame(columns=["path", "format", "source", "license", "nodes", "about"])
    return pd.read_csv(f, dtype=str, keep_default_na=False)


def shipped(pattern: str | None = None) -> list[Path]:
    """Paths of the shipped traces (those listed in ``index.csv``, else every trace-like file).

    ``pattern``: an fnmatch pattern on the path relative to the trace folder, e.g. ``"bamboo/*"``.
    """
    base = root()
    idx = index()
    if len(idx):
        rel = idx["path"].tolist()
    else:
        rel = sorted(str(p.relative_to(base)).replace(os.sep, "/") for p in base.rglob("*")
                     if p.is_file() and p.suffix in _SUFFIXES and not p.name.startswith(_DOCS))
    if pattern is not None:
        rel = [r for r in rel if fnmatch.fnmatch(r, pattern)]
    return [base / r for r in rel]


def resolve(path: str | Path) -> Path:
    """``path`` if it names an existing file (an explicit path is a path), else the shipped trace of
    that relative name, which must lie inside the trace folder (names with ``..`` that escape it,
    and absolute names, are refused)."""
    if not str(path).strip():
        raise TraceFormatError("the trace name is empty; pass a trace file or a shipped trace name (see "
                               "`parashift traces`)")
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        raise TraceFormatError(f"{path} is a folder; pass a trace file or a shipped trace name")
    if not p.is_absolute():
        try:
            base = root().resolve()
        except TraceFormatError:
            base = None
        if base is not None:
            cand = (base / p).resolve()
            if not cand.is_relative_to(base):
                raise TraceFormatError(f"{path}: a shipped trace name must stay inside the trace folder; pass "
                                       "a file path, or a name from `parashift traces`")
            if cand.is_file():
                return cand
    raise TraceFormatError(f"{path}: no such trace file; pass a file path or a shipped trace name "
                           "(see `parashift traces`)")
