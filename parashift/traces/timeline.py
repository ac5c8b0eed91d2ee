"""Execution timelines (simulated or measured) saved and loaded as Chrome-trace JSON, parquet or CSV.

A timeline is a DataFrame with one row per executed instruction; the columns of
:data:`TIMELINE_COLUMNS` are required (times in seconds), an optional ``rank`` is checked as an
integer, and any other columns are kept. In the Chrome
trace format (what chrome://tracing and Perfetto open) each row is an ``"X"`` event with
``ts``/``dur`` in microseconds, ``pid`` = device and ``tid`` = the stream's index, named by a
``thread_name`` metadata event; every column is also kept in the event's ``args``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import TraceFormatError
from ..ir.program import TIMELINE_KINDS

__all__ = ["TIMELINE_COLUMNS", "check_timeline", "save_timeline", "load_timeline"]

#: required timeline columns and their kinds (int, nullable int, float, text, nullable text);
#: ``rank`` is optional in a saved timeline
TIMELINE_COLUMNS = {k: v for k, v in TIMELINE_KINDS.items() if k != "rank"}
_KINDS = (".json", ".parquet", ".csv")


def _kind(path: Path, format: str | None) -> str:
    kind = f".{format.lstrip('.')}" if format else path.suffix.lower()
    if kind not in _KINDS:
        raise TraceFormatError(f"{path}: cannot tell the timeline format from {kind or 'no suffix'!r}; "
                               f"use a {', '.join(_KINDS)} file name or pass format='json'|'parquet'|'csv'")
    return kind


def check_timeline(df: pd.DataFrame, source: str = "timeline") -> pd.DataFrame:
    """The timeline with canonical column types, or TraceFormatError naming what is wrong."""
    if not isinstance(df, pd.DataFrame):
        raise TraceFormatError(f"{source} is a {type(df).__name__}, not a DataFrame; pass the simulator's "
                               "or profiler's timeline table")
    missing = [c for c in TIMELINE_COLUMNS if c not in df.columns]
    if missing:
        raise TraceFormatError(f"{source} lacks the timeline columns {missing} (it has {list(df.columns)}); "
                               f"a timeline needs {list(TIMELINE_COLUMNS)}")
    out = df.reset_index(drop=True).copy()
    for col, kind in TIMELINE_COLUMNS.items():
        s = out[col]
        if kind.startswith("text"):
            text = s.astype(str).to_numpy(dtype=object)
            text[s.isna().to_numpy()] = None
            out[col] = pd.Series(text, index=out.index, dtype=object)
            if kind == "text" and out[col].isna().any():
                i = int(np.flatnonzero(out[col].isna().to_numpy())[0])
                raise TraceFormatError(f"{source}, row {i + 1}: column {col!r} is empty; every row needs a {col}")
            continue
        num = pd.to_numeric(s, errors="coerce")
        bad = np.flatnonzero((num.isna() & s.notna()).to_numpy() | (num.isna().to_numpy() & (kind[-1] != "?")))
        if kind.startswith("int"):
            v = num.to_numpy(dtype=np.float64, na_value=np.nan)
            bad = np.union1d(bad, np.flatnonzero(np.isfinite(v) & (v != np.round(v))))
        if bad.size:
            i = int(bad[0])
            raise TraceFormatError(f"{source}, row {i + 1}: column {col!r} holds {s.iloc[i]!r}, not a "
                                   f"{'whole number' if kind.startswith('int') else 'number'}")
        out[col] = (num.astype("Int64") if kind == "int?" else num.astype(np.int64) if kind == "int"
                    else num.astype(np.float64))
    if "rank" in out:         # optional: the simulator's and profiler's logical rank
        rank = pd.to_numeric(out["rank"], errors="coerce")
        if rank.isna().any():
            i = int(np.flatnonzero(rank.isna().to_numpy())[0])
            raise TraceFormatError(f"{source}, row {i + 1}: column 'rank' holds {out['rank'].iloc[i]!r}, "
                                   "not a whole number")
        out["rank"] = rank.astype(np.int64)
    bad = np.flatnonzero((out["end"] < out["start"]).to_numpy())
    if bad.size:
        i = int(bad[0])
        raise TraceFormatError(f"{source}, row {i + 1}: end {out['end'].iloc[i]} is before start "
                               f"{out['start'].iloc[i]}; times are seconds and an instruction ends after it starts")
    return out


def _chrome(df: pd.DataFrame) -> dict:
    streams = sorted(df["stream"].unique())
    tid = df["stream"].map({s: i for i, s in enumerate(streams)}).to_numpy()
    mb = df["microbatch"]
    name = df["op"].where(df["phase"].isna(), df["op"] + ":" + df["phase"].fillna(""))
    name = name.where(mb.isna(), name + " mb" + mb.astype(str))
    args = df.astype(object).where(df.notna(), None).to_dict(orient="records")
    events = [{"name": n, "cat": c, "ph": "X", "ts": ts, "dur": d, "pid": p, "tid": t, "args": a}
              for n, c, ts, d, p, t, a in zip(name, df["phase"].fillna(df["op"]), df["start"] * 1e6,
                                              (df["end"] - df["start"]) * 1e6, df["device"].tolist(),
                                              tid.tolist(), args)]
    meta = [{"name": "process_name", "ph": "M", "pid": int(d), "tid": 0, "args": {"name": f"device {d}"}}
            for d in sorted(df["device"].unique())]
    pairs = df.assign(tid=tid)[["device", "stream", "tid"]].drop_duplicates()
    meta += [{"name": "thread_name", "ph": "M", "pid": int(d), "tid": int(t), "args": {"name": s}}
             for d, s, t in pairs.itertuples(index=False)]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"schema": "parashift.timeline/1", "columns": list(df.columns)}}


def _jsonable(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"cannot write {type(o).__name__} to a Chrome trace")


def save_timeline(df: pd.DataFrame, path: str | Path, format: str | None = None) -> Path:
    """Write a timeline as Chrome-trace ``.json``, ``.parquet`` or ``.csv`` (by suffix or ``format``)."""
    p = Path(path)
    kind = _kind(p, format)
    tl = check_timeline(df)
    if kind == ".json":
        p.write_text(json.dumps(_chrome(tl), default=_jsonable))
    elif kind == ".parquet":
        tl.to_parquet(p, index=False)
    else:
        tl.to_csv(p, index=False)
    return p


def _from_chrome(p: Path) -> pd.DataFrame:
    try:
        obj = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{p}, row {e.lineno}: malformed JSON ({e.msg}); the file looks truncated "
                               "or is not a Chrome trace") from None
    events = obj.get("traceEvents") if isinstance(obj, dict) else obj
    if not isinstance(events, list):
        raise TraceFormatError(f"{p}: no 'traceEvents' list; this is not a Chrome trace")
    xs = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    other = obj.get("otherData") if isinstance(obj, dict) else None
    cols = other.get("columns") if isinstance(other, dict) else None
    df = pd.DataFrame([e.get("args") or {} for e in xs], columns=cols)
    if not xs:
        return df
    # ts/dur/pid are what viewers show: they win over args
    ts = np.array([e.get("ts", np.nan) for e in xs], dtype=np.float64)
    dur = np.array([e.get("dur", np.nan) for e in xs], dtype=np.float64)
    df["start"], df["end"] = ts / 1e6, (ts + dur) / 1e6
    df["device"] = [e.get("pid") for e in xs]
    # traces written by other tools: stream from the thread's name (or a string tid), op from the
    # category, micro-batch from a trailing " m<k>"/" mb<k>" in the event's name
    if "stream" not in df or df["stream"].isna().all():
        names = {(m.get("pid"), m.get("tid")): (m.get("args") or {}).get("name") for m in events
                 if isinstance(m, dict) and m.get("ph") == "M" and m.get("name") == "thread_name"}
        df["stream"] = [names.get((e.get("pid"), e.get("tid")), e.get("tid")) for e in xs]
    if "op" not in df:
        df["op"] = [e.get("cat") for e in xs]
    if "microbatch" not in df:
        mb = pd.Series([str(e.get("name", "")) for e in xs]).str.extract(r"\sm(?:b)?(\d+)$")[0]
        df["microbatch"] = pd.to_numeric(mb).astype("Int64")
    return df


def load_timeline(path: str | Path, format: str | None = None) -> pd.DataFrame:
    """Read a timeline written by :func:`save_timeline` (or any table with the timeline columns)."""
    p = Path(path)
    kind = _kind(p, format)
    if not p.is_file():
        raise TraceFormatError(f"{p}: no such timeline file; pass the path save_timeline wrote")
    if kind == ".json":
        df = _from_chrome(p)
    elif kind == ".parquet":
        try:
            df = pd.read_parquet(p)
        except Exception as e:  # pyarrow raises several types for a bad file
            raise TraceFormatError(f"{p}: not a readable parquet file ({e}); write it with save_timeline") from None
    else:
        try:
            df = pd.read_csv(p)
        except (pd.errors.EmptyDataError, pd.errors.ParserError) as e:
            raise TraceFormatError(f"{p}: not a readable CSV timeline ({e}); write it with save_timeline") from None
    return check_timeline(df, str(p))
