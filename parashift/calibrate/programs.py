"""Fit cost-model parameters to whole-program times, with the simulator in the loop.

Some measurements come without an instruction timeline, e.g. the transfer time of a live hot
switch: one number for a whole switch Program. ``fit_programs`` simulates each Program under
candidate parameters and fits them (the same robust solver as :func:`~parashift.calibrate.fit`)
so the simulated times match. Use it for parameters the instruction-level fit cannot see, such as
the ``local`` link that switch Programs copy through.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import pandas as pd

from ..cluster import Cluster, get as get_cluster
from ..sim.cost import CostModel
from .params import Param, apply, get_value
from .samples import CalibrationError
from .solve import Block, informed, solve

if TYPE_CHECKING:  # pragma: no cover
    from ..ir.program import Program

__all__ = ["fit_programs", "simulated_times"]


def simulated_times(programs: "Sequence[Program]", cluster: "Cluster | str", cost_model: CostModel) -> np.ndarray:
    """Simulated seconds of each Program (its whole execution: a step, or a switch)."""
    from ..sim import simulate
    cl = get_cluster(cluster)
    return np.array([simulate(p, cl, cost_model).step_time for p in programs])


def fit_programs(programs: "Sequence[Program]", seconds: Sequence[float], cluster: "Cluster | str", *,
                 base: CostModel | None = None, params: Sequence["Param | str"] = ("latency.local", "link_bw.local"),
                 huber: float = 1.345) -> tuple[CostModel, pd.DataFrame]:
    """``base`` with ``params`` fitted so that simulating ``programs[i]`` takes ``seconds[i]``.

    Only the parameters that change some program's simulated time are fitted (the others keep
    their base values). Returns the model and a table of name, base, fitted.
    """
    cl = get_cluster(cluster)
    base = base if base is not None else CostModel.for_cluster(cl)
    progs = list(programs)
    meas = np.asarray(seconds, dtype=float)
    if not progs or len(progs) != len(meas):
        raise CalibrationError(f"{len(progs)} programs for {len(meas)} times; give one measured time per Program")
    if (meas <= 0).any() or not np.isfinite(meas).all():
        raise CalibrationError("measured program times must be positive seconds")
    cands = [p if isinstance(p, Param) else Param.parse(p) for p in params]
    block = Block("programs", lambda cm: simulated_times(progs, cl, cm), np.arange(len(progs)), meas)
    sol = solve(block, base, informed(block, base, cands), huber=huber)
    table = pd.DataFrame({"name": [p.name for p in sol.params], "base": [get_value(base, p) for p in sol.params],
                          "fitted": sol.values}, columns=["name", "base", "fitted"])
    return apply(base, sol.params, sol.values), table
