"""Step 1, explore: one strategy under several pipeline schedules, simulated side by side."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..explore import (ScheduleRun, compare_schedules, schedule_strategy, simulate_fitting,
                       stage_ranks)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from .core import DemoContext, StepResult

MODEL, CLUSTER, BASE = "llama2-70b", "a800-16x8", "dp=4,tp=8,pp=4,zero=1"
GLOBAL_BATCH, SEQ_LEN = 128, 4096

__all__ = ["ScheduleRun", "schedule_strategy", "simulate_fitting", "compare_schedules",
           "stage_ranks", "step_explore"]


def step_explore(ctx: "DemoContext", res: "StepResult") -> None:
    """Step 1: llama2-70b on a800-16x8, dp=4,tp=8,pp=4,zero=1 under four schedules."""
    from ..plots import plot_gantt, plot_memory
    table, runs = compare_schedules(MODEL, CLUSTER, BASE, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN,
                                    progress=ctx.say)
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
