"""The live side of a replay: a hot-switching job whose switches follow a wall clock.

:class:`ReplaySession` is a :class:`~parashift.exec.switch.LiveSession` whose schedule is
known in layouts (strategy, devices) but not in steps: device 0 (in every layout, the job's
clock) checks the replay clock before each step; once the next event's announcement time has
passed (its notice before a preemption, its time for an addition) it publishes "switch into
layout ``g`` at step ``s + 1``" on the job's store and starts preparing. Every other process of
the current layout reads the decision after step ``s`` (step ``s`` begins with a barrier that
device 0 enters only after publishing, so nobody misses it) and starts preparing too; a joining
device's idle process wakes on the announcement. At step ``s + 1`` all participants switch
between iterations. The end of the window is published the same way.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from .. import models
from ..errors import StrategyError, SwitchAborted
from ..exec.job.elastic import ElasticContext, incarnations, launch_elastic
from ..exec.reference import OptimConfig
from ..exec.switch import Generation, LiveOptions, LiveSession, store_arrays

__all__ = ["ReplaySession", "ReplayClock", "run_replay_job"]

CLOCK = 0   # the device that keeps the replay clock (never preempted: pools keep device 0)


@dataclass(frozen=True)
class ReplayClock:
    """When a replay switches: per layout, the replay second its switch is announced; the
    window's end (seconds); the most steps; whether each process reports its final state."""

    announce: tuple[float, ...]
    duration: float
    max_steps: int
    export_final: bool = True


class ReplaySession(LiveSession):
    """One process of a replayed job (module doc), switching as ``clock`` says."""

    def __init__(self, ctx: ElasticContext, spec: models.ModelSpec, gens: list[Generation], opts: LiveOptions,
                 clock: ReplayClock) -> None:
        super().__init__(ctx, spec, gens, opts)
        self.clock = clock
        self.known: dict[int, int] = {}      # layout -> the step its switch happens at

    def _learn(self, g: int, step: int) -> None:
        self.gens[g] = replace(self.gens[g], step=step)
        self.known[g] = step
        self.announce(g)

    def start(self) -> bool:
        first = self.ctx.member.first
        if first == 0:
            return super().start()
        # a joining device: wait for its announcement (or the end), learn its step, then switch in
        key = f"replay/sw{first}/step"
        end = time.monotonic() + self.ctx.timeout
        while not self.ctx.store.check([key]):
            if self.ctx.store.check(["job/end"]) or time.monotonic() > end:
                return False
            time.sleep(0.01)
        self.gens[first] = replace(self.gens[first], step=int(self.ctx.store.get(key)))
        return super().start()

    def replay(self) -> dict:
        """Train until the window's end (or ``max_steps``), switching as the clock says; the report."""
        store = self.ctx.store
        announce, duration, max_steps = self.clock.announce, float(self.clock.duration), int(self.clock.max_steps)
        clock = self.device == CLOCK
        t0 = None
        losses: dict[int, float] = {}
        stop_at: int | None = None
        error = None
        while self.runtime is not None:
            s = self.runtime.steps_done
            nxt = self.gen + 1
            if clock and t0 is None and s >= 1:    # the clock starts once the first (warm-up) step is done
                t0 = time.time()
                store.set("replay/t0", repr(t0))
            if clock and t0 is not None and stop_at is None and nxt not in self.known:
                now = time.time() - t0
                if nxt < len(self.gens) and now >= announce[nxt] and s + 1 < max_steps:
                    store.set(f"replay/sw{nxt}/step", str(s + 1))
                    self._learn(nxt, s + 1)
                elif (nxt >= len(self.gens) and now >= duration) or s + 1 >= max_steps:
                    stop_at = s + 1
                    store.set("replay/stop", str(stop_at))
            if stop_at is not None and s >= stop_at:
                break
            if self.known.get(nxt) == s:
                try:
                    self.switch(nxt)
                except SwitchAborted as e:
                    error = str(e)
                    break
                continue
            ts = time.time()
            loss, _ = self.runtime.step()
            self.rows.append(("train", "step", ts, time.time(), s))
            losses[s] = float(loss)
            if self.ctx.report is not None:
                self.ctx.report((s, float(loss), self.gens[self.gen].devices))
            if not clock:
                key = f"replay/sw{nxt}/step"
                if nxt < len(self.gens) and nxt not in self.known and store.check([key]):
                    self._learn(nxt, int(store.get(key)))
                if stop_at is None and store.check(["replay/stop"]):
                    stop_at = int(store.get("replay/stop"))
        if clock or error is not None:
            if clock and t0 is None:
                store.set("replay/t0", repr(time.time()))
            store.set("job/end", "1")
        t0 = float(store.get("replay/t0"))
        out = {"device": self.device, "key": self.ctx.member.key, "losses": losses, "error": error,
               "switches": [asdict(r) for r in self.records], "rows": self.rows,
               "final_gen": self.gen if self.runtime is not None else None, "t0": t0,
               "gen_steps": [0] + [self.known.get(g) for g in range(1, len(self.gens))] if clock else None}
        if self.runtime is not None and self.clock.export_final:
            if error is None:
                self.runtime.sync_params()
            out["final"] = {"rank": self.runtime.ctx.rank, "arrays": store_arrays(self.runtime.store)}
        return out


def _replay_worker(ctx: ElasticContext, spec: models.ModelSpec, gens: list[Generation], opts: LiveOptions,
                   clock: ReplayClock) -> dict:
    import torch
    torch.manual_seed(0)
    session = ReplaySession(ctx, spec, gens, opts, clock)
    if not session.start():
        return {"device": ctx.device, "key": ctx.member.key, "losses": {}, "error": None, "rows": [],
                "switches": [asdict(r) for r in session.records], "final_gen": None, "joined": False}
    return session.replay()


def run_replay_job(spec: models.ModelSpec, layouts: list[tuple[Any, tuple[int, ...]]], announce: list[float], *,
                   duration: float, max_steps: int, global_batch: int, seq_len: int, seed: int = 0,
                   data_seed: int = 0, optim: OptimConfig = OptimConfig(), timeout: float = 300.0,
                   switch_timeout: float = 60.0, export_final: bool = True,
                   on_report=None) -> tuple[list[Generation], dict[str, Any]]:
    """Start one process per device incarnation of ``layouts`` and replay; returns the layouts
    with their actual switch steps (generations) and every process's report."""
    if any(CLOCK not in d for _, d in layouts):
        raise StrategyError("device 0 keeps the replay clock and must be in every layout; number each pool's "
                            "devices from 0")
    # placeholder steps (the clock decides the real ones); generations are per layout
    gens = [Generation(i, s, tuple(d)) for i, (s, d) in enumerate(layouts)]
    opts = LiveOptions(global_batch=global_batch, seq_len=seq_len, seed=seed, data_seed=data_seed, optim=optim,
                       notice=1, switch_timeout=switch_timeout)
    clock = ReplayClock(tuple(announce), duration, max_steps, export_final)
    reports = launch_elastic(_replay_worker, incarnations([g.devices for g in gens]), args=(spec, gens, opts, clock),
                             timeout=timeout, on_report=on_report)
    clock = next(r for r in reports.values() if r and r.get("gen_steps") is not None)
    steps = clock["gen_steps"]
    done = [replace(g, step=steps[i]) for i, g in enumerate(gens) if steps[i] is not None]
    return done, reports
