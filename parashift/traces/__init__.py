"""Preemption/availability traces and execution timelines (pandas, no torch).

>>> from parashift import traces
>>> df = traces.load("bamboo/p3-trace.csv")        # a file path or a shipped trace's name
>>> curve = traces.availability(df)                   # time, available
>>> plan = traces.scale(df, devices_per_node=0.125, max_devices=4, time_scale=600)

Every loader returns the normalized schema of :mod:`parashift.traces.schema`: columns
``time``, ``event`` (``preempt``/``add``), ``count``, ``available``, ``notice``, with ``attrs``
``source``, ``format``, ``initial``, ``duration``, ``start``, ``offset``.
"""
from __future__ import annotations

from .curves import SCALED_COLUMNS, availability, describe, scale, window
from .loader import FORMATS, TraceFormat, catalog, detect, formats, load, save
from .schema import COLUMNS, EVENTS, NOTICE_SECONDS, check
from .shipped import ENV, index, resolve, root, shipped
from .timeline import TIMELINE_COLUMNS, check_timeline, load_timeline, save_timeline

__all__ = [
    "load", "save", "detect", "formats", "FORMATS", "TraceFormat", "check", "COLUMNS", "EVENTS",
    "NOTICE_SECONDS", "catalog",
    "availability", "window", "describe", "scale", "SCALED_COLUMNS",
    "shipped", "resolve", "root", "index", "ENV",
    "save_timeline", "load_timeline", "check_timeline", "TIMELINE_COLUMNS",
]
