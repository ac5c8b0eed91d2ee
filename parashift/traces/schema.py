"""The normalized preemption-trace schema and the helpers every format reader shares.

A normalized trace is a pandas DataFrame with one row per change of the node pool:

- ``time``: float seconds from the trace's start (events at time 0 are folded into the
  initial pool, so every row has ``time > 0``), non-decreasing;
- ``event``: ``"preempt"`` (nodes lost) or ``"add"`` (nodes gained);
- ``count``: nodes affected, int > 0;
- ``available``: nodes available after the event, int >= 0;
- ``notice``: seconds of warning before a preemption, NaN where unknown (always NaN for adds).

``df.attrs`` holds ``source`` (file), ``format``, ``initial`` (nodes at time 0), ``duration``
(seconds the trace covers), ``start`` (absolute start as ISO text, or None) and ``offset``
(trace seconds cut off the front by :func:`parashift.traces.window`).
"""
from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..errors import TraceFormatError

__all__ = ["COLUMNS", "EVENTS", "NOTICE_SECONDS", "fail", "from_counts", "from_deltas", "events_frame",
           "finish", "check", "initial_of"]

#: the normalized columns, in order
COLUMNS = ("time", "event", "count", "available", "notice")
#: the two event kinds
EVENTS = ("preempt", "add")
#: the clouds' documented interruption notice in seconds (no shipped trace records one; pass
#: ``load(..., notice=NOTICE_SECONDS["aws"])`` to assume it)
NOTICE_SECONDS = {"aws": 120.0, "gcp": 30.0}


def fail(source: str | Path, row: int | None, problem: str, fix: str) -> TraceFormatError:
    """A TraceFormatError naming the file and (1-based) row: ``'<file>, row N: problem; fix'``."""
    where = f"{source}" if row is None else f"{source}, row {row}"
    return TraceFormatError(f"{where}: {problem}; {fix}")


def from_counts(times: np.ndarray, counts: np.ndarray) -> tuple[int, pd.DataFrame]:
    """Events from a node-count series (``counts[i]`` nodes from ``times[i]`` on).

    Returns the initial count (the last sample at time <= 0) and the events at the samples
    where the count changes; a sample that repeats the previous count is no event, and
    same-direction changes at one time merge. ``times`` must be non-decreasing.
    """
    counts = np.asarray(counts, dtype=np.int64)
    times = np.asarray(times, dtype=np.float64)
    if counts.size == 0:
        return 0, events_frame(np.empty(0), np.empty(0, np.int64), np.empty(0, np.int64))
    return from_deltas(times[1:], np.diff(counts), int(counts[0]))


def from_deltas(times: np.ndarray, deltas: np.ndarray, initial: int = 0,
                notice: np.ndarray | None = None, merge: bool = True) -> tuple[int, pd.DataFrame]:
    """Events from signed node changes in file order (+n gained, -n lost) at ``times``.

    Changes at time <= 0 are folded into the initial pool. With ``merge``, consecutive changes
    of the same sign at the same time become one event (their counts add up; the notice is
    the shortest). Zero changes are dropped. ``times`` must be non-decreasing.
    """
    times = np.asarray(times, dtype=np.float64)
    deltas = np.asarray(deltas, dtype=np.int64)
    notice = np.full(times.shape, np.nan) if notice is None else np.asarray(notice, dtype=np.float64)
    keep = deltas != 0
    times, deltas, notice = times[keep], deltas[keep], notice[keep]
    head = times <= 0
    initial = int(initial + deltas[head].sum())
    times, deltas, notice = times[~head], deltas[~head], notice[~head]
    if merge and times.size:
        sign = np.sign(deltas)
        new = np.ones(times.size, dtype=bool)
        new[1:] = (times[1:] != times[:-1]) | (sign[1:] != sign[:-1])
        group = np.cumsum(new) - 1
        deltas = np.bincount(group, weights=deltas).astype(np.int64)
        notice = pd.Series(notice).groupby(group).min().to_numpy(dtype=np.float64)
        times = times[new]
    available = initial + np.cumsum(deltas)
    return initial, events_frame(times, deltas, available, notice)


def events_frame(times: np.ndarray, deltas: np.ndarray, available: np.ndarray,
                 notice: np.ndarray | None = None) -> pd.DataFrame:
    """A normalized events table from signed changes (``-n``: preempt n, ``+n``: add n)."""
    deltas = np.asarray(deltas, dtype=np.int64)
    notice = np.full(deltas.shape, np.nan) if notice is None else np.asarray(notice, dtype=np.float64)
    return pd.DataFrame({
        "time": np.asarray(times, dtype=np.float64),
        "event": np.where(deltas < 0, "preempt", "add").astype(object),
        "count": np.abs(deltas),
        "available": np.asarray(available, dtype=np.int64),
        "notice": np.where(deltas < 0, notice, np.nan),
    })


def finish(df: pd.DataFrame, *, source: str | Path, fmt: str, initial: int, duration: float,
           start: str | None = None, notice: float | None = None, **extra: Any) -> pd.DataFrame:
    """Attach ``attrs``, fill a default notice for preemptions, and check the invariants."""
    df = df.reset_index(drop=True)
    if notice is not None:
        if not (isinstance(notice, numbers.Real) and not isinstance(notice, bool)
                and math.isfinite(notice) and notice >= 0):
            raise TraceFormatError(f"notice={notice!r} is not a number of seconds >= 0; "
                                   "pass e.g. notice=120 (AWS) or notice=30 (GCP)")
        pre = df["event"].to_numpy() == "preempt"
        df.loc[pre & df["notice"].isna().to_numpy(), "notice"] = float(notice)
    last = float(df["time"].iloc[-1]) if len(df) else 0.0
    df.attrs.update(source=str(source), format=fmt, initial=int(initial),
                    duration=max(float(duration), last), start=start, offset=0.0, **extra)
    if initial < 0:
        raise fail(source, None, f"the pool starts with {initial} nodes", "counts must be >= 0")
    bad = np.flatnonzero(df["available"].to_numpy() < 0)
    if bad.size:
        raise fail(source, None, f"event {bad[0] + 1} at t={df['time'].iloc[bad[0]]:g}s leaves "
                   f"{df['available'].iloc[bad[0]]} nodes", "a trace cannot remove more nodes than it has")
    return df


def initial_of(df: pd.DataFrame) -> int:
    """Nodes at the trace's start: from the first row when there is one, else ``attrs['initial']``."""
    if len(df):
        first = df.iloc[0]
        sign = -1 if first["event"] == "preempt" else 1
        return int(first["available"] - sign * first["count"])
    if "initial" not in df.attrs:
        raise TraceFormatError("an empty trace without attrs['initial']: the starting pool is unknown; "
                               "load the trace with parashift.traces.load or set df.attrs['initial']")
    return int(df.attrs["initial"])


def check(df: pd.DataFrame, what: str = "trace") -> pd.DataFrame:
    """Raise TraceFormatError unless ``df`` follows the normalized schema (returns ``df``)."""
    if not isinstance(df, pd.DataFrame):
        raise TraceFormatError(f"{what} is a {type(df).__name__}, not a DataFrame; "
                               "load it with parashift.traces.load(path)")
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise TraceFormatError(f"{what} lacks columns {missing}; a normalized trace has {list(COLUMNS)} "
                               "(load it with parashift.traces.load)")
    if len(df) == 0:
        return df
    t = df["time"].to_numpy(dtype=np.float64)
    bad = np.flatnonzero(np.diff(t) < 0)
    if bad.size:
        raise TraceFormatError(f"{what}, row {bad[0] + 2}: time {t[bad[0] + 1]:g} comes before "
                               f"{t[bad[0]]:g}; sort the rows by time")
    ev = df["event"].to_numpy()
    bad = np.flatnonzero(~np.isin(ev, EVENTS))
    if bad.size:
        raise TraceFormatError(f"{what}, row {bad[0] + 1}: event {ev[bad[0]]!r} is not one of {EVENTS}; "
                               "use 'preempt' for lost nodes and 'add' for gained ones")
    cnt = df["count"].to_numpy()
    bad = np.flatnonzero(cnt <= 0)
    if bad.size:
        raise TraceFormatError(f"{what}, row {bad[0] + 1}: count {cnt[bad[0]]} is not > 0; "
                               "an event affects at least one node")
    avail = df["available"].to_numpy(dtype=np.int64)
    signed = np.where(ev == "preempt", -1, 1) * cnt.astype(np.int64)
    before = np.concatenate([[avail[0] - signed[0]], avail[:-1]])
    bad = np.flatnonzero((before + signed != avail) | (avail < 0))
    if bad.size:
        i = bad[0]
        raise TraceFormatError(f"{what}, row {i + 1}: available={avail[i]} does not follow from "
                               f"{before[i]} nodes and {ev[i]} {cnt[i]}; fix the available column "
                               "(it must be >= 0 and change by count at each event)")
    return df
