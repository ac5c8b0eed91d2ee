"""Step 5, replay: a time-compressed slice of a shipped preemption trace against the live job."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .core import require
from .deploy import LIVE

if TYPE_CHECKING:  # pragma: no cover
    from .core import DemoContext, StepResult

__all__ = ["REPLAY", "replay_slice", "step_replay"]

#: The slice: trace minutes 20-45 of Bamboo's AWS p3 spot trace (an addition, a preemption, an
#: addition), 4 processes at the busiest moment, 900 trace seconds per replay second.
REPLAY = {"trace": "bamboo/p3-trace.csv", "start": 1200.0, "end": 2700.0, "time_scale": 900.0, "max_events": 3,
          "max_procs": 4, "policy": "switch-aware", "max_steps": 400}


def replay_slice(progress: "Callable[[str], None] | None" = None, **overrides: Any) -> Any:
    """Replay :data:`REPLAY` (fields overridable) against a live :data:`LIVE` job; returns the
    ``parashift.replay`` result (events with their pauses, live and static loss curves)."""
    rp = require("parashift.replay", "replay")
    cfg = {**REPLAY, **overrides}
    return rp.replay(cfg["trace"], LIVE["model"], policy=cfg["policy"], max_procs=cfg["max_procs"],
                     time_scale=cfg["time_scale"], start=cfg["start"], end=cfg["end"], max_events=cfg["max_events"],
                     global_batch=LIVE["global_batch"], seq_len=LIVE["seq_len"], max_steps=cfg["max_steps"],
                     timeout=600.0, progress=progress)


def step_replay(ctx: "DemoContext", res: "StepResult") -> None:
    """Step 5: replay the slice live; availability, switches and the loss next to a static job."""
    ctx.say(f"replaying {REPLAY['trace']} (trace seconds {REPLAY['start']:.0f}-{REPLAY['end']:.0f}, "
            f"x{REPLAY['time_scale']:.0f}) on up to {REPLAY['max_procs']} processes")
    r = replay_slice(progress=ctx.say)
    events = r.to_frame()
    events.to_csv(ctx.path("replay_events.csv"), index=False)
    r.plot(ctx.path("replay.png"))
    switched = events[events["switched"]] if "switched" in events else events.iloc[0:0]
    losses, static = list(r.losses), list(r.static_losses)
    n = min(len(losses), len(static))
    if n == 0:
        raise RuntimeError("the replay trained no steps")
    dev = max(abs(a - b) / abs(b) for a, b in zip(losses[:n], static[:n]))
    res.add("trace events replayed", len(events), "events")
    res.add("hot switches", len(switched), "switches")
    if len(switched):
        res.add("largest switch pause", float(switched["pause_seconds"].max()), "s")
        res.add("median switch pause", float(switched["pause_seconds"].median()), "s")
        res.add("largest lag of a switch behind its event", float(switched["lag_seconds"].max()), "s")
    late = r.late_events
    res.add("preemptions handled after their notice ran out", len(late), "events")
    res.add("training time lost to reconfiguration", float(r.lost_seconds), "s")
    res.add("steps trained", len(losses), "steps")
    res.add("largest relative loss difference to the static job", dev, "")
    if getattr(r, "state_difference", None):
        res.add("largest relative state difference to the static job", max(r.state_difference.values()), "")
    res.files.update({"availability, switches and loss vs static": "replay.png", "events": "replay_events.csv"})
    res.body = (f"Trace minutes {REPLAY['start'] / 60:.0f}-{REPLAY['end'] / 60:.0f} of `{REPLAY['trace']}` (AWS p3 "
                f"spot nodes, Bamboo), scaled onto at most {REPLAY['max_procs']} processes and played {REPLAY['time_scale']:.0f}x "
                f"faster; at each event the job hot-switches to the {REPLAY['policy']} policy's strategy for the "
                f"new device count. `wall_time` is when the switch had finished (the first step in the new "
                f"layout started), `lag_seconds` how long after the event.\n\n" + _events_md(events)
                + ("\n\n" + "\n".join(f"**FAILED**: {f}" for f in r.to_json()["failures"]) if late else
                   "\n\nEvery preemption was handled within its notice."))
    res.data.update(replay=r, events=events)


def _events_md(events: Any) -> str:
    cols = [c for c in ("time", "wall_time", "lag_seconds", "late", "trace_time", "event", "devices", "step",
                        "strategy", "pause_seconds") if c in events.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in events[cols].itertuples(index=False):
        lines.append("| " + " | ".join(_num(v) for v in row) + " |")
    return "\n".join(lines)


def _num(v: Any) -> str:
    if not isinstance(v, float):
        return str(v)
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
