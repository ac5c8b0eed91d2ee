"""``replay``: replay a preemption trace against a live, hot-switching job."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from .. import models
from ..errors import RuntimeFailure, StrategyError
from ..exec.reference import OptimConfig
from ..exec.switch import full_from_arrays
from .live import run_replay_job
from .restart import run_restart_job
from .result import ReplayResult, lost_per_switch, state_difference, step_rows
from .schedule import ReplaySchedule, replay_schedule

__all__ = ["replay", "BASELINES"]

BASELINES = ("checkpoint-restart",)


def _losses(reports: list[dict], steps: int) -> list[float]:
    out = []
    for k in range(steps):
        shares = [r["losses"][k] for r in reports if r and k in r["losses"]]
        if not shares:
            break
        out.append(float(sum(shares)))
    return out


def _full(spec: models.ModelSpec, strategy, finals: list[dict]) -> dict:
    return full_from_arrays(spec, strategy, {f["rank"]: f["arrays"] for f in finals})


def _static(spec: models.ModelSpec, sched: ReplaySchedule, steps: int, opts: dict) -> tuple[list[float], dict]:
    """The job that never switched: the starting strategy for the same steps (the same samples)."""
    from ..exec.switch import run_live
    res = run_live(spec, sched.initial_strategy, steps=steps, export=True, global_batch=sched.global_batch,
                   seq_len=sched.seq_len, seed=opts["seed"], data_seed=opts["data_seed"], optim=opts["optim"],
                   timeout=opts["timeout"])
    finals = [r["exports"]["final"] for r in res.reports.values() if r and "final" in r.get("exports", {})]
    return res.losses, _full(spec, sched.initial_strategy, finals)


def _job_layouts(sched: ReplaySchedule) -> tuple[list, list[float], list[int | None]]:
    """The job's layouts: one per event that changes (strategy, devices), their announce times, and per
    event the index of its layout (None for an event that leaves the job alone)."""
    layouts, announce, gen_of = [sched.layouts()[0]], [0.0], []
    for e, lay in zip(sched.events, sched.layouts()[1:]):
        if (str(lay[0]), lay[1]) != (str(layouts[-1][0]), layouts[-1][1]):
            layouts.append(lay)
            announce.append(e.announce)
            gen_of.append(len(layouts) - 1)
        else:
            gen_of.append(None)
    return layouts, announce, gen_of


def _event_rows(sched: ReplaySchedule, gen_of: list[int | None], gens: list, procs: list[dict],
                steps: pd.DataFrame, lost: list[float]) -> list[dict]:
    """One result row per trace event: when it took effect, its pause, lost time and switch phases."""
    t0 = next(r["t0"] for r in procs if r.get("gen_steps") is not None)
    records = [sw for r in procs for sw in r["switches"]]
    tokens_per_step = sched.global_batch * sched.seq_len
    events = []
    first_start = steps.groupby("step")["start"].max()
    for e, g in zip(sched.events, gen_of):
        row: dict[str, Any] = {"time": e.time, "trace_time": e.trace_time, "event": e.event, "count": e.count,
                               "devices": e.devices, "notice": e.notice, "strategy": str(e.strategy),
                               "world": e.world, "switched": False, "applied": False, "pause_seconds": 0.0,
                               "lost_seconds": 0.0, "baseline_lost_seconds": None}
        if g is not None and g < len(gens):
            s = gens[g].step
            recs = [x for x in records if x["step"] == s]
            keep = [x for x in recs if not x["joining"]] or recs
            wall = float(first_start[s] - t0)
            row.update(step=s, switched=True, applied=True, wall_time=wall, lag_seconds=wall - e.time,
                       pause_seconds=max(x["pause_seconds"] for x in keep), lost_seconds=lost[g - 1],
                       bytes_moved=int(sum(x["bytes_sent"] for x in recs)))
            for k in ("plan_seconds", "world_seconds", "transfer_seconds", "verify_seconds", "rebuild_seconds"):
                row[k] = max(x[k] for x in recs)
        elif g is None:
            # the job's layout did not change: the event takes effect at the first step starting after it
            later = first_start[first_start >= t0 + e.time]
            if len(later):
                row.update(step=int(later.index[0]), applied=True, wall_time=e.time)
        if "step" in row:
            row["tokens"] = int(row["step"]) * tokens_per_step
        events.append(row)
    return events


def replay(trace: "str | Path | pd.DataFrame", model: "str | models.ModelSpec" = "tiny-gpt", *,
           policy: str = "switch-aware", max_procs: int = 4, time_scale: float = 600.0, start: float | None = None,
           end: float | None = None, max_events: int | None = None, baseline: str | None = None,
           notice: float | None = None, devices_per_node: float | None = None, global_batch: int = 8,
           seq_len: int | None = None, cost_model: Any = None, max_steps: int = 400, seed: int = 0,
           data_seed: int = 0, optim: OptimConfig = OptimConfig(), timeout: float = 600.0,
           switch_timeout: float = 60.0, workdir: str | None = None,
           progress: Callable[[str], None] | None = None) -> ReplayResult:
    """Replay ``trace`` (a path, a shipped trace name or a normalized DataFrame) against a live job.

    The trace's window (``start``/``end``, trace seconds) is scaled onto ``max_procs`` processes and
    compressed ``time_scale`` times (:func:`~parashift.replay.schedule.replay_schedule`); the
    job trains from the first event's layout on, and at each event (after its notice, for a
    preemption) hot-switches to the ``policy``'s strategy for the new device count, until the
    window ends or ``max_steps``. A static job then trains the same samples in the starting
    strategy. ``baseline="checkpoint-restart"`` replays the same layouts and steps by DCP save,
    process restart and load. ``cost_model``: a calibrated :class:`~parashift.sim.CostModel` for
    the strategy search. Raises StrategyError/TraceFormatError on bad input and RuntimeFailure
    when the job fails.
    """
    say = progress or (lambda msg: None)
    if baseline is not None and baseline not in BASELINES:
        raise StrategyError(f"unknown baseline {baseline!r}; use one of {', '.join(BASELINES)} or none")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 2:
        raise StrategyError(f"max_steps={max_steps!r} must be an integer >= 2")
    spec = models.get(model)
    say("planning strategies per device count")
    sched = replay_schedule(trace, spec, policy=policy, max_procs=max_procs, time_scale=time_scale, start=start,
                            end=end, max_events=max_events, notice=notice, devices_per_node=devices_per_node,
                            global_batch=global_batch, seq_len=seq_len, cost_model=cost_model)
    layouts, announce, gen_of = _job_layouts(sched)
    opts = {"seed": seed, "data_seed": data_seed, "optim": optim, "timeout": timeout}
    say(f"replaying {len(sched.events)} events ({len(layouts) - 1} switches) over {sched.duration:.1f} s")
    gens, reports = run_replay_job(spec, layouts, announce, duration=sched.duration, max_steps=max_steps,
                                   global_batch=sched.global_batch, seq_len=sched.seq_len, seed=seed,
                                   data_seed=data_seed, optim=optim, timeout=timeout, switch_timeout=switch_timeout)
    procs = [r for r in reports.values() if r]
    errors = [r["error"] for r in procs if r.get("error")]
    if errors:
        raise RuntimeFailure(f"the replay stopped: {errors[0]}")
    steps_done = max(k for r in procs for k in r["losses"]) + 1
    losses = _losses(procs, steps_done)
    say(f"replayed {steps_done} steps; training the static job for comparison")
    static_losses, static_full = _static(spec, sched, steps_done, opts)
    last = gens[-1]
    finals = [r["final"] for r in procs if r.get("final") is not None]
    diff = state_difference(_full(spec, last.strategy, finals), static_full)

    steps = step_rows(procs)
    switch_steps = [g.step for g in gens[1:]]
    lost = lost_per_switch(steps, switch_steps)
    tokens_per_step = sched.global_batch * sched.seq_len
    events = _event_rows(sched, gen_of, gens, procs, steps, lost)
    t_first, t_last = float(steps["start"].min()), float(steps["end"].max())
    av = pd.DataFrame({"time": np.concatenate([[0.0], [e.time for e in sched.events], [sched.duration]]),
                       "devices": [sched.initial_devices] + [e.devices for e in sched.events]
                       + [sched.events[-1].devices if sched.events else sched.initial_devices]})
    result = ReplayResult(spec.name, policy, sched.source, sched.time_scale, sched.devices_per_node,
                          sched.initial_devices, str(sched.initial_strategy), sched.duration, tokens_per_step, events,
                          losses, static_losses, diff, float(np.nansum(lost)), t_last - t_first, av,
                          extra={"schedule": sched.to_frame(), "generations": [(g.step, str(g.strategy),
                                                                                list(g.devices)) for g in gens]})
    if baseline == "checkpoint-restart":
        say(f"replaying the same {len(gens) - 1} switches by checkpoint-restart (DCP)")
        _baseline(result, spec, sched, gens, steps_done, opts, workdir, switch_steps, static_full)
    return result


def _baseline(result: ReplayResult, spec: models.ModelSpec, sched: ReplaySchedule, gens: list, steps_done: int,
              opts: dict, workdir: str | None, switch_steps: list[int], static_full: dict) -> None:
    bounds = [g.step for g in gens] + [steps_done]
    segments = [(g.strategy, bounds[i], bounds[i + 1]) for i, g in enumerate(gens)]
    with tempfile.TemporaryDirectory(prefix="parashift-ckpt-", dir=workdir) as tmp:
        t = time.time()
        segs = run_restart_job(spec, segments, tmp, global_batch=sched.global_batch, seq_len=sched.seq_len,
                               seed=opts["seed"], data_seed=opts["data_seed"], optim=opts["optim"],
                               timeout=opts["timeout"])
        wall = time.time() - t
    ranks = [r for s in segs for r in s["ranks"]]
    steps = step_rows(ranks)
    lost = lost_per_switch(steps, switch_steps)
    by_step = dict(zip(switch_steps, lost))
    for e in result.events:
        if e["switched"]:
            e["baseline_lost_seconds"] = by_step[e["step"]]
    result.baseline = "checkpoint-restart"
    result.baseline_lost_seconds = float(np.nansum(lost))
    result.baseline_losses = _losses(ranks, steps_done)
    result.baseline_wall_seconds = float(steps["end"].max() - steps["start"].min())
    finals = [r["final"] for r in segs[-1]["ranks"] if r.get("final") is not None]
    result.extra["baseline_state_difference"] = state_difference(_full(spec, gens[-1].strategy, finals),
                                                                 static_full)
    result.extra["baseline_seconds_total"] = wall
    result.extra["baseline_segments"] = [{"strategy": s["strategy"], "launch": s["launch"],
                                          "save_seconds": max(r["save_end"] - r["save_start"] for r in s["ranks"]),
                                          "build_seconds": max(r["built"] - r["enter"] for r in s["ranks"]),
                                          "load_seconds": max(r["loaded"] - r["built"] for r in s["ranks"])}
                                         for s in segs]
