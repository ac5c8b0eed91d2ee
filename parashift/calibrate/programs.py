"""Fit cost-model parameters to whole-program times, with the simulator in the loop.

Some measurements come without an instruction timeline, e.g. the transfer time of a live hot
switch: one number for a whole switch Program. ``fit_programs`` simulates each Program under
candidate parameters and fits them (the same robust solver as :func:`~parashift.calibrate.fit`)
so the simulated times match. Use it for parameters the instruction-level fit cannot see, such as
the ``local`` link that switch Programs copy through and the fixed ``switch_overhead``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import pandas as pd

from ..cluster import Cluster, get as get_cluster
from ..cost import CostModel
from .params import Param, apply, get_value
from .samples import CalibrationError
from .solve import Block, informed, solve

if TYPE_CHECKING:  # pragma: no cover
    from ..ir.program import Program

__all__ = ["fit_programs", "simulated_times", "program_times"]


def program_times(programs: "Sequence[Program]", seconds: Sequence[float]) -> "tuple[list[Program], np.ndarray]":
    """The programs as a list and their measured seconds as an array, checked: one positive,
    finite time per Program."""
    progs = list(programs)
    meas = np.asarray(seconds, dtype=float)
    if not progs or len(progs) != len(meas):
        raise CalibrationError(f"{len(progs)} programs for {len(meas)} times; give one measured time per Program")
    if (meas <= 0).any() or not np.isfinite(meas).all():
        raise CalibrationError("measured program times must be positive seconds")
    return progs, meas


def simulated_times(programs: "Sequence[Program]", cluster: "Cluster | str", cost_model: CostModel) -> np.ndarray:
    """Simulated seconds of each Program (its whole execution: a step, or a switch with the
    model's ``switch_overhead``)."""
    from ..sim import simulate, simulate_switch
    cl = get_cluster(cluster)
    return np.array([simulate_switch(p, cl, cost_model).switch_time if p.meta.get("kind") == "switch"
                     else simulate(p, cl, cost_model).step_time for p in programs])


def fit_programs(programs: "Sequence[Program]", seconds: Sequence[float], cluster: "Cluster | str", *,
                 base: CostModel | None = None, params: Sequence["Param | str"] = ("latency.local", "link_bw.local"),
                 huber: float = 1.345) -> tuple[CostModel, pd.DataFrame]:
    """``base`` with ``params`` fitted so that simulating ``programs[i]`` takes ``seconds[i]``.

    Only the parameters that change some program's simulated time are fitted (the others keep
    their base values). Returns the model and a table of name, base, fitted.
    """
    cl = get_cluster(cluster)
    base = base if base is not None else CostModel.for_cluster(cl)
    progs, meas = program_times(programs, seconds)
    cands = [p if isinstance(p, Param) else Param.parse(p) for p in params]
    # a fixed cost at 0 cannot move in log space: start it at a tenth of the typical program time
    zero = [p for p in cands if get_value(base, p) == 0 and (p.field.endswith("overhead") or p.field == "latency")]
    start = apply(base, zero, [0.1 * float(np.median(meas))] * len(zero)) if zero else base
    block = Block("programs", lambda cm: simulated_times(progs, cl, cm), np.arange(len(progs)), meas)
    sol = solve(block, start, informed(block, start, cands), huber=huber)
    table = pd.DataFrame({"name": [p.name for p in sol.params], "base": [get_value(base, p) for p in sol.params],
                          "fitted": sol.values}, columns=["name", "base", "fitted"])
    return apply(base, sol.params, sol.values), table
