"""Format registry, detection, :func:`load` and :func:`save` for preemption traces."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from ..errors import TraceFormatError
from . import csv_formats, json_formats, log_formats
from .schema import check, fail
from .curves import describe
from .shipped import index, resolve, root, shipped

__all__ = ["TraceFormat", "FORMATS", "formats", "detect", "load", "save", "catalog"]


@dataclass(frozen=True)
class TraceFormat:
    """One trace file format: its name, what a row holds, where it comes from, and its reader."""

    name: str
    layout: str
    sources: str
    reader: Callable[..., pd.DataFrame]


FORMATS: dict[str, TraceFormat] = {f.name: f for f in (
    TraceFormat("event-log", "time_ms,action,node (one node added/removed per row)", "Bamboo, Oobleck",
                csv_formats.read_event_log),
    TraceFormat("count-series", "YYYY-MM-DD, HH:MM:SS, count (echoed observations)", "Bamboo (GCP)",
                csv_formats.read_count_series),
    TraceFormat("step-plot", "x,count (a change is two rows at the same x)", "Bamboo (AWS 2020)",
                csv_formats.read_step_plot),
    TraceFormat("probe-log", "tick,ISO time,fail (capacity probes)", "SkyPilot raw probes",
                csv_formats.read_probe_log),
    TraceFormat("json-counts", '{"metadata": {"gap_seconds"}, "data": [count per tick]}',
                "SkyPilot spot traces, SpotHedge", json_formats.read_json_counts),
    TraceFormat("parcae-segment", "JSON lines [t_ms, op, {nodes, duration, strategies}]", "Parcae",
                json_formats.read_parcae_segment),
    TraceFormat("spotserve-segment", "JSON lines [t_ms, op, {nodes}] ending in DONE", "SpotServe",
                json_formats.read_spotserve_segment),
    TraceFormat("parcae-liveput", 'JSON list of {"interval": [before, added, removed], "duration"}',
                "Parcae", json_formats.read_parcae_liveput),
    TraceFormat("dime-log", "[ISO time] instance lifecycle message", "Training on a Dime",
                log_formats.read_dime_log),
    TraceFormat("parashift-csv", "header time,event,count,available[,notice] or time,available",
                "parashift.traces.save", csv_formats.read_parashift_csv),
)}

_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_ISO = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}")
_NUM = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def formats() -> pd.DataFrame:
    """The readable formats: one row per format name with its layout and sources."""
    return pd.DataFrame([{"format": f.name, "layout": f.layout, "sources": f.sources}
                         for f in FORMATS.values()]).set_index("format")


def detect(text: str, source: str = "<text>") -> str:
    """The format name of a trace file's text (from its first data line)."""
    first, row = None, 0
    for row, line in enumerate(text.split("\n"), start=1):
        s = line.strip().lstrip("\ufeff")
        if s and not s.startswith("#"):
            first = s
            break
    if first is None:
        raise fail(source, None, "the file is empty", "check that it is the trace you meant")
    if first.startswith("{"):
        return "json-counts"
    if first.startswith("["):
        if _ISO.match(first[1:]):
            return "dime-log"
        if first == "[" or first.replace(" ", "").startswith("[{"):
            return "parcae-liveput"
        if any(k in first for k in ('"duration"', '"no-op"', '"migration"', "_strategy")):
            return "parcae-segment"
        return "spotserve-segment"
    cells = [c.strip() for c in first.split(",")]
    header = tuple(c.lower() for c in cells)
    if header in csv_formats.HEADERS:
        return csv_formats.HEADERS[header]
    if len(cells) == 3 and cells[1].lower() in ("add", "remove"):
        return "event-log"
    if len(cells) == 3 and _DATE.match(cells[0]):
        return "count-series"
    if len(cells) == 3 and _ISO.match(cells[1]):
        return "probe-log"
    if len(cells) == 2 and all(_NUM.match(c) for c in cells):
        return "step-plot"
    if not any(_NUM.match(c) or _DATE.match(c) for c in cells):
        known = {name for h in csv_formats.HEADERS for name in h}
        unknown = [c for c in cells if c.lower() not in known]
        problem = (f"unknown columns in the header ({len(unknown)} of {len(cells)})" if unknown
                   else "the header is not a complete set of columns")
        raise fail(source, row, problem,
                   "headers this loader knows: " + "; ".join(",".join(h) for h in csv_formats.HEADERS))
    raise fail(source, row, "cannot tell the format from its first line",
               f"pass format= one of {list(FORMATS)}")


def load(path: str | Path, format: str | None = None, *, notice: float | None = None,
         time_unit: str | None = None) -> pd.DataFrame:
    """Read a preemption/availability trace into the normalized schema.

    ``path``: a file, or the name of a shipped trace (e.g. ``"bamboo/p3-trace.csv"``).
    ``format``: one of :func:`formats` (detected when None). ``notice``: seconds of warning to
    assume for every preemption the file gives none for (NaN otherwise). ``time_unit``: ``"s"``,
    ``"min"`` or ``"h"`` for ``step-plot`` files. Raises TraceFormatError naming the file and row.
    """
    p = resolve(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(p, None, f"not a UTF-8 text file ({e.reason} at byte {e.start})",
                   "pass a text trace (CSV, JSON or log)") from None
    if not text.strip():
        raise fail(p, None, "the file is empty", "check that it is the trace you meant")
    from ..validate import MAX_DEPTH, _depth
    if _depth(text) > MAX_DEPTH:
        raise fail(p, None, f"it nests deeper than {MAX_DEPTH} levels", "pass a trace file, not arbitrary JSON")
    fmt = format or detect(text, str(p))
    if fmt not in FORMATS:
        raise TraceFormatError(f"unknown trace format {fmt!r}; pass one of {list(FORMATS)} or None to detect it")
    opts = {}
    if time_unit is not None:
        if fmt != "step-plot":
            raise TraceFormatError(f"time_unit applies only to step-plot files, not {fmt}; drop it")
        opts["time_unit"] = time_unit
    return FORMATS[fmt].reader(str(p), text, notice=notice, **opts)


def save(df: pd.DataFrame, path: str | Path) -> Path:
    """Write a normalized trace as a ``parashift-csv`` file that :func:`load` reads back."""
    check(df)
    p = Path(path)
    csv_formats.write_parashift_csv(df, p)
    return p


def catalog(pattern: str | None = None) -> pd.DataFrame:
    """One row per shipped trace: its path (relative), format, source, license and summary numbers."""
    base = root()
    listed = index()
    idx = listed.set_index("path") if len(listed) else None
    rows = []
    for p in shipped(pattern):
        rel = p.relative_to(base).as_posix()
        d = describe(load(p))
        meta = idx.loc[rel].to_dict() if idx is not None and rel in idx.index else {}
        rows.append({"path": rel, **{k: v for k, v in d.items() if k != "source"},
                     **{k: meta[k] for k in ("source", "license", "nodes") if k in meta}})
    return pd.DataFrame(rows)
