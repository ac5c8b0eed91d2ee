"""Closing the loop: run a search's leading strategies live and set measured against predicted.

``measure(result, strategies)`` executes each strategy's Program on local processes (the
runtime, gloo on CPU) and returns one row per strategy with the simulator's predicted step
time next to the measured one; ``ranking_held`` says whether the measured order is the
predicted one. ``runner_up`` picks the strategy to compare the winner with: the best one of
another layout whose prediction differs from the winner's by at least ``min_gap`` (a strategy
that ties the winner cannot confirm or refute the ranking).
"""
from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Callable, Sequence

from ..errors import PlanError
from ..strategy import Strategy
from .result import Candidate, SearchResult

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["runner_up", "measure", "ranking_held", "MEASURE_COLUMNS"]

MEASURE_COLUMNS = ("strategy", "predicted_rank", "predicted_step_seconds", "measured_step_seconds",
                   "measured_over_predicted", "measured_rank")


def runner_up(result: SearchResult, min_gap: float = 0.02, k: int = 50) -> Candidate | None:
    """The best of ``result.top(k)`` predicted at least ``min_gap`` (relative) slower than the winner
    with another layout (dp, tp, pp, ep, schedule or chunks differ)."""
    top = result.top(k)
    if not top:
        return None
    best = top[0]
    return next((c for c in top[1:] if c.step_time >= best.step_time * (1 + min_gap)
                 and _layout(c.strategy) != _layout(best.strategy)), None)


def _layout(s: Strategy) -> tuple:
    return (s.dp, s.tp, s.pp, s.ep, s.schedule, s.vpp)


def measure(result: SearchResult, strategies: "Sequence[Strategy | str | Candidate] | None" = None, *,
            steps: int = 4, timeout: float = 300.0, measured: "dict[str, float] | None" = None,
            progress: Callable[[str], None] | None = None) -> "pd.DataFrame":
    """Run each strategy (default: the winner and :func:`runner_up`) live for ``steps`` steps and
    return :data:`MEASURE_COLUMNS`: measured is the median step time after the first (warm-up)
    step; ranks are 1 for the fastest. ``measured``: step seconds of strategies already run
    (by strategy string), which are not run again."""
    import pandas as pd

    from ..exec import run_program
    if steps < 2:
        raise PlanError(f"steps={steps}: measuring needs at least 2 steps (the first is a warm-up)")
    if strategies is None:
        if result.best is None:
            raise PlanError("the search found no feasible strategy to measure; run more trials")
        second = runner_up(result)
        strategies = [result.best] + ([second] if second is not None else [])
    cands = [s if isinstance(s, Candidate) else result._candidate(s) for s in strategies]
    rows = []
    for i, c in enumerate(cands):
        seconds = (measured or {}).get(str(c.strategy))
        if seconds is None:
            program = result.program(c.strategy)
            if progress is not None:
                progress(f"running {c.strategy} live on {program.world} processes ({i + 1}/{len(cands)})")
            run = run_program(program, steps=steps, timeout=timeout)
            seconds = statistics.median(run.step_times[1:])
        rows.append({"strategy": str(c.strategy), "predicted_step_seconds": c.step_time,
                     "measured_step_seconds": seconds,
                     "measured_over_predicted": seconds / c.step_time if c.step_time > 0 else math.nan})
    df = pd.DataFrame(rows)
    df["predicted_rank"] = df["predicted_step_seconds"].rank(method="min").astype(int)
    df["measured_rank"] = df["measured_step_seconds"].rank(method="min").astype(int)
    return df[list(MEASURE_COLUMNS)]


def ranking_held(table: "pd.DataFrame") -> bool:
    """True when the strategies measured in the order the simulator predicted."""
    return bool((table["predicted_rank"] == table["measured_rank"]).all())
