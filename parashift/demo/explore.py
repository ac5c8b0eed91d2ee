"""Step 1, explore: one strategy under several pipeline schedules, simulated side by side."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from ..errors import StrategyError
from ..strategy import RECOMPUTE, Strategy

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from ..sim import SimResult
    from .core import DemoContext, StepResult

__all__ = ["SCHEDULE_VPP", "ScheduleRun", "schedule_strategy", "simulate_fitting", "compare_schedules",
           "stage_ranks", "step_explore"]

#: Model chunks per pipeline rank each schedule runs.
SCHEDULE_VPP = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1, "dualpipev": 2}

MODEL, CLUSTER, BASE = "llama2-70b", "a800-16x8", "dp=4,tp=8,pp=4,zero=1"
GLOBAL_BATCH, SEQ_LEN = 128, 4096


@dataclass(frozen=True)
class ScheduleRun:
    """A schedule's simulated step: the strategy that ran (with the recompute it needed) and its result."""

    schedule: str
    strategy: Strategy
    result: "SimResult"
    tried: tuple[str, ...]          # recompute modes tried, lightest first


def schedule_strategy(base: "Strategy | str", schedule: str, recompute: str = "none") -> Strategy:
    """``base`` under ``schedule`` with the schedule's chunks per rank (vpp) and ``recompute``."""
    if schedule not in SCHEDULE_VPP:
        raise StrategyError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULE_VPP)}")
    return Strategy.parse(base).replace(schedule=schedule, vpp=SCHEDULE_VPP[schedule], recompute=recompute)


def simulate_fitting(model: str, cluster: str, strategy: Strategy, *, global_batch: int, seq_len: int,
                     recompute: "str | None" = None) -> tuple[Strategy, "SimResult", tuple[str, ...]]:
    """Simulate ``strategy``; with ``recompute=None`` try none, selective, full in turn and keep the
    lightest that fits in device memory (the last one tried if none fits)."""
    from .. import models
    from ..ir import compile as ir_compile
    from ..sim import simulate
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


def compare_schedules(model: str = MODEL, cluster: str = CLUSTER, base: "Strategy | str" = BASE, *,
                      schedules: Sequence[str] = ("1f1b", "interleaved-1f1b", "zb-h1", "dualpipev"),
                      global_batch: int = GLOBAL_BATCH, seq_len: int = SEQ_LEN, recompute: "str | None" = None,
                      progress: "Callable[[str], None] | None" = None) -> tuple["pd.DataFrame", dict[str, ScheduleRun]]:
    """Simulate ``base`` under each schedule (recompute: the lightest that fits unless given).

    Returns a table (one row per schedule: strategy, recompute, step time s, tokens/s, MFU,
    bubble fraction, peak memory GiB and its states/activations split, fits) and the runs."""
    import pandas as pd
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


def step_explore(ctx: "DemoContext", res: "StepResult") -> None:
    """Step 1: llama2-70b on a800-16x8, dp=4,tp=8,pp=4,zero=1 under four schedules."""
    from .plots import plot_gantt, plot_memory
    table, runs = compare_schedules(progress=ctx.say)
    table.to_csv(ctx.path("explore_schedules.csv"), index=False)
    ok = table[table["fits"]]
    best = ok.loc[ok["step_time_s"].idxmin(), "schedule"] if len(ok) else table.loc[table["step_time_s"].idxmin(),
                                                                                      "schedule"]
    run = runs[best]
    ranks = stage_ranks(run.strategy)
    ctx.say(f"timeline plot and Chrome trace of {best}")
    run.result.to_chrome_trace(ctx.path("explore_trace.json"), ranks=ranks)
    plot_gantt({f"{MODEL} on {CLUSTER}, {run.strategy} (simulated, one rank per stage)":
                run.result.timeline_of(ranks)}, ctx.path("explore_timeline.png"))
    mem = table.rename(columns={"states_gib": "states", "activations_gib": "activations", "buffers_gib": "buffers"})
    mem[["states", "activations", "buffers"]] *= 2**30
    mem["schedule"] = [f"{s}\n({r})" for s, r in zip(table["schedule"], table["recompute"])]
    cap = run.result.cost_model.memory_capacity - run.result.cost_model.memory_reserved
    plot_memory(mem, ctx.path("explore_memory.png"), capacity=cap,
                title=f"{MODEL}, {BASE}: peak memory per schedule")
    for row in table.itertuples(index=False):
        res.add(f"{row.schedule} step time", row.step_time_s, "s")
        res.add(f"{row.schedule} bubble", 100 * row.bubble_fraction, "%")
        res.add(f"{row.schedule} peak memory", row.peak_memory_gib, "GiB")
    res.add("fastest schedule that fits: " + best, float(table.loc[table["schedule"] == best, "tokens_per_s"].iloc[0]),
            "tokens/s")
    res.files.update({"timeline of the fastest schedule": "explore_timeline.png",
                      "peak memory per schedule": "explore_memory.png",
                      "Chrome trace (open in chrome://tracing or ui.perfetto.dev)": "explore_trace.json",
                      "table": "explore_schedules.csv"})
    shown = table[["schedule", "recompute", "step_time_s", "bubble_fraction", "peak_memory_gib", "mfu", "fits"]].copy()
    shown["bubble_fraction"] = (100 * shown["bubble_fraction"]).round(1)
    shown["mfu"] = (100 * shown["mfu"]).round(1)
    shown = shown.rename(columns={"step_time_s": "step time (s)", "bubble_fraction": "bubble (%)",
                                  "peak_memory_gib": "peak memory (GiB)", "mfu": "MFU (%)"})
    res.body = (f"{MODEL} on {CLUSTER} ({GLOBAL_BATCH} sequences of {SEQ_LEN} tokens per step), strategy "
                f"`{BASE}` with the lightest activation recompute that fits in memory. Fastest that fits: "
                f"**{best}**.\n\n" + _markdown(shown.round(3)))
    res.data.update(table=table, runs=runs, best=best)


def _markdown(df: "pd.DataFrame") -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(str(v) for v in row) + " |")
    return "\n".join(lines)
