"""What to do with a normalized trace: its availability curve, windows, summary, and scaling
onto this machine's devices for a live replay."""
from __future__ import annotations

import math
import numbers

import numpy as np
import pandas as pd

from ..errors import TraceFormatError
from .schema import check, events_frame, initial_of

__all__ = ["availability", "window", "describe", "scale", "SCALED_COLUMNS"]

#: columns of a scaled replay schedule
SCALED_COLUMNS = ("time", "trace_time", "event", "count", "devices", "notice")


def _duration(df: pd.DataFrame) -> float:
    last = float(df["time"].iloc[-1]) if len(df) else 0.0
    return max(float(df.attrs.get("duration", last)), last)


def availability(df: pd.DataFrame) -> pd.DataFrame:
    """The step curve of available nodes: ``time``, ``available`` from 0 to the trace's end.

    Row 0 is the starting pool at time 0; each event adds a row; a last row at the trace's
    duration closes the curve when the trace runs past its last event.
    """
    check(df)
    t = np.concatenate([[0.0], df["time"].to_numpy(dtype=np.float64)])
    a = np.concatenate([[initial_of(df)], df["available"].to_numpy(dtype=np.int64)])
    end = _duration(df)
    if end > t[-1]:
        t, a = np.append(t, end), np.append(a, a[-1])
    out = pd.DataFrame({"time": t, "available": a})
    out.attrs.update(df.attrs)
    return out


def window(df: pd.DataFrame, start: float = 0.0, end: float | None = None, rebase: bool = True) -> pd.DataFrame:
    """The events in ``(start, end]`` trace seconds, as a trace of its own.

    Events at or before ``start`` fold into the window's starting pool (``attrs['initial']``);
    with ``rebase`` times count from ``start`` (``attrs['offset']`` grows by ``start``).
    """
    check(df)
    dur = _duration(df)
    end = dur if end is None else float(end)
    if not (math.isfinite(start) and start >= 0 and end > start):
        raise TraceFormatError(f"window ({start}, {end}] is empty or negative; pass 0 <= start < end "
                               f"(the trace covers 0..{dur:g} s)")
    t = df["time"].to_numpy(dtype=np.float64)
    before = np.flatnonzero(t <= start)
    initial = int(df["available"].iloc[before[-1]]) if before.size else initial_of(df)
    out = df.loc[(t > start) & (t <= end)].reset_index(drop=True)
    if rebase:
        out["time"] = out["time"] - start
    out.attrs.update(df.attrs)
    out.attrs.update(initial=initial, duration=min(end, dur) - start if rebase else min(end, dur),
                     offset=float(df.attrs.get("offset", 0.0)) + (start if rebase else 0.0))
    return out


def describe(df: pd.DataFrame) -> dict:
    """Summary numbers: duration, starting/min/max/time-weighted mean nodes, preemptions, additions."""
    curve = availability(df)
    t, a = curve["time"].to_numpy(), curve["available"].to_numpy()
    span = t[-1] - t[0]
    mean = float(np.sum(np.diff(t) * a[:-1]) / span) if span > 0 else float(a[0])
    pre = df["event"].to_numpy() == "preempt"
    cnt = df["count"].to_numpy(dtype=np.int64)
    return {"source": df.attrs.get("source"), "format": df.attrs.get("format"), "duration_s": float(t[-1]),
            "initial": int(a[0]), "min": int(a.min()), "max": int(a.max()), "mean": mean,
            "preemptions": int(pre.sum()), "nodes_lost": int(cnt[pre].sum()),
            "largest_loss": int(cnt[pre].max()) if pre.any() else 0,
            "additions": int((~pre).sum()), "nodes_gained": int(cnt[~pre].sum())}


def scale(trace: pd.DataFrame, devices_per_node: float = 1, max_devices: int = 8, time_scale: float = 1.0,
          *, min_gap: float = 0.0) -> pd.DataFrame:
    """Map a trace onto this machine's devices and compress its time for a live replay.

    Nodes become ``clip(floor(nodes * devices_per_node), 1, max_devices)`` devices (a fraction
    such as ``0.125`` maps eight nodes onto one device, so a 10-32 node pool fits 4 processes);
    a trace second
    becomes ``1 / time_scale`` replay seconds (``time_scale=600`` plays ten trace minutes per
    second), notice periods included. Events at the same trace time merge into one; so do
    chains of events less than ``min_gap`` replay seconds apart (into the last one). Only events
    that change the device count remain. Returns columns ``time`` (replay s), ``trace_time``,
    ``event``, ``count`` (devices affected), ``devices`` (after) and ``notice`` (replay s; the
    shortest notice among merged preemptions); ``attrs['initial_devices']`` is the start.
    """
    check(trace)
    if isinstance(max_devices, bool) or not isinstance(max_devices, (int, np.integer)) or max_devices < 1:
        raise TraceFormatError(f"max_devices={max_devices!r} must be an integer >= 1")
    if (isinstance(devices_per_node, bool) or not isinstance(devices_per_node, numbers.Real)
            or not math.isfinite(devices_per_node) or devices_per_node <= 0):
        raise TraceFormatError(f"devices_per_node={devices_per_node!r} must be > 0 (e.g. 8 for 8-GPU nodes, "
                               "0.25 for four nodes per device)")
    if not (isinstance(time_scale, numbers.Real) and not isinstance(time_scale, bool)
            and math.isfinite(time_scale) and time_scale > 0):
        raise TraceFormatError(f"time_scale={time_scale!r} must be > 0 (trace seconds per replay second)")
    if not (math.isfinite(min_gap) and min_gap >= 0):
        raise TraceFormatError(f"min_gap={min_gap!r} must be >= 0 replay seconds")
    def devices(nodes: np.ndarray) -> np.ndarray:
        return np.clip(np.floor(nodes * float(devices_per_node) + 1e-9).astype(np.int64), 1, max_devices)

    dev0 = int(devices(np.asarray(initial_of(trace))))
    t = trace["time"].to_numpy(dtype=np.float64)
    dev = devices(trace["available"].to_numpy(dtype=np.int64))
    notice = np.where(trace["event"].to_numpy() == "preempt", trace["notice"].to_numpy(dtype=np.float64), np.nan)
    group = np.zeros(t.size, dtype=np.int64)
    if t.size:
        replay = t / time_scale
        new = np.ones(t.size, dtype=bool)
        new[1:] = (t[1:] != t[:-1]) & (np.diff(replay) >= min_gap)
        group = np.cumsum(new) - 1
    last = np.ones(t.size, dtype=bool)
    last[:-1] = group[1:] != group[:-1]
    g_notice = pd.Series(notice).groupby(group).min().to_numpy(dtype=np.float64) if t.size else notice
    tt, dd = t[last], dev[last]
    delta = dd - np.concatenate([[dev0], dd[:-1]])
    keep = delta != 0
    ev = events_frame(tt[keep] / time_scale, delta[keep], dd[keep], g_notice[keep] / time_scale)
    out = pd.DataFrame({"time": ev["time"], "trace_time": tt[keep], "event": ev["event"], "count": ev["count"],
                        "devices": ev["available"], "notice": ev["notice"]})
    out.attrs.update(trace.attrs)
    out.attrs.update(initial_devices=dev0, devices_per_node=float(devices_per_node), max_devices=int(max_devices),
                     time_scale=float(time_scale), duration=_duration(trace) / time_scale,
                     trace_duration=_duration(trace))
    return out
