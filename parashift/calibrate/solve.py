"""Robust, non-negative least squares of cost-model parameters against measured instruction costs.

Residuals are log ratios ``log(predicted / measured)`` (so a 10% error weighs the same on a
20-microsecond all-reduce and a 20-millisecond backward); parameters are fitted in log space
(so they stay positive); the loss is Huber's on residuals scaled by their median absolute
deviation, minimized by iteratively reweighted Levenberg-Marquardt steps with a finite-difference
Jacobian. The cost model takes the max of a FLOP, a memory and a dispatch-floor term, so a term
that does not bind has no gradient: a coordinate search over a log grid (single parameters, then
pairs acting on the same instructions) runs before each local fit to cross those kinks. A weak
ridge toward the base values settles directions no sample informs. :func:`match_means` then
optionally rescales groups so predicted and measured totals agree.

Predictions always come from the :class:`CostModel` methods the simulator calls, evaluated once
per distinct instruction shape, so a fitted model means in the simulator what it meant here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..cost import CostModel
from .params import Param, apply, get_value

__all__ = ["Block", "Solution", "solve", "informed", "match_means"]

_H = 1e-5              # finite-difference step in log space
_SE_STEP = 0.02        # step of the one-sided slopes behind the standard errors
_TINY = 1e-15          # floor of a predicted time (seconds) before taking logs
_INFORMED = 1e-4       # a parameter moving no prediction by this share of its own change is uninformed
_SCALE_FLOOR = 2e-3    # smallest residual scale: below it, the data is as good as exact
_FLOOR = 1e-9          # a parameter at 0 (e.g. a latency) starts here: log space needs it positive
_GRID = np.log([1 / 64, 1 / 16, 1 / 4, 1 / 2, 1 / 1.3, 1 / 1.1, 1.1, 1.3, 2, 4, 16, 64])  # coordinate-search factors
_PAIR = np.log([1 / 2, 1 / 1.3, 1.3, 2])  # joint factors of two parameters
_GRID_SCALE = 0.1      # residual scale of the coarse search (Huber: quadratic within ~10%)


@dataclass(frozen=True)
class Block:
    """One least-squares problem: ``evaluate(cm)`` gives the predicted seconds of each distinct
    instruction shape, ``inv[i]`` the shape of sample i, ``measured[i]`` its seconds and
    ``weights[i]`` its weight in the loss."""

    name: str
    evaluate: Callable[[CostModel], np.ndarray]
    inv: np.ndarray
    measured: np.ndarray
    weights: "np.ndarray | None" = None

    @property
    def sample_weights(self) -> np.ndarray:
        """Weights of the samples, scaled to a mean of 1 (all 1 when none were given)."""
        if self.weights is None:
            return np.ones(len(self.inv))
        w = np.asarray(self.weights, dtype=float)
        return w * (len(w) / w.sum())


@dataclass(frozen=True)
class Solution:
    """Fitted values of ``params`` with their relative standard errors, the residual scale and
    the final Huber weight of every sample (below 1: treated as an outlier)."""

    params: tuple[Param, ...]
    values: np.ndarray
    rel_se: np.ndarray
    scale: float
    weights: np.ndarray
    iterations: int


def _log_pred(block: Block, base: CostModel, params: Sequence[Param], x: np.ndarray) -> np.ndarray:
    cm = apply(base, params, np.exp(x)) if len(params) else base
    return np.log(np.maximum(np.asarray(block.evaluate(cm), dtype=float), _TINY))


def _jacobian(block: Block, base: CostModel, params: Sequence[Param], x: np.ndarray, f0: np.ndarray,
              h: float = _H) -> np.ndarray:
    J = np.empty((len(f0), len(params)))
    for j in range(len(params)):
        xj = x.copy()
        xj[j] += h
        J[:, j] = (_log_pred(block, base, params, xj) - f0) / h
    return J


def _start(base: CostModel, params: Sequence[Param]) -> np.ndarray:
    return np.log([max(get_value(base, p), _FLOOR) for p in params])


def informed(block: Block, base: CostModel, candidates: Sequence[Param]) -> list[Param]:
    """The candidates whose change (by up to 64x either way, from the base values) moves some
    prediction of ``block``: terms that are not the binding one at base count too."""
    if not len(candidates) or not len(block.inv):
        return []
    x0 = _start(base, candidates)
    f0 = _log_pred(block, base, candidates, x0)
    out = []
    for j, p in enumerate(candidates):
        for d in (_GRID[0], _GRID[-1], _H):
            x = x0.copy()
            x[j] += d
            if np.abs(_log_pred(block, base, candidates, x) - f0).max() >= _INFORMED * min(abs(d), 1.0):
                out.append(p)
                break
    return out


def _reach(block: Block, base: CostModel, params: Sequence[Param], x: np.ndarray) -> np.ndarray:
    """``reach[j, u]``: moving parameter j by up to 64x either way changes the prediction of shape u."""
    f0 = _log_pred(block, base, params, x)
    reach = np.zeros((len(params), len(f0)), dtype=bool)
    for j in range(len(params)):
        for d in (_GRID[0], _GRID[-1]):
            xt = x.copy()
            xt[j] += d
            reach[j] |= np.abs(_log_pred(block, base, params, xt) - f0) > 1e-9
    return reach


def _coarse(block: Block, base: CostModel, params: Sequence[Param], x: np.ndarray, lm: np.ndarray,
            huber: float, scale: float, reach: np.ndarray, sweeps: int = 3) -> np.ndarray:
    """Coordinate search over a log grid of factors, then joint moves of parameter pairs that act
    on the same instructions: moves parameters past the kinks of the cost model's max(), where
    gradients are zero (e.g. a floor that should bind, or a pair trading which term binds)."""
    sw = block.sample_weights

    def loss(x_: np.ndarray) -> float:
        r = _log_pred(block, base, params, x_)[block.inv] - lm
        return float(np.sum(sw * _huber(r / scale, huber)[0]))

    best = loss(x)

    def singles() -> bool:
        nonlocal x, best
        any_ = False
        for _ in range(sweeps):
            improved = False
            for j in range(len(params)):
                for d in _GRID:
                    xt = x.copy()
                    xt[j] += d
                    lt = loss(xt)
                    if lt < best * (1 - 1e-9):
                        x, best, improved = xt, lt, True
            any_ |= improved
            if not improved:
                break
        return any_

    singles()
    shared = (reach.astype(np.int64) @ reach.T.astype(np.int64)) > 0
    moved = False
    for i in range(len(params)):
        for j in range(i + 1, len(params)):
            if not shared[i, j]:
                continue
            for di in _PAIR:
                for dj in _PAIR:
                    xt = x.copy()
                    xt[i] += di
                    xt[j] += dj
                    lt = loss(xt)
                    if lt < best * (1 - 1e-9):
                        x, best, moved = xt, lt, True
    if moved:
        singles()
    return x


def _huber(z: np.ndarray, c: float) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss (times 2) and IRLS weight of scaled residuals ``z``."""
    a = np.abs(z)
    loss = np.where(a <= c, z * z, 2 * c * a - c * c)
    w = np.where(a <= c, 1.0, c / np.maximum(a, 1e-300))
    return loss, w


def solve(block: Block, base: CostModel, params: Sequence[Param], *, huber: float = 1.345,
          prior: float = 1e-6, max_iter: int = 60, rounds: int = 3) -> Solution:
    """Fit ``params`` of ``base`` to ``block`` (see the module docstring); others stay at base.

    Each round is a coarse coordinate search then a local robust fit; rounds repeat while the
    robust loss still falls (a term that starts binding can open a new descent).
    """
    params = tuple(params)
    lm = np.log(block.measured)
    n, k = len(lm), len(params)
    inv = block.inv
    sw = block.sample_weights
    x0 = _start(base, params)
    x = x0.copy()
    f = _log_pred(block, base, params, x)
    r = f[inv] - lm
    scale, it = _GRID_SCALE, 0

    def objective(r_: np.ndarray, x_: np.ndarray, s: float) -> float:
        return float(np.sum(sw * _huber(r_ / s, huber)[0]) * s * s + prior * n * np.sum((x_ - x0) ** 2))

    def local(x: np.ndarray, f: np.ndarray, r: np.ndarray, it: int):
        scale = _SCALE_FLOOR
        for _outer in range(8):
            scale = max(1.4826 * float(np.median(np.abs(r - np.median(r)))), _SCALE_FLOOR)
            mu, moved = 1e-3, 0.0
            for _ in range(max_iter):
                it += 1
                w = sw * _huber(r / scale, huber)[1]
                J = _jacobian(block, base, params, x, f)
                wk = np.bincount(inv, weights=w, minlength=len(f))
                wr = np.bincount(inv, weights=w * r, minlength=len(f))
                A = J.T @ (wk[:, None] * J) + prior * n * np.eye(k)
                g = J.T @ wr + prior * n * (x - x0)
                obj = objective(r, x, scale)
                step = np.zeros(k)
                for _try in range(12):
                    step = np.clip(np.linalg.solve(A + mu * np.diag(np.diag(A) + 1e-12), -g), -3.0, 3.0)
                    xn = x + step
                    fn = _log_pred(block, base, params, xn)
                    rn = fn[inv] - lm
                    if objective(rn, xn, scale) <= obj:
                        x, f, r = xn, fn, rn
                        mu = max(mu / 3, 1e-9)
                        break
                    mu *= 4
                else:
                    break
                moved = max(moved, float(np.abs(step).max()))
                if np.abs(step).max() < 1e-7:
                    break
            if moved < 1e-6:
                break
        return x, f, r, scale, it

    if k:
        best = np.inf
        reach = _reach(block, base, params, x0)
        for _round in range(rounds):
            x = _coarse(block, base, params, x, lm, huber, max(scale, _SCALE_FLOOR), reach)
            f = _log_pred(block, base, params, x)
            r = f[inv] - lm
            x, f, r, scale, it = local(x, f, r, it)
            loss = objective(r, x, _GRID_SCALE)
            if loss >= best * (1 - 1e-6):
                break
            best = loss
    scale = max(1.4826 * float(np.median(np.abs(r - np.median(r)))), _SCALE_FLOOR)
    w = sw * _huber(r / scale, huber)[1]
    rel_se = np.full(k, np.nan)
    if k:
        # one-sided slopes over a 2% step: a parameter at a kink of max(), informing the data
        # only one way, gets the smaller one (zero when it stops binding): a large error, not a tiny one
        up = _jacobian(block, base, params, x, f, h=_SE_STEP)
        down = _jacobian(block, base, params, x, f, h=-_SE_STEP)
        J = np.where(np.sign(up) == np.sign(down), np.sign(up) * np.minimum(np.abs(up), np.abs(down)), 0.0)
        wk = np.bincount(inv, weights=w, minlength=len(f))
        A = J.T @ (wk[:, None] * J) + 1e-10 * n * np.eye(k)   # the data alone: the prior settles nothing here
        sigma2 = max(float(np.sum(w * r * r)) / max(n - k, 1), _SCALE_FLOOR ** 2)
        rel_se = np.sqrt(np.clip(np.diag(np.linalg.inv(A)) * sigma2, 0, None))
    return Solution(params, np.exp(x), rel_se, scale, w, it)


_RATES = ("efficiency", "region_efficiency", "memory_efficiency", "link_bw", "comm_op_bw")  # larger: faster
_PHASE_FIELDS = ("efficiency", "phase_floor", "phase_overhead")


def match_means(block: Block, base: CostModel, sol: Solution, groups: "np.ndarray | None" = None, *,
                trim: float = 0.01) -> tuple[Solution, dict]:
    """Rescale each group's time so predicted and measured *totals* agree.

    A robust fit finds the typical cost; a step is the sum of many costs, whose jitter (the
    slow tail a shared machine adds) is real time. Per group (a compute phase, or all samples
    when ``groups`` is None) the parameters that scale its time alone (``efficiency[phase]``,
    ``phase_floor[phase]``, ``<phase>_overhead``; every parameter for communication) move by one
    common factor, found by bisection, so that the sums match over the samples but the ``trim``
    share with the highest measured/predicted ratios (glitches: one 1% of the samples).
    Returns the new solution and the factor applied to each group's times.
    """
    params, x = sol.params, np.log(sol.values)
    lm = block.measured
    labels = np.zeros(len(lm), dtype=object) if groups is None else np.asarray(groups, dtype=object)
    factors: dict = {}
    for g in sorted(set(labels), key=str):
        if groups is None:
            idx = list(range(len(params)))
        else:
            idx = [j for j, p in enumerate(params) if (p.key == g and p.field in _PHASE_FIELDS)
                   or (p.key is None and p.field == f"{g}_overhead")]
        if not idx:
            continue
        sign = np.array([-1.0 if params[j].field in _RATES else 1.0 for j in idx])
        rows = labels == g
        pred = np.exp(_log_pred(block, base, params, x))[block.inv]
        ratio = lm[rows] / pred[rows]
        keep = np.ones(len(ratio), dtype=bool)
        keep[np.argsort(ratio)[len(ratio) - int(trim * len(ratio)):]] = False
        target = float(lm[rows][keep].sum())

        def total(log_s: float) -> float:
            xt = x.copy()
            xt[idx] += sign * log_s
            return float(np.exp(_log_pred(block, base, params, xt))[block.inv][rows][keep].sum())

        lo, hi = -3.0, 3.0
        if not total(lo) <= target <= total(hi):
            continue
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if total(mid) < target else (lo, mid)
        log_s = 0.5 * (lo + hi)
        x[idx] += sign * log_s
        factors[g if groups is not None else "all"] = float(np.exp(log_s))
    return Solution(params, np.exp(x), sol.rel_se, sol.scale, sol.weights, sol.iterations), factors
