"""Readers for the comma-separated trace formats.

- ``event-log`` (Bamboo, Oobleck): ``time_ms,action,node``, one node joining (``add``) or
  leaving (``remove``) per row, sorted by time.
- ``count-series`` (Bamboo's GCP logs): ``YYYY-MM-DD, HH:MM:SS, count``, the live node count
  sampled over time. Each observation is echoed on the next rows at later times with the same
  count, so the times of an echo may step back before the next observation: a run of equal
  counts is one observation, stamped with the run's first row.
- ``step-plot`` (Bamboo's 2020 AWS data): ``x,count`` drawn as a step plot (a change is two
  rows at the same x: the old count, then the new one); x in seconds, or in hours when any x
  is fractional (override with ``time_unit``).
- ``probe-log`` (SkyPilot's raw capacity probes): ``tick,ISO time,fail``, 1 node available
  when ``fail`` is 0.
- ``parashift-csv``: what :func:`parashift.traces.save` writes, a header
  ``time,event,count,available[,notice]`` (or ``time,available`` for a count curve), with
  optional ``# key: value`` comment lines for ``duration``, ``start``, ``initial``, ``source``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import _text as tx
from .schema import COLUMNS, EVENTS, events_frame, fail, finish, from_counts, from_deltas

__all__ = ["read_event_log", "read_count_series", "read_step_plot", "read_probe_log",
           "read_parashift_csv", "HEADERS", "write_parashift_csv"]

#: header lines a CSV trace may start with, and the format each one means
HEADERS = {
    ("time", "event", "count", "available"): "parashift-csv",
    ("time", "event", "count", "available", "notice"): "parashift-csv",
    ("time", "available"): "parashift-csv",
    ("time_ms", "action", "node"): "event-log",
}


def _skip_header(lines: tx.Lines, names: tuple[str, ...]) -> tx.Lines:
    first = tuple(s.strip().lower() for s in lines.text.iloc[0].split(","))
    if first == names:
        return tx.Lines(lines.source, lines.text.iloc[1:].reset_index(drop=True), lines.row[1:])
    return lines


def read_event_log(source: str, text: str, notice: float | None = None) -> pd.DataFrame:
    """Read a per-node event log (``time_ms,action,node``)."""
    lines = _skip_header(tx.lines_of(source, text), ("time_ms", "action", "node"))
    if len(lines) == 0:
        raise fail(source, None, "the file has a header but no rows", "add the node events")
    f = tx.fields(lines, ("time_ms", "action", "node"))
    t = tx.numbers(lines, f["time_ms"], "time_ms") / 1000.0
    neg = np.flatnonzero(t < 0)
    if neg.size:
        raise fail(source, int(lines.row[neg[0]]), f"time_ms {f['time_ms'].iloc[neg[0]]} is negative",
                   "times count milliseconds from the trace's start")
    tx.sorted_or_fail(source, lines.row, t, "time_ms")
    action = f["action"].str.lower().to_numpy()
    bad = np.flatnonzero(~np.isin(action, ("add", "remove")))
    if bad.size:
        i = bad[0]
        raise fail(source, int(lines.row[i]), "the action is not 'add' or 'remove'",
                   "each row adds or removes one node")
    is_add = action == "add"
    nth = f.groupby("node", sort=False).cumcount().to_numpy()   # how often this node was seen before
    bad = np.flatnonzero(is_add != (nth % 2 == 0))
    if bad.size:
        i = bad[0]
        node = f["node"].iloc[i]
        problem = (f"adds node {node!r}, which is already up" if is_add[i]
                   else f"removes node {node!r}, which is not up")
        raise fail(source, int(lines.row[i]), problem,
                   "a node must be added before it is removed, and removed before it is added again")
    initial, ev = from_deltas(t, np.where(is_add, 1, -1))
    return finish(ev, source=source, fmt="event-log", initial=initial, duration=float(t[-1]), notice=notice)


def read_count_series(source: str, text: str, notice: float | None = None) -> pd.DataFrame:
    """Read a dated node-count series (``YYYY-MM-DD, HH:MM:SS, count``) with echoed rows."""
    lines = tx.lines_of(source, text)
    f = tx.fields(lines, ("date", "time", "count"))
    t = tx.timestamps(lines, f["date"] + " " + f["time"], "date and time", "%Y-%m-%d %H:%M:%S")
    c = tx.integers(lines, f["count"], "count")
    first = np.ones(c.size, dtype=bool)
    first[1:] = c[1:] != c[:-1]                      # a run of equal counts is one observation
    run_start = t[first][np.cumsum(first) - 1]
    bad = np.flatnonzero(t < run_start)
    if bad.size:
        i = bad[0]
        raise fail(source, int(lines.row[i]), f"time {f['date'].iloc[i]} {f['time'].iloc[i]} comes before "
                   "the observation it repeats", "this format must be sorted by time; sort the rows")
    tx.sorted_or_fail(source, lines.row[first], t[first], "time (seconds since 1970)")
    t0 = float(t[0])
    initial, ev = from_counts(t[first] - t0, c[first])
    start = pd.Timestamp(t0, unit="s").isoformat()
    return finish(ev, source=source, fmt="count-series", initial=initial, duration=float(t.max() - t0),
                  start=start, notice=notice)


def read_step_plot(source: str, text: str, notice: float | None = None,
                   time_unit: str | None = None) -> pd.DataFrame:
    """Read a step-plot series (``x,count``); x in seconds, or hours (see module doc)."""
    lines = tx.lines_of(source, text)
    f = tx.fields(lines, ("x", "count"))
    x = tx.numbers(lines, f["x"], "x")
    neg = np.flatnonzero(x < 0)
    if neg.size:
        raise fail(source, int(lines.row[neg[0]]), f"x {f['x'].iloc[neg[0]]} is negative",
                   "x counts time from the trace's start")
    tx.sorted_or_fail(source, lines.row, x, "x")
    c = tx.integers(lines, f["count"], "count")
    if time_unit is None:
        time_unit = "h" if np.any(x != np.round(x)) else "s"
    scale = {"s": 1.0, "min": 60.0, "h": 3600.0}.get(time_unit)
    if scale is None:
        raise fail(source, None, f"time_unit {time_unit!r} is unknown", "pass time_unit='s', 'min' or 'h'")
    initial, ev = from_counts(x * scale, c)
    return finish(ev, source=source, fmt="step-plot", initial=initial, duration=float(x[-1] * scale),
                  notice=notice, time_unit=time_unit)


def read_probe_log(source: str, text: str, notice: float | None = None) -> pd.DataFrame:
    """Read a capacity-probe log (``tick,ISO time,fail``): 1 node when a probe succeeded."""
    lines = tx.lines_of(source, text)
    f = tx.fields(lines, ("tick", "time", "fail"))
    tick = tx.integers(lines, f["tick"], "tick")
    tx.sorted_or_fail(source, lines.row, tick.astype(np.float64), "tick", strict=True)
    t = tx.timestamps(lines, f["time"], "time")
    tx.sorted_or_fail(source, lines.row, t, "time")
    failed = tx.integers(lines, f["fail"], "fail")
    bad = np.flatnonzero(failed > 1)
    if bad.size:
        raise fail(source, int(lines.row[bad[0]]), f"fail {failed[bad[0]]} is not 0 or 1",
                   "fail is 1 when the probe got no capacity, else 0")
    initial, ev = from_counts(t - t[0], 1 - failed)
    return finish(ev, source=source, fmt="probe-log", initial=initial, duration=float(t[-1] - t[0]),
                  start=pd.Timestamp(t[0], unit="s").isoformat(), notice=notice)


def _comments(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#") and ":" in s:
            k, v = s[1:].split(":", 1)
            out[k.strip().lower()] = v.strip()
    return out


def read_parashift_csv(source: str, text: str, notice: float | None = None) -> pd.DataFrame:
    """Read the normalized CSV written by :func:`write_parashift_csv` (or a ``time,available`` curve)."""
    lines = tx.lines_of(source, text)
    header = tuple(s.strip().lower() for s in lines.text.iloc[0].split(","))
    if header not in HEADERS or HEADERS[header] != "parashift-csv":
        unknown = [h for h in header if h not in COLUMNS]
        raise fail(source, int(lines.row[0]), f"unknown columns {unknown or list(header)} in the header",
                   "a parashift CSV trace has the columns time,event,count,available[,notice] "
                   "or time,available")
    meta = _comments(text)
    body = tx.Lines(source, lines.text.iloc[1:].reset_index(drop=True), lines.row[1:])
    try:
        duration = float(meta.get("duration", 0.0) or 0.0)
        initial_meta = int(meta["initial"]) if meta.get("initial") else None
    except ValueError:
        raise fail(source, None, f"the comment lines hold duration={meta.get('duration')!r}, "
                   f"initial={meta.get('initial')!r}",
                   "write '# duration: <seconds>' and '# initial: <nodes>'") from None
    extra = {"start": meta.get("start") or None}
    if len(body) == 0:
        if initial_meta is None:
            raise fail(source, None, "the table has no rows and no '# initial: N' line",
                       "add the starting node count as a comment '# initial: N'")
        empty = events_frame(np.empty(0), np.empty(0), np.empty(0))
        return finish(empty, source=source, fmt="parashift-csv", initial=initial_meta,
                      duration=duration, notice=notice, **extra)
    f = tx.fields(body, header)
    t = tx.numbers(body, f["time"], "time")
    neg = np.flatnonzero(t < 0)
    if neg.size:
        raise fail(source, int(body.row[neg[0]]), f"time {t[neg[0]]:g} is negative",
                   "times count seconds from the trace's start")
    tx.sorted_or_fail(source, body.row, t)
    avail = tx.integers(body, f["available"], "available")
    if header == ("time", "available"):
        initial, ev = from_counts(t, avail)
        if t[0] > 0:                  # a curve that starts late had 0 nodes before its first point
            initial, ev = from_counts(np.concatenate([[0.0], t]), np.concatenate([[0], avail]))
        return finish(ev, source=source, fmt="parashift-csv", initial=initial,
                      duration=max(duration, float(t[-1])), notice=notice, **extra)
    event = f["event"].str.lower().to_numpy()
    bad = np.flatnonzero(~np.isin(event, EVENTS))
    if bad.size:
        raise fail(source, int(body.row[bad[0]]), f"event {f['event'].iloc[bad[0]]!r} is not one of {EVENTS}",
                   "use 'preempt' for lost nodes and 'add' for gained ones")
    count = tx.integers(body, f["count"], "count", minimum=1)
    signed = np.where(event == "preempt", -count, count)
    initial = int(avail[0] - signed[0])
    expect = initial + np.cumsum(signed)
    bad = np.flatnonzero(expect != avail)
    if bad.size:
        i = bad[0]
        raise fail(source, int(body.row[i]), f"available={avail[i]} but the events before leave {expect[i]}",
                   "available must change by count at every event")
    if initial < 0 or np.any(avail < 0):
        raise fail(source, int(body.row[0]), "the pool goes below 0 nodes", "counts must be >= 0")
    nt = (pd.to_numeric(f["notice"].replace("", np.nan), errors="coerce").to_numpy(dtype=np.float64)
          if "notice" in f else None)
    initial, ev = from_deltas(t, signed, initial, notice=nt, merge=False)
    return finish(ev, source=source, fmt="parashift-csv", initial=initial,
                  duration=max(duration, float(t[-1])), notice=notice, **extra)


def write_parashift_csv(df: pd.DataFrame, path) -> None:
    """Write a normalized trace as CSV with ``# key: value`` lines for its attrs."""
    a = df.attrs
    head = [f"# parashift trace (normalized); columns: {','.join(COLUMNS)}"]
    for k in ("source", "format", "initial", "duration", "start", "offset"):
        if a.get(k) is not None:
            head.append(f"# {k}: {a[k]}")
    with open(path, "w", newline="\n") as fh:
        fh.write("\n".join(head) + "\n")
        df.loc[:, list(COLUMNS)].to_csv(fh, index=False, lineterminator="\n")
