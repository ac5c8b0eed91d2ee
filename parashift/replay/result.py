"""What a replay measured: per event the switch, per step the loss, and the baseline's figures."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["ReplayResult", "EVENT_COLUMNS", "lost_per_switch", "state_difference"]

#: columns of :meth:`ReplayResult.to_frame`
EVENT_COLUMNS = ("time", "trace_time", "event", "count", "devices", "notice", "strategy", "world", "step",
                 "applied", "switched", "wall_time", "lag_seconds", "pause_seconds", "lost_seconds",
                 "plan_seconds", "world_seconds", "transfer_seconds", "verify_seconds", "rebuild_seconds",
                 "bytes_moved", "tokens", "baseline_lost_seconds", "late")
"""``time``/``trace_time``: the event (replay/trace seconds); ``devices``: the pool after it; ``step``: the
first step in the new layout; ``wall_time``: replay second that step started, i.e. when the switch had
finished (``lag_seconds`` after the event; None when the job stopped before it); ``late``: a preemption
whose switch finished after its notice ran out (the job held a device the trace had taken back);
``pause_seconds``: the
switch's stall between iterations; ``lost_seconds``: end of the step before to start of the step after;
``tokens``: tokens trained before the event took effect."""


def step_rows(reports: "list[dict]") -> pd.DataFrame:
    """Every process's training steps: step, start, end (absolute wall seconds)."""
    rows = [(step, a, b) for r in reports if r for stream, op, a, b, step in r.get("rows", []) if op == "step"]
    return pd.DataFrame(rows, columns=["step", "start", "end"])


def lost_per_switch(steps: pd.DataFrame, switch_steps: list[int]) -> list[float]:
    """Seconds between the end of step ``s - 1`` and the start of step ``s`` (the slowest process's),
    for each switch step ``s``: the training time a reconfiguration costs."""
    ends = steps.groupby("step")["end"].max()
    starts = steps.groupby("step")["start"].max()
    return [float(starts[s] - ends[s - 1]) if s in starts.index and s - 1 in ends.index else float("nan")
            for s in switch_steps]


def state_difference(a: dict, b: dict) -> dict[str, float]:
    """Per state kind, the largest ``|a - b| / max|b|`` over every tensor of two full states
    ((tensor, kind) -> array, as :func:`~parashift.exec.switch.full_from_arrays` returns)."""
    out: dict[str, float] = {}
    for key, ref in b.items():
        got = a[key]
        scale = float(np.max(np.abs(ref))) or 1.0
        out[key[1]] = max(out.get(key[1], 0.0), float(np.max(np.abs(got - ref))) / scale)
    return out


@dataclass
class ReplayResult:
    """A replay: ``events`` (one dict per scaled trace event, keys of :data:`EVENT_COLUMNS`),
    ``losses`` and ``static_losses`` per step (the same samples), the final state's relative
    difference to the static job per kind, the lost seconds, and the optional baseline's."""

    model: str
    policy: str
    source: str
    time_scale: float
    devices_per_node: float
    initial_devices: int
    initial_strategy: str
    duration: float
    tokens_per_step: int
    events: list[dict]
    losses: list[float]
    static_losses: list[float]
    state_difference: dict[str, float]
    lost_seconds: float
    wall_seconds: float
    availability: pd.DataFrame = field(repr=False)
    baseline: str | None = None
    baseline_lost_seconds: float | None = None
    baseline_losses: list[float] | None = None
    baseline_wall_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for e in self.events:
            wall = e.get("wall_time")
            has = wall is not None and not (isinstance(wall, float) and np.isnan(wall))
            e["lag_seconds"] = float(wall) - float(e["time"]) if has else None
            e["late"] = bool(e["event"] == "preempt" and has and e["lag_seconds"] > 0)

    @property
    def late_events(self) -> list[dict]:
        """Preemptions handled after their notice expired (each a failure of the replay)."""
        return [e for e in self.events if e["late"]]

    @property
    def ok(self) -> bool:
        """True when every preemption was handled within its notice."""
        return not self.late_events

    @property
    def lost_ratio(self) -> float | None:
        """Baseline seconds lost to reconfiguration per hot-switch second lost (> 1: hot switching wins)."""
        if self.baseline_lost_seconds is None or self.lost_seconds <= 0:
            return None
        return self.baseline_lost_seconds / self.lost_seconds

    @property
    def max_loss_rel_diff(self) -> float:
        """Largest ``|loss - static| / |static|`` over the steps."""
        a, b = np.asarray(self.losses), np.asarray(self.static_losses)
        return float(np.max(np.abs(a - b) / np.abs(b))) if len(b) else 0.0

    def to_frame(self) -> pd.DataFrame:
        """One row per event (:data:`EVENT_COLUMNS`)."""
        return pd.DataFrame(self.events, columns=list(EVENT_COLUMNS))

    def losses_frame(self) -> pd.DataFrame:
        """step, loss, static_loss (and baseline_loss with a baseline)."""
        df = pd.DataFrame({"step": np.arange(len(self.losses)), "loss": self.losses,
                           "static_loss": self.static_losses})
        if self.baseline_losses is not None:
            df["baseline_loss"] = self.baseline_losses
        return df

    def to_json(self) -> dict:
        out = {"model": self.model, "policy": self.policy, "trace": self.source, "time_scale": self.time_scale,
               "devices_per_node": self.devices_per_node, "initial_devices": self.initial_devices,
               "initial_strategy": self.initial_strategy, "duration": self.duration,
               "steps": len(self.losses), "tokens_per_step": self.tokens_per_step,
               "events": [{k: _plain(v) for k, v in e.items()} for e in self.events],
               "losses": self.losses, "static_losses": self.static_losses,
               "max_loss_rel_diff": self.max_loss_rel_diff, "state_difference": self.state_difference,
               "lost_seconds": self.lost_seconds, "wall_seconds": self.wall_seconds, "ok": self.ok,
               "late_preemptions": len(self.late_events),
               "failures": [f"{e['event']} at {e['time']:.2f} s (notice {e['notice']:.2f} s): the switch finished "
                            f"{e['lag_seconds']:.3f} s after the device was taken back" for e in self.late_events]}
        if self.baseline is not None:
            out.update(baseline=self.baseline, baseline_lost_seconds=self.baseline_lost_seconds,
                       lost_ratio=self.lost_ratio, baseline_losses=self.baseline_losses,
                       baseline_wall_seconds=self.baseline_wall_seconds)
        return out

    def plot(self, path: str) -> str:
        """Availability and the job's devices over replay time with the switches marked, and the
        loss curve next to the static job's; written to ``path`` (PNG)."""
        from ..plots import pyplot
        plt = pyplot()
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5))
        av = self.availability
        ax1.step(av["time"], av["devices"], where="post", label="devices available", color="tab:gray")
        ev = self.to_frame()
        t = np.concatenate([[0.0], ev["wall_time"].where(ev["switched"], np.nan).to_numpy(np.float64)])
        w = np.concatenate([[_world(self.initial_strategy)], ev["world"].to_numpy(np.float64)])
        ok = np.isfinite(t)
        stop = max(self.duration, float(np.nanmax(t)) * 1.02)
        ax1.step(np.append(t[ok], stop), np.append(w[ok], w[ok][-1]), where="post",
                 label="devices the job runs on", color="tab:blue")
        for r in ev[ev["switched"]].itertuples():
            ax1.axvline(r.wall_time, color="tab:red", lw=0.8, ls=":")
            ax1.annotate(f"{r.strategy}\npause {r.pause_seconds * 1e3:.0f} ms", (r.wall_time, r.world),
                         fontsize=7, xytext=(3, -22), textcoords="offset points")
        ax1.set_xlabel("replay time (s)")
        ax1.set_ylabel("devices")
        ax1.set_ylim(0, max(float(av["devices"].max()), float(w.max())) + 1.2)
        ax1.set_title(f"{self.model} replaying {self.source} ({self.policy}, x{self.time_scale:g})")
        ax1.legend(loc="lower left", fontsize=8)
        lf = self.losses_frame()
        ax2.plot(lf["step"], lf["static_loss"], label="static job (never switched)", lw=3, alpha=0.4,
                 color="tab:gray")
        ax2.plot(lf["step"], lf["loss"], label="replayed job (hot switches)", color="tab:blue")
        if "baseline_loss" in lf:
            ax2.plot(lf["step"], lf["baseline_loss"], label=f"{self.baseline}", ls="--", color="tab:orange")
        for r in ev[ev["switched"]].itertuples():
            ax2.axvline(r.step, color="tab:red", lw=0.8, ls=":")
        ax2.set_xlabel("step")
        ax2.set_ylabel("loss")
        ax2.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def _world(strategy: str) -> int:
    from ..strategy import Strategy
    return Strategy.parse(strategy).world


def _plain(v: Any) -> Any:
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        f = float(v)
        return None if np.isnan(f) else f
    if isinstance(v, float) and np.isnan(v):
        return None
    return v
