"""Vectorized helpers to read line-oriented trace files with errors that name the row."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .schema import fail

__all__ = ["Lines", "lines_of", "fields", "numbers", "integers", "timestamps", "sorted_or_fail"]


@dataclass(frozen=True)
class Lines:
    """The non-blank, non-comment lines of a file and their 1-based line numbers."""

    source: str
    text: pd.Series      # str, stripped, CR removed
    row: np.ndarray      # int64 line numbers, same length

    def __len__(self) -> int:
        return len(self.row)


def lines_of(source: str, text: str) -> Lines:
    """Split ``text`` into lines (LF or CRLF), dropping blank lines and ``#`` comments."""
    raw = pd.Series(text.split("\n"), dtype=object).str.rstrip("\r").str.strip()
    keep = (raw != "") & ~raw.str.startswith("#")
    if not keep.any():
        raise fail(source, None, "the file holds no data rows", "check that it is the trace you meant "
                   "(an empty or comment-only file has no events)")
    return Lines(source, raw[keep].reset_index(drop=True), np.flatnonzero(keep.to_numpy()) + 1)


def fields(lines: Lines, names: tuple[str, ...], sep: str = ",") -> pd.DataFrame:
    """Split every line into exactly ``len(names)`` stripped string fields, or fail naming the row."""
    n = lines.text.str.count(sep).to_numpy() + 1
    bad = np.flatnonzero(n != len(names))
    if bad.size:
        i = bad[0]
        last = i == len(lines) - 1 and n[i] < len(names)
        hint = " (the file looks truncated)" if last else ""
        raise fail(lines.source, int(lines.row[i]), f"{n[i]} fields where the format has {len(names)} "
                   f"({sep.join(names)}){hint}",
                   "fix or remove the row, or pass the right format= to load()")
    parts = lines.text.str.split(sep, n=len(names) - 1, expand=True, regex=False)
    parts.columns = list(names)
    return parts.apply(lambda c: c.str.strip())


def numbers(lines: Lines, col: pd.Series, what: str) -> np.ndarray:
    """Parse a column of numbers (float64), failing on the first row that is not one."""
    out = pd.to_numeric(col, errors="coerce").to_numpy(dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(out))
    if bad.size:
        i = bad[0]
        raise fail(lines.source, int(lines.row[i]), f"{what} is not a number",
                   f"write {what} as a plain decimal number")
    return out


def integers(lines: Lines, col: pd.Series, what: str, minimum: int | None = 0) -> np.ndarray:
    """Parse a column of integers >= ``minimum``, failing on the first bad row."""
    out = numbers(lines, col, what)
    bad = np.flatnonzero(out != np.round(out))
    if bad.size:
        i = bad[0]
        raise fail(lines.source, int(lines.row[i]), f"{what} is not a whole number",
                   f"{what} counts nodes, so it must be an integer")
    if minimum is not None:
        bad = np.flatnonzero(out < minimum)
        if bad.size:
            i = bad[0]
            raise fail(lines.source, int(lines.row[i]), f"{what} {col.iloc[i]} is negative" if minimum == 0
                       else f"{what} {col.iloc[i]} is below {minimum}", f"{what} must be >= {minimum}")
    return out.astype(np.int64)


def timestamps(lines: Lines, col: pd.Series, what: str, fmt: str | None = None) -> np.ndarray:
    """Parse absolute times (naive UTC) to seconds since the epoch, failing on the first bad row."""
    ts = pd.to_datetime(col, format=fmt if fmt else "ISO8601", errors="coerce", utc=True)
    bad = np.flatnonzero(ts.isna().to_numpy())
    if bad.size:
        i = bad[0]
        raise fail(lines.source, int(lines.row[i]), f"{what} is not a valid time"
                   + (" (the file looks truncated)" if i == len(lines) - 1 else ""),
                   f"write {what} as {fmt or 'ISO 8601'}")
    return (ts - pd.Timestamp(0, tz="UTC")).dt.total_seconds().to_numpy(dtype=np.float64)


def sorted_or_fail(source: str, rows: np.ndarray, t: np.ndarray, what: str = "time",
                   strict: bool = False) -> None:
    """Fail at the first row whose ``t`` steps backwards (or repeats, with ``strict``)."""
    d = np.diff(t)
    bad = np.flatnonzero(d <= 0 if strict else d < 0)
    if bad.size:
        i = bad[0] + 1
        raise fail(source, int(rows[i]), f"{what} {t[i]:g} comes {'at or ' if strict else ''}before the "
                   f"previous row's {t[i - 1]:g}", f"this format must be sorted by {what}; sort the rows")
