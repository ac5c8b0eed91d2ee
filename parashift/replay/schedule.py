"""A preemption trace as a live job's schedule: scaled events, a strategy per device count, generations.

``replay_schedule`` loads (or takes) a trace, cuts the window, fills unknown notice periods,
maps nodes onto at most ``max_procs`` local processes and compresses time
(:func:`parashift.traces.scale`), then asks the search (over the simulator, for ``cpu-local``
with that many devices) which strategy to run after every event:

- ``best``: the best strategy of each device count (``plan_trace``'s ``hot-switch`` path);
- ``switch-aware``: the dynamic program of ``plan_trace`` that counts switch time as lost.

Devices are numbered ``0..n-1`` for a pool of ``n``: a preemption takes the highest ids, an
addition brings back the lowest free ones, and a strategy of world ``w`` runs on ``0..w-1``
(device 0, the job's clock, never leaves). No torch here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .. import models, traces
from ..errors import StrategyError, TraceFormatError
from ..strategy import Strategy

__all__ = ["POLICIES", "ReplayEvent", "ReplaySchedule", "replay_schedule", "DEFAULT_NOTICE"]

POLICIES = ("best", "switch-aware")
#: notice (trace seconds) assumed for preemptions a trace records none for (AWS spot's two minutes)
DEFAULT_NOTICE = traces.NOTICE_SECONDS["aws"]
_PLAN_POLICY = {"best": "hot-switch", "switch-aware": "switch-aware"}


@dataclass(frozen=True)
class ReplayEvent:
    """One scaled trace event: when (replay and trace seconds), what, the pool after it, the notice
    (replay seconds, preemptions only), and the strategy the job runs afterwards on devices 0..world-1."""

    index: int
    time: float
    trace_time: float
    event: str
    count: int
    devices: int
    notice: float
    strategy: Strategy

    @property
    def world(self) -> int:
        return self.strategy.world

    @property
    def announce(self) -> float:
        """Replay second at which the job hears of the event (notice before a preemption)."""
        lead = self.notice if self.event == "preempt" and math.isfinite(self.notice) else 0.0
        return max(0.0, self.time - lead)


@dataclass(frozen=True, eq=False)
class ReplaySchedule:
    """The replay plan: the starting pool and strategy, the events, the window's length (replay s)."""

    model: models.ModelSpec
    policy: str
    initial_devices: int
    initial_strategy: Strategy
    events: tuple[ReplayEvent, ...]
    duration: float
    time_scale: float
    devices_per_node: float
    trace: pd.DataFrame
    scaled: pd.DataFrame
    global_batch: int
    seq_len: int
    source: str

    def layouts(self) -> list[tuple[Strategy, tuple[int, ...]]]:
        """(strategy, devices) after the start and after every event."""
        out = [(self.initial_strategy, tuple(range(self.initial_strategy.world)))]
        out += [(e.strategy, tuple(range(e.world))) for e in self.events]
        return out

    def to_frame(self) -> pd.DataFrame:
        """One row per event: time, trace_time, event, count, devices, notice, announce, strategy, world."""
        return pd.DataFrame([{"time": e.time, "trace_time": e.trace_time, "event": e.event, "count": e.count,
                              "devices": e.devices, "notice": e.notice, "announce": e.announce,
                              "strategy": str(e.strategy), "world": e.world} for e in self.events],
                            columns=["time", "trace_time", "event", "count", "devices", "notice", "announce",
                                     "strategy", "world"])


def _load(trace: "str | Path | pd.DataFrame", notice: float) -> tuple[pd.DataFrame, str]:
    if isinstance(trace, pd.DataFrame):
        df = traces.check(trace.copy())
        df.attrs.update(trace.attrs)
        pre = (df["event"] == "preempt").to_numpy() & df["notice"].isna().to_numpy()
        df.loc[pre, "notice"] = float(notice)
        return df, str(trace.attrs.get("source", "<DataFrame>"))
    path = traces.resolve(trace)
    return traces.load(path, notice=notice), str(trace)


def _positive(name: str, v: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v) or v <= 0:
        raise StrategyError(f"{name}={v!r} must be a number > 0")
    return float(v)


def replay_schedule(trace: "str | Path | pd.DataFrame", model: "str | models.ModelSpec" = "tiny-gpt", *,
                    policy: str = "switch-aware", max_procs: int = 4, time_scale: float = 600.0,
                    start: float | None = None, end: float | None = None, max_events: int | None = None,
                    notice: float | None = None, devices_per_node: float | None = None, global_batch: int = 8,
                    seq_len: int | None = None, cost_model: Any = None) -> ReplaySchedule:
    """Plan the replay of ``trace`` (module doc). ``start``/``end``: a window in trace seconds;
    ``notice``: trace seconds of warning for preemptions that record none (default: AWS's 120);
    ``devices_per_node``: default ``max_procs / (most nodes in the window)``, so the busiest moment
    fills every process. Raises StrategyError / TraceFormatError with the fix on bad input."""
    if policy not in POLICIES:
        raise StrategyError(f"unknown strategy policy {policy!r}; use one of {', '.join(POLICIES)}")
    if isinstance(max_procs, bool) or not isinstance(max_procs, (int, np.integer)) or not 1 <= max_procs <= 64:
        raise StrategyError(f"max_procs={max_procs!r} must be an integer in 1..64 (local processes)")
    time_scale = _positive("time_scale", time_scale)
    notice = DEFAULT_NOTICE if notice is None else float(notice)
    if not (math.isfinite(notice) and notice >= 0):
        raise StrategyError(f"notice={notice!r} must be >= 0 trace seconds (e.g. 120 for AWS, 30 for GCP)")
    if max_events is not None and (isinstance(max_events, bool) or int(max_events) < 1):
        raise StrategyError(f"max_events={max_events!r} must be >= 1 (or None for every event)")
    spec = models.get(model)
    seq_len = int(seq_len or spec.seq_len)
    df, source = _load(trace, notice)
    if start is not None or end is not None:
        df = traces.window(df, float(start or 0.0), None if end is None else float(end))
    most = int(traces.describe(df)["max"])
    if most < 1:
        raise TraceFormatError(f"{source}: the window has no nodes at any time; pick a window with --from/--to "
                               f"where the pool is not empty")
    dpn = max_procs / most if devices_per_node is None else _positive("devices_per_node", devices_per_node)
    scaled = traces.scale(df, dpn, int(max_procs), time_scale)
    if max_events is not None:
        keep = scaled.iloc[:int(max_events)].copy()
        keep.attrs.update(scaled.attrs)
        if len(keep) < len(scaled):   # the replay ends where the next (dropped) event would have happened
            keep.attrs["duration"] = float(scaled["time"].iloc[int(max_events)])
        scaled = keep
    dev0 = int(scaled.attrs["initial_devices"])
    duration = float(scaled.attrs["duration"])
    if len(scaled) == 0:
        raise TraceFormatError(f"{source}: no event changes the device count in this window at {max_procs} "
                               f"processes ({dpn:g} devices per node); widen --from/--to, raise --max-procs or "
                               f"pass --devices-per-node")
    strategies = _strategies(scaled, spec, policy, int(max_procs), global_batch, seq_len, cost_model)
    events = tuple(ReplayEvent(i, float(r.time), float(r.trace_time), str(r.event), int(r.count), int(r.devices),
                               float(r.notice), strategies[i + 1]) for i, r in enumerate(scaled.itertuples()))
    return ReplaySchedule(spec, policy, dev0, strategies[0], events, duration, time_scale, dpn, df, scaled,
                          int(global_batch), seq_len, source)


def _strategies(scaled: pd.DataFrame, spec: models.ModelSpec, policy: str, max_procs: int, global_batch: int,
                seq_len: int, cost_model: Any) -> list[Strategy]:
    """The policy's strategy at the start and after every event (from ``search.plan_trace``)."""
    from .. import cluster, search
    dev0 = int(scaled.attrs["initial_devices"])
    # a hand-built step curve keeps every event, even at the very end (trace_segments drops empty segments)
    t = np.concatenate([[0.0], scaled["time"].to_numpy(np.float64)])
    n = np.concatenate([[dev0], scaled["devices"].to_numpy(np.int64)])
    end = max(float(scaled.attrs["duration"]), float(t[-1])) + 1.0
    curve = pd.DataFrame({"time": np.append(t, end), "devices": np.append(n, n[-1])})
    clus = cluster.get("cpu-local").with_devices(max(max_procs, 8))
    plan = search.plan_trace(curve, spec, clus, global_batch=global_batch, seq_len=seq_len, max_devices=max_procs,
                             cost_model=cost_model)
    frame = plan.policy_frame(_PLAN_POLICY[policy])
    starts = frame["start"].to_numpy(np.float64)
    out = []
    for ti, ni in zip(t, n):
        row = frame.iloc[int(np.searchsorted(starts, ti, side="right")) - 1]
        if row["strategy"] is None:
            raise StrategyError(f"no strategy of {spec.name} fits on {ni} device(s) (global batch {global_batch}); "
                                f"lower --global-batch or raise --devices-per-node")
        out.append(Strategy.parse(row["strategy"]))
    return out
