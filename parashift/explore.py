"""Exploration helpers a notebook (or a script) builds on: one strategy under several pipeline
schedules, the lightest recomputation that fits, a switch plan's bytes between devices and
nodes, and the transition engine's ablation. ``import parashift as ps; ps.explore...``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .schedules import get_schedule, schedule_names
from .strategy import RECOMPUTE, Strategy

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from .sim import SimResult
    from .vps import SwitchPlan

__all__ = ["schedule_vpp", "compared_schedules", "ScheduleRun", "schedule_strategy", "simulate_fitting", "compare_schedules",
           "stage_ranks", "bytes_matrix", "node_bytes", "lower_and_simulate", "ablation", "PASSES"]

def schedule_vpp(schedule: str) -> int:
    """Model chunks per pipeline rank ``schedule`` runs here: its registry record's fixed count, or 2
    where it takes any ``vpp >= 2`` (StrategyError naming the registered schedules if unknown)."""
    return get_schedule(schedule).vpp_choices((2,))[0]


def compared_schedules() -> tuple[str, ...]:
    """The schedules :func:`compare_schedules` runs by default: every registered one but ``gpipe``
    (1F1B's bubble, with every micro-batch's activations held at once)."""
    return tuple(n for n in schedule_names() if n != "gpipe")



@dataclass(frozen=True)
class ScheduleRun:
    """A schedule's simulated step: the strategy that ran (with the recompute it needed) and its result."""

    schedule: str
    strategy: Strategy
    result: "SimResult"
    tried: tuple[str, ...]          # recompute modes tried, lightest first


def schedule_strategy(base: "Strategy | str", schedule: str, recompute: str = "none") -> Strategy:
    """``base`` under ``schedule`` with the schedule's chunks per rank (vpp, :func:`schedule_vpp`)
    and ``recompute``."""
    return Strategy.parse(base).replace(schedule=schedule, vpp=schedule_vpp(schedule), recompute=recompute)


def simulate_fitting(model: str, cluster: str, strategy: Strategy, *, global_batch: int, seq_len: int,
                     recompute: "str | None" = None) -> tuple[Strategy, "SimResult", tuple[str, ...]]:
    """Simulate ``strategy``; with ``recompute=None`` try none, selective, full in turn and keep the
    lightest that fits in device memory (the last one tried if none fits)."""
    from . import models
    from .ir import compile as ir_compile
    from .sim import simulate
    spec = models.get(model)
    modes = (recompute,) if recompute is not None else RECOMPUTE
    tried: list[str] = []
    res = None
    for mode in modes:
        s = strategy.replace(recompute=mode)
        s.validate(spec)
        res = simulate(ir_compile(spec, s, global_batch=global_batch, seq_len=seq_len), cluster)
        tried.append(mode)
        if res.fits:
            break
    assert res is not None
    return s, res, tuple(tried)


def compare_schedules(model: str, cluster: str, base: "Strategy | str", *, global_batch: int, seq_len: int,
                      schedules: "Sequence[str] | None" = None,
                      recompute: "str | None" = None,
                      progress: "Callable[[str], None] | None" = None) -> tuple["pd.DataFrame", dict[str, ScheduleRun]]:
    """Simulate ``base`` under each schedule (default: :func:`compared_schedules`; recompute: the
    lightest that fits unless given).

    Returns a table (one row per schedule: strategy, recompute, step time s, tokens/s, MFU,
    bubble fraction, peak memory GiB and its states/activations split, fits) and the runs."""
    import pandas as pd
    schedules = compared_schedules() if schedules is None else schedules
    runs: dict[str, ScheduleRun] = {}
    rows = []
    for sched in schedules:
        if progress:
            progress(f"simulating {sched}")
        s, res, tried = simulate_fitting(model, cluster, schedule_strategy(base, sched), global_batch=global_batch,
                                         seq_len=seq_len, recompute=recompute)
        runs[sched] = ScheduleRun(sched, s, res, tried)
        mem = res.memory_summary()
        rows.append({"schedule": sched, "strategy": str(s), "recompute": s.recompute, "step_time_s": res.step_time,
                     "tokens_per_s": res.tokens_per_s, "mfu": res.mfu, "bubble_fraction": res.bubble_fraction,
                     "peak_memory_gib": res.peak_memory_max / 2**30, "states_gib": mem["states"] / 2**30,
                     "activations_gib": mem["activations"] / 2**30, "buffers_gib": mem["buffers"] / 2**30,
                     "fits": res.fits})
    return pd.DataFrame(rows), runs


def stage_ranks(strategy: Strategy) -> list[int]:
    """One rank per pipeline stage (tp=0, dp=0): the ranks whose timelines differ."""
    return [int(strategy.rank(0, 0, p)) for p in range(strategy.pp)]


#: the transition engine's lowering passes, in order
PASSES = ("select_sources", "promote", "stage", "coalesce", "xor_order")


def bytes_matrix(plan: "SwitchPlan") -> np.ndarray:
    """``m[src, dst]``: bytes the plan moves from device src to device dst (kept pieces excluded)."""
    n = int(max(plan.src.max(initial=0), plan.dst.max(initial=0))) + 1
    m = np.zeros((n, n), dtype=np.float64)
    mv = plan.moved
    np.add.at(m, (plan.src[mv], plan.dst[mv]), plan.nbytes[mv])
    return m


def node_bytes(plan: "SwitchPlan") -> np.ndarray:
    """Bytes between nodes: ``bytes_matrix`` summed over the cluster's nodes."""
    m = bytes_matrix(plan)
    node = np.asarray(plan.cluster.node_of(np.arange(len(m))), dtype=np.int64)
    k = int(node.max()) + 1
    out = np.zeros((k, k))
    np.add.at(out, (node[:, None].repeat(len(m), 1), node[None, :].repeat(len(m), 0)), m)
    return out


def lower_and_simulate(plan: "SwitchPlan", **options: object) -> dict:
    """Lower ``plan`` (transition passes per ``options``), validate and simulate it: the switch's
    seconds, stages, messages, collectives and peak memory per device."""
    from . import sim
    from .vps import transition
    prog = transition.lower(plan, plan.cluster, **options)
    prog.validate()
    res = sim.simulate_switch(prog, plan.cluster)
    meta = transition.SwitchMeta.of(prog)
    return {"switch_s": res.switch_time, "stages": meta.stages, "switch_messages": meta.messages,
            "collectives": int(sum(meta.collectives.values())), "instructions": prog.num_instructions(),
            "peak_memory_gib": res.peak_memory_max / 2**30, "bytes_inter_gib": res.link_bytes["inter"] / 2**30,
            "lower_s": meta.lower_seconds, "fits": res.fits}


def ablation(plan: "SwitchPlan", passes: Sequence[str] = PASSES) -> "pd.DataFrame":
    """The switch with every pass on, then with each of ``passes`` turned off alone (one row each);
    ``slowdown`` is the simulated switch time relative to all passes on."""
    import pandas as pd
    rows = [{"passes": "all on", **lower_and_simulate(plan)}]
    for p in passes:
        rows.append({"passes": f"{p} off", **lower_and_simulate(plan, **{p: False})})
    df = pd.DataFrame(rows)
    df["slowdown"] = df["switch_s"] / df["switch_s"].iloc[0]
    return df
