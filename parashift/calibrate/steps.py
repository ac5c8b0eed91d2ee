"""Fit a few time scales of a cost model to measured step times, with the simulator in the loop.

Instruction samples tell the *shape* of the costs (which op kinds and sizes cost what) but not
everything a step pays: a measured instruction misses the time its process spent descheduled
between instructions, the run's waits interleave differently from the simulated ones, and
processes that share a host's cores slow each other only while they compute at the same time.
:func:`fit_steps` therefore moves a handful of physical scales, each acting on a whole group of
parameters, so that simulating each Program gives its measured step time:

- ``compute``: every compute cost (efficiencies, memory efficiency, dispatch floors and
  overheads, optimizer overhead) by one factor;
- ``comm_alpha``: every fixed communication cost (per-operation overheads and link latencies);
- ``comm_beta``: every per-byte communication cost (achieved link bandwidths);
- ``host_cores``: how many cores the ranks of one node share (only when the model has it set).

The loss is Huber's on log ratios ``log(simulated / measured)``, with a weak ridge that keeps
each scale near 1 (the instruction-level fit) unless the step times ask otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pandas as pd

from ..cluster import Cluster, get as get_cluster
from ..cost import CostModel
from .programs import program_times
from .samples import CalibrationError
from .solve import _huber

if TYPE_CHECKING:  # pragma: no cover
    from ..ir.program import Program

__all__ = ["SCALES", "StepFit", "fit_steps", "scaled"]

SCALES = ("compute", "comm_alpha", "comm_beta", "host_cores")
_H = 0.03            # central-difference step in log space (simulated times are piecewise smooth)
_GRID = np.log([0.5, 0.7, 0.85, 1.2, 1.4, 2.0])
_RIDGE = 0.1         # a scale moved by a factor e costs as much as one program 10% off
_SCALE_FLOOR = 0.02  # residual scale of the Huber loss: below it, step times count as exact


def scaled(cm: CostModel, factors: "dict[str, float]") -> CostModel:
    """``cm`` with each group of :data:`SCALES` moved by its factor (``host_cores``: multiplied)."""
    ch: dict[str, object] = {}
    s = float(factors.get("compute", 1.0))
    if s != 1.0:
        ch["efficiency"] = {k: v / s for k, v in cm.efficiency.items()}
        ch["region_floor"] = {k: v * s for k, v in cm.region_floor.items()}
        ch["region_overhead"] = {k: v * s for k, v in cm.region_overhead.items()}
        ch["memory_efficiency"] = cm.memory_efficiency / s
        ch["optim_overhead"] = cm.optim_overhead * s
    a = float(factors.get("comm_alpha", 1.0))
    if a != 1.0:
        ch["comm_overhead"] = cm.comm_overhead * a
        ch["p2p_overhead"] = cm.p2p_overhead * a
        ch["comm_op_overhead"] = {k: v * a for k, v in cm.comm_op_overhead.items()}
        ch["latency"] = {k: v * a for k, v in cm.latency.items()}
    b = float(factors.get("comm_beta", 1.0))
    if b != 1.0:
        ch["link_efficiency"] = {k: v / b for k, v in cm.link_efficiency.items()}
    h = float(factors.get("host_cores", 1.0))
    if h != 1.0 and cm.host_cores > 0:
        ch["host_cores"] = cm.host_cores * h
    return cm.replace(**ch) if ch else cm


@dataclass(frozen=True)
class StepFit:
    """The model after :func:`fit_steps`, the factor of each scale, and per program its measured
    and simulated step time before (``start``) and after (``predicted``) the fit."""

    cost_model: CostModel
    factors: dict
    table: pd.DataFrame


def _simulate(programs: "Sequence[Program]", cluster: Cluster, cm: CostModel) -> np.ndarray:
    from ..sim import simulate
    return np.array([simulate(p, cluster, cm).step_time for p in programs])


def fit_steps(programs: "Sequence[Program]", seconds: Sequence[float], cluster: "Cluster | str",
              base: CostModel, *, scales: Sequence[str] = SCALES, huber: float = 1.345,
              ridge: float = _RIDGE, max_iter: int = 30) -> StepFit:
    """``base`` with the ``scales`` (see the module docstring) fitted so that simulating
    ``programs[i]`` takes ``seconds[i]`` (its measured step time, e.g. a median over steps).

    A scale that no program's time depends on (``host_cores`` without a shared host, or when
    ``base.host_cores`` is 0) stays at 1. Starts with a coordinate search over a grid of factors
    (simulated times are kinked: a term stops binding, a wait disappears), then Gauss-Newton
    steps with Huber weights.
    """
    cl = get_cluster(cluster)
    progs, meas = program_times(programs, seconds)
    bad = [s for s in scales if s not in SCALES]
    if bad:
        raise CalibrationError(f"unknown step scales {bad}; use some of {list(SCALES)}")
    names = [s for s in scales if s != "host_cores" or base.host_cores > 0]
    lm = np.log(meas)
    k = len(names)

    def model(x: np.ndarray) -> CostModel:
        return scaled(base, {n: float(np.exp(v)) for n, v in zip(names, x)})

    def resid(x: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(_simulate(progs, cl, model(x)), 1e-15)) - lm

    def loss(r: np.ndarray, x: np.ndarray) -> float:
        s = max(1.4826 * float(np.median(np.abs(r))), _SCALE_FLOOR)
        return float(np.sum(_huber(r / s, huber)[0]) * s * s + ridge * np.sum(x * x))

    x = np.zeros(k)
    r0 = r = resid(x)
    best = loss(r, x)
    for _sweep in range(2):            # coordinate search across the kinks
        moved = False
        for j in range(k):
            for d in _GRID:
                xt = x.copy()
                xt[j] += d
                rt = resid(xt)
                lt = loss(rt, xt)
                if lt < best * (1 - 1e-6):
                    x, r, best, moved = xt, rt, lt, True
        if not moved:
            break
    mu = 1e-2
    for _ in range(max_iter):          # damped Gauss-Newton with Huber weights
        s = max(1.4826 * float(np.median(np.abs(r))), _SCALE_FLOOR)
        w = _huber(r / s, huber)[1]
        J = np.empty((len(r), k))
        for j in range(k):
            xp, xm = x.copy(), x.copy()
            xp[j] += _H
            xm[j] -= _H
            J[:, j] = (resid(xp) - resid(xm)) / (2 * _H)
        A = J.T @ (w[:, None] * J) + ridge * np.eye(k)
        g = J.T @ (w * r) + ridge * x
        improved = False
        for _try in range(6):
            step = np.clip(np.linalg.solve(A + mu * np.diag(np.diag(A) + 1e-9), -g), -1.0, 1.0)
            xt = x + step
            rt = resid(xt)
            lt = loss(rt, xt)
            if lt < best:
                x, r, best, improved = xt, rt, lt, True
                mu = max(mu / 3, 1e-6)
                break
            mu *= 4
        if not improved or np.abs(step).max() < 1e-4:
            break
    factors = {n: float(np.exp(v)) for n, v in zip(names, x)}
    table = pd.DataFrame({"program": [str(p.strategy or p.meta.get("strategy", i)) for i, p in enumerate(progs)],
                          "measured": meas, "start": np.exp(r0 + lm), "predicted": np.exp(r + lm)})
    return StepFit(model(x), factors, table)

