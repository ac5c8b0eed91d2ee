"""Placement: which destination rank each device takes, chosen to keep the most state in place.

A switch's destination device list fixes which devices run the new layout; its *order* (rank i
on ``dst_devices[i]``) decides how much of each device's new state it already holds. The bytes a
device keeps when it takes rank ``r`` depend only on ``r`` and the device, so the best order is
a maximum-weight assignment of ranks to devices: ``keep[r, j]`` is the bytes of rank ``r``'s
destination state that device ``dst_devices[j]`` holds in the source layout.

Ranks only move between devices of the same node, so every group of the new layout spans the
same nodes as in the given order (TP stays inside NVLink domains). Among the best orders the one
closest to the given order wins (ties keep the given rank), so the result is deterministic and
an order that is already best is returned unchanged.
"""
from __future__ import annotations

import numpy as np

from .boxes import concat_ranges

__all__ = ["keep_matrix", "best_order", "assign_max"]


def keep_matrix(plan) -> np.ndarray:
    """``keep[r, j]``: bytes of destination rank ``r``'s state that ``plan.dst_devices[j]`` holds
    in the source layout (any order of ``plan.dst_devices`` keeps ``sum(keep[r, order[r]])``)."""
    ddev = np.asarray(plan.dst_devices, dtype=np.int64)
    n = len(ddev)
    col = np.full(int(max(ddev.max(), max(plan.src_devices))) + 1, -1, dtype=np.int64)
    col[ddev] = np.arange(n)
    rank = col[plan.dst]                                    # every piece goes to a destination device
    h = plan.holders
    cnt = plan.hs_ptr[h + 1] - plan.hs_ptr[h]
    holder = col[plan.hs_dev[concat_ranges(plan.hs_ptr[h], cnt)]]
    row = np.repeat(rank, cnt)
    nb = np.repeat(plan.nbytes, cnt)
    ok = holder >= 0                                        # holders outside the destination set keep nothing
    flat = np.bincount(row[ok] * n + holder[ok], weights=nb[ok].astype(np.float64), minlength=n * n)
    return np.rint(flat).astype(np.int64).reshape(n, n)


def assign_max(w: np.ndarray) -> np.ndarray:
    """``perm`` maximizing ``sum(w[r, perm[r]])`` over permutations (square integer ``w``;
    Hungarian method with potentials, O(n^3), vectorized over columns)."""
    w = np.asarray(w, dtype=np.int64)
    n = w.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    cost = w.max() - w                                      # minimize, non-negative
    inf = np.iinfo(np.int64).max // 4
    u = np.zeros(n + 1, dtype=np.int64)
    v = np.zeros(n + 1, dtype=np.int64)
    match = np.zeros(n + 1, dtype=np.int64)                 # column j (1-based) -> row (1-based), 0: free
    way = np.zeros(n + 1, dtype=np.int64)
    for i in range(1, n + 1):
        match[0] = i
        j0 = 0
        minv = np.full(n + 1, inf, dtype=np.int64)
        used = np.zeros(n + 1, dtype=bool)
        while True:
            used[j0] = True
            i0 = match[j0]
            free = ~used
            free[0] = False
            cur = cost[i0 - 1] - u[i0] - v[1:]
            better = free[1:] & (cur < minv[1:])
            minv[1:][better] = cur[better]
            way[1:][better] = j0
            cand = np.where(free[1:], minv[1:], inf)
            j1 = int(np.argmin(cand)) + 1
            delta = cand[j1 - 1]
            u[match[used]] += delta
            v[used] -= delta
            minv[free] -= delta
            j0 = j1
            if match[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            match[j0] = match[j1]
            j0 = j1
    perm = np.empty(n, dtype=np.int64)
    perm[match[1:] - 1] = np.arange(n)
    return perm


def best_order(plan) -> tuple[int, ...]:
    """The order of ``plan.dst_devices`` that keeps the most bytes in place, each rank staying on
    a device of its given device's node; the given order when it is already best."""
    ddev = np.asarray(plan.dst_devices, dtype=np.int64)
    keep = keep_matrix(plan)
    node = np.asarray(plan.cluster.node_of(ddev), dtype=np.int64)
    out = ddev.copy()
    for k in np.unique(node).tolist():
        idx = np.flatnonzero(node == k)                     # ranks given to node k, and its devices
        m = len(idx)
        w = keep[np.ix_(idx, idx)] * (m + 1) + np.eye(m, dtype=np.int64)   # ties keep the given rank
        out[idx] = ddev[idx[assign_max(w)]]
    return tuple(int(d) for d in out)
