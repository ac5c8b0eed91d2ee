"""Readers for the JSON trace formats.

- ``json-counts`` (SkyPilot "Can't Be Late" traces, SpotHedge): one object
  ``{"metadata": {"gap_seconds": G}, "data": [n0, n1, ...], ["prices": [...]]}``; ``data[i]``
  nodes are available from ``i*G`` seconds on.
- ``parcae-segment`` (Parcae): one JSON array per line, ``[t_ms, op, {"nodes": [...],
  "duration": ms, "<policy>_strategy": [dp, pp], ...}]`` with ``op`` in ``add``, ``remove``,
  ``no-op``, ``migration``; each line covers ``duration`` ms.
- ``spotserve-segment`` (SpotServe): one JSON array per line, ``[t_ms, op, {"nodes": [...],
  ["required_tpt": x]}]`` with ``op`` in ``add``, ``remove``, ``other`` and a final ``DONE``.
- ``parcae-liveput`` (Parcae): a JSON list of per-interval records ``{"interval": [n_before,
  n_added, n_removed], "duration": ms, ...}``; the removals of an interval come first.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

from .schema import fail, finish, from_counts, from_deltas

__all__ = ["read_json_counts", "read_parcae_segment", "read_spotserve_segment", "read_parcae_liveput"]

_SEGMENT = {
    "parcae-segment": {"ops": {"add": 1, "remove": -1, "no-op": 0, "migration": 0},
                       "keys": {"nodes", "duration", "throughput_opt_strategy", "liveput_truth_strategy",
                                "liveput_predict_strategy"}},
    "spotserve-segment": {"ops": {"add": 1, "remove": -1, "other": 0, "DONE": 0},
                          "keys": {"nodes", "required_tpt"}},
}
_LIVEPUT_KEYS = {"interval", "duration", "throughut-opt", "liveput-truth", "liveput-predict"}


def _decode(source: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        tail = " (the file looks truncated)" if e.pos >= len(text.rstrip()) else ""
        raise fail(source, e.lineno, f"malformed JSON at column {e.colno}: {e.msg}{tail}",
                   "repair the file or fetch it again") from None


def _whole(x: np.ndarray) -> np.ndarray:
    return np.isfinite(x) & (x == np.round(x))


def read_json_counts(source: str, text: str, notice: float | None = None) -> pd.DataFrame:
    """Read a ``{"metadata": {"gap_seconds"}, "data": [...]}`` node-count series."""
    obj = _decode(source, text)
    if not isinstance(obj, dict) or "data" not in obj or "metadata" not in obj:
        raise fail(source, None, "the JSON is not an object with 'metadata' and 'data'",
                   "a json-counts trace is {\"metadata\": {\"gap_seconds\": G}, \"data\": [counts]}")
    unknown = sorted(set(obj) - {"metadata", "data", "prices"})
    if unknown:
        raise fail(source, None, f"unknown columns {unknown}", "the known keys are metadata, data and prices")
    gap = obj["metadata"].get("gap_seconds") if isinstance(obj["metadata"], dict) else None
    if not isinstance(gap, (int, float)) or isinstance(gap, bool) or not gap > 0:
        raise fail(source, None, f"metadata.gap_seconds is {gap!r}", "set it to the tick length in seconds (> 0)")
    data = obj["data"]
    if not isinstance(data, list) or not data:
        raise fail(source, None, "'data' is empty or not a list", "data lists the node count at every tick")
    c = pd.to_numeric(pd.Series(data, dtype=object), errors="coerce").to_numpy(dtype=np.float64)
    bad = np.flatnonzero(~_whole(c))
    if bad.size:
        raise fail(source, bad[0] + 1, f"data[{bad[0]}] = {data[bad[0]]!r} is not a whole number",
                   "each tick holds a node count")
    bad = np.flatnonzero(c < 0)
    if bad.size:
        raise fail(source, bad[0] + 1, f"data[{bad[0]}] = {data[bad[0]]} is a negative count",
                   "node counts must be >= 0")
    initial, ev = from_counts(np.arange(c.size) * float(gap), c.astype(np.int64))
    return finish(ev, source=source, fmt="json-counts", initial=initial, duration=c.size * float(gap),
                  notice=notice, gap_seconds=float(gap))


def _json_lines(source: str, text: str) -> tuple[list, np.ndarray]:
    raw = pd.Series(text.split("\n"), dtype=object).str.strip()
    keep = (raw != "").to_numpy()
    rows = np.flatnonzero(keep) + 1
    body = raw[keep].tolist()
    if not body:
        raise fail(source, None, "the file holds no data rows", "check that it is the trace you meant")
    try:
        return json.loads("[" + ",".join(body) + "]"), rows
    except json.JSONDecodeError:
        for i, line in enumerate(body):       # error path only: find the row that does not parse
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                tail = " (the file looks truncated)" if i == len(body) - 1 else ""
                raise fail(source, int(rows[i]), f"malformed JSON at column {e.colno}: {e.msg}{tail}",
                           "each line must be one JSON array [t_ms, op, {...}]") from None
        raise fail(source, None, "malformed JSON", "each line must be one JSON array [t_ms, op, {...}]")


def _read_segment(source: str, text: str, fmt: str, notice: float | None) -> pd.DataFrame:
    spec = _SEGMENT[fmt]
    entries, rows = _json_lines(source, text)
    shape_ok = [isinstance(e, list) and len(e) == 3 and isinstance(e[2], dict) for e in entries]
    if not all(shape_ok):
        i = shape_ok.index(False)
        raise fail(source, int(rows[i]), "the entry is not [t_ms, op, {...}]",
                   "each line must be one JSON array [t_ms, op, {\"nodes\": [...]}]")
    df = pd.DataFrame(entries, columns=["t", "op", "info"])
    t = pd.to_numeric(df["t"], errors="coerce").to_numpy(dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(t) | (t < 0))
    if bad.size:
        raise fail(source, int(rows[bad[0]]), f"time {df['t'].iloc[bad[0]]!r} is not a time >= 0 in ms",
                   "the first element of each line is milliseconds from the start")
    d = np.diff(t)
    if np.any(d < 0):
        i = int(np.flatnonzero(d < 0)[0]) + 1
        raise fail(source, int(rows[i]), f"time {t[i]:g} ms comes before the previous row's {t[i - 1]:g} ms",
                   "this format must be sorted by time; sort the lines")
    op = df["op"].to_numpy()
    bad = np.flatnonzero(~np.isin(op, list(spec["ops"])))
    if bad.size:
        raise fail(source, int(rows[bad[0]]), f"op {op[bad[0]]!r} is not one of {sorted(spec['ops'])}",
                   f"pass the right format= ({fmt} was used)")
    keys = df["info"].map(lambda x: frozenset(x) - spec["keys"])
    bad = np.flatnonzero(keys.map(bool).to_numpy())
    if bad.size:
        raise fail(source, int(rows[bad[0]]), f"unknown columns {sorted(keys.iloc[bad[0]])}",
                   f"{fmt} rows carry {sorted(spec['keys'])}")
    nodes = df["info"].map(lambda x: x.get("nodes"))
    bad = np.flatnonzero(~nodes.map(lambda x: isinstance(x, list)).to_numpy())
    if bad.size:
        raise fail(source, int(rows[bad[0]]), "the row has no 'nodes' list", "add \"nodes\": [...] to the row")
    sign = df["op"].map(spec["ops"]).to_numpy(dtype=np.int64)
    n = nodes.map(len).to_numpy(dtype=np.int64)
    per_node = pd.DataFrame({"row": np.repeat(np.arange(len(df)), n), "sign": np.repeat(sign, n),
                             "node": [x for xs in nodes for x in xs]})
    per_node = per_node[per_node["sign"] != 0]
    nth = per_node.groupby("node", sort=False).cumcount().to_numpy()
    bad = np.flatnonzero((per_node["sign"].to_numpy() > 0) != (nth % 2 == 0))
    if bad.size:
        r = per_node.iloc[bad[0]]
        what = "adds" if r["sign"] > 0 else "removes"
        state = "already up" if r["sign"] > 0 else "not up"
        raise fail(source, int(rows[r["row"]]), f"{what} node {r['node']!r}, which is {state}",
                   "a node must be added before it is removed, and removed before it is added again")
    if fmt == "spotserve-segment":
        done = np.flatnonzero(op == "DONE")
        if done.size == 0:
            raise fail(source, int(rows[-1]), "the trace ends without a DONE line (the file looks truncated)",
                       "a SpotServe segment ends with [t_ms, \"DONE\", {\"nodes\": []}]")
        if done[0] != len(df) - 1:
            raise fail(source, int(rows[done[0] + 1]), "a row follows the DONE line", "DONE must be the last line")
        duration = t[-1] / 1000.0
    else:
        dur = pd.to_numeric(df["info"].map(lambda x: x.get("duration", 0)), errors="coerce").to_numpy()
        duration = float(t[-1] + (dur[-1] if np.isfinite(dur[-1]) else 0.0)) / 1000.0
    initial, ev = from_deltas(t / 1000.0, sign * n)
    return finish(ev, source=source, fmt=fmt, initial=initial, duration=duration, notice=notice)


def read_parcae_segment(source: str, text: str, notice: float | None = None) -> pd.DataFrame:
    """Read a Parcae one-hour replay segment (JSON lines)."""
    return _read_segment(source, text, "parcae-segment", notice)


def read_spotserve_segment(source: str, text: str, notice: float | None = None) -> pd.DataFrame:
    """Read a SpotServe replay segment (JSON lines ending in DONE)."""
    return _read_segment(source, text, "spotserve-segment", notice)


def read_parcae_liveput(source: str, text: str, notice: float | None = None) -> pd.DataFrame:
    """Read Parcae's per-interval liveput results (``interval`` = [before, added, removed])."""
    obj = _decode(source, text)
    if not isinstance(obj, list) or not obj or not all(isinstance(e, dict) for e in obj):
        raise fail(source, None, "the JSON is not a non-empty list of objects",
                   "a parcae-liveput trace is [{\"interval\": [n, added, removed], \"duration\": ms}, ...]")
    unknown = [sorted(set(e) - _LIVEPUT_KEYS) for e in obj]
    bad = [i for i, u in enumerate(unknown) if u]
    if bad:
        raise fail(source, bad[0] + 1, f"unknown columns {unknown[bad[0]]}",
                   f"the known keys are {sorted(_LIVEPUT_KEYS)}")
    iv = [e.get("interval") for e in obj]
    ok = [isinstance(x, list) and len(x) == 3 for x in iv]
    if not all(ok):
        i = ok.index(False)
        raise fail(source, i + 1, f"interval {iv[i]!r} is not [before, added, removed]", "fix the row")
    a = pd.DataFrame(iv).apply(pd.to_numeric, errors="coerce").to_numpy(dtype=np.float64)
    dur = pd.to_numeric(pd.Series([e.get("duration") for e in obj], dtype=object),
                        errors="coerce").to_numpy(dtype=np.float64)
    bad = np.flatnonzero(~_whole(a).all(axis=1) | ~np.isfinite(dur))
    if bad.size:
        raise fail(source, bad[0] + 1, f"interval {iv[bad[0]]} or duration {dur[bad[0]]} is not a number",
                   "intervals hold whole node counts and durations milliseconds")
    bad = np.flatnonzero((a < 0).any(axis=1) | (dur <= 0))
    if bad.size:
        raise fail(source, bad[0] + 1, f"interval {iv[bad[0]]} has a negative count or its duration "
                   f"{dur[bad[0]]:g} is not > 0", "node counts must be >= 0 and durations > 0")
    a = a.astype(np.int64)
    after = a[:, 0] + a[:, 1] - a[:, 2]
    bad = np.flatnonzero(a[1:, 0] != after[:-1])
    if bad.size:
        i = bad[0] + 1
        raise fail(source, i + 1, f"the interval starts with {a[i, 0]} nodes but the previous one ends with "
                   f"{after[i - 1]}", "a row is missing or altered; intervals must chain")
    bad = np.flatnonzero(a[:, 0] < a[:, 2])
    if bad.size:
        raise fail(source, bad[0] + 1, f"the interval removes {a[bad[0], 2]} of {a[bad[0], 0]} nodes",
                   "an interval cannot remove more nodes than it starts with")
    t = np.concatenate([[0.0], np.cumsum(dur)[:-1]]) / 1000.0
    initial, ev = from_deltas(np.repeat(t, 2), np.stack([-a[:, 2], a[:, 1]], axis=1).ravel(), int(a[0, 0]))
    return finish(ev, source=source, fmt="parcae-liveput", initial=initial, duration=float(dur.sum()) / 1000.0,
                  notice=notice)
