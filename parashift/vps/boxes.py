"""Vectorized box algebra over many boxes at once.

A box is a half-open index range per dimension, stored as two int64 arrays ``lo[n, d]`` and
``hi[n, d]`` (one row per box). Tensors with fewer than ``d`` dimensions are padded with
trailing unit dimensions (``lo = 0``, ``hi = 1``), which leaves volumes and row-major order
unchanged. Every function here works on whole arrays; none loops over boxes in Python.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = [
    "volume", "intersect", "nonempty", "contains", "concat_ranges", "group_pairs", "self_pairs",
    "intersect_pairs", "covered_volume", "flat_to_boxes", "Coverage", "exactly_once",
]


def volume(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Number of elements of each box (0 for empty boxes)."""
    return np.prod(np.maximum(hi - lo, 0), axis=-1, dtype=np.int64)


def intersect(lo_a: np.ndarray, hi_a: np.ndarray, lo_b: np.ndarray,
              hi_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Elementwise (broadcasting) intersection; empty results have some ``hi <= lo``."""
    return np.maximum(lo_a, lo_b), np.minimum(hi_a, hi_b)


def nonempty(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Boolean mask of boxes with at least one element."""
    return np.all(hi > lo, axis=-1)


def contains(outer_lo: np.ndarray, outer_hi: np.ndarray, inner_lo: np.ndarray,
             inner_hi: np.ndarray) -> np.ndarray:
    """Elementwise: does the outer box contain the inner box (empty inner boxes count as contained)."""
    inside = np.all((outer_lo <= inner_lo) & (inner_hi <= outer_hi), axis=-1)
    return inside | ~nonempty(inner_lo, inner_hi)


def concat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` without a Python loop."""
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    keep = counts > 0
    starts, counts = starts[keep], counts[keep]
    ends = np.cumsum(counts)
    out = np.ones(total, dtype=np.int64)
    out[0] = starts[0]
    # at the first element of each run, jump from the previous run's last value to this start
    out[ends[:-1]] = starts[1:] - (starts[:-1] + counts[:-1] - 1)
    return np.cumsum(out)


def group_pairs(group_a: np.ndarray, group_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All index pairs ``(i, j)`` with ``group_a[i] == group_b[j]`` (an equi-join on int keys)."""
    group_a = np.asarray(group_a, dtype=np.int64)
    group_b = np.asarray(group_b, dtype=np.int64)
    order_b = np.argsort(group_b, kind="stable")
    sorted_b = group_b[order_b]
    left = np.searchsorted(sorted_b, group_a, side="left")
    right = np.searchsorted(sorted_b, group_a, side="right")
    counts = right - left
    ia = np.repeat(np.arange(len(group_a), dtype=np.int64), counts)
    jb = order_b[concat_ranges(left, counts)]
    return ia, jb


def self_pairs(group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All index pairs ``(i, j)``, ``i < j``, within equal group ids."""
    ia, jb = group_pairs(group, group)
    keep = ia < jb
    return ia[keep], jb[keep]


def intersect_pairs(lo_a: np.ndarray, hi_a: np.ndarray, lo_b: np.ndarray, hi_b: np.ndarray,
                    group_a: np.ndarray | None = None, group_b: np.ndarray | None = None,
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Non-empty intersections of every box of A with every box of B (within equal groups).

    Returns ``(ia, jb, lo, hi)``: index into A, index into B and the intersection box.
    Without groups this is the all-pairs product, so keep A and B small or pass groups.
    """
    if group_a is None or group_b is None:
        ia = np.repeat(np.arange(len(lo_a), dtype=np.int64), len(lo_b))
        jb = np.tile(np.arange(len(lo_b), dtype=np.int64), len(lo_a))
    else:
        ia, jb = group_pairs(group_a, group_b)
    lo, hi = intersect(lo_a[ia], hi_a[ia], lo_b[jb], hi_b[jb])
    keep = nonempty(lo, hi)
    return ia[keep], jb[keep], lo[keep], hi[keep]


def covered_volume(lo: np.ndarray, hi: np.ndarray, group: np.ndarray, cover_lo: np.ndarray,
                   cover_hi: np.ndarray, cover_group: np.ndarray) -> np.ndarray:
    """Per box: elements it shares with the cover boxes of its group (the cover boxes of one
    group must be pairwise disjoint for this to be the volume inside their union)."""
    ia, jb = group_pairs(group, cover_group)
    ilo, ihi = intersect(lo[ia], hi[ia], cover_lo[jb], cover_hi[jb])
    return np.bincount(ia, weights=volume(ilo, ihi), minlength=len(lo)).astype(np.int64)


def flat_to_boxes(shape: np.ndarray, start: np.ndarray, stop: np.ndarray,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Boxes covering the row-major flat ranges ``[start, stop)`` of arrays of ``shape``.

    ``shape``: ``[n, d]`` (trailing unit dimensions allowed); ``start``/``stop``: ``[n]``.
    Returns ``(index, flat_start, lo, hi)``: for each box, the range it came from, the flat
    offset of its first element, and the box (in the array's local coordinates). Boxes are
    ordered by range, then by flat offset, and each range yields at most ``2*ndim - 1`` boxes:
    a partial row at every level going up from ``start``, full blocks in the middle, and
    partial blocks at every level going down to ``stop``.
    """
    shape = np.asarray(shape, dtype=np.int64).reshape(len(start), -1)
    start = np.asarray(start, dtype=np.int64)
    stop = np.asarray(stop, dtype=np.int64)
    n, d = shape.shape
    # block[:, l] = elements of one index step along dimension l
    block = np.ones((n, d + 1), dtype=np.int64)
    block[:, :d] = np.cumprod(shape[:, ::-1], axis=1)[:, ::-1]
    block = block[:, 1:]                      # block[:, l] = prod(shape[:, l+1:])
    total = block[:, 0] * shape[:, 0]
    cur = start.copy()
    out: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []

    def emit(level: int, new: np.ndarray) -> None:
        nonlocal cur
        m = new > cur
        if m.any():
            out.append((level, np.flatnonzero(m), cur[m], new[m]))
            cur = np.where(m, new, cur)

    def up(x: np.ndarray, b: np.ndarray) -> np.ndarray:
        return -(-x // b) * b

    for level in range(d - 1, 0, -1):          # climb: finish the partial block at each level
        emit(level, np.minimum(up(cur, block[:, level - 1]), stop // block[:, level] * block[:, level]))
    emit(0, np.minimum(stop // block[:, 0] * block[:, 0], total))   # whole blocks of dimension 0
    for level in range(1, d):                   # descend: the partial blocks before ``stop``
        emit(level, stop // block[:, level] * block[:, level])

    if not out:
        z = np.zeros((0, d), dtype=np.int64)
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), z, z.copy()
    idx = np.concatenate([o[1] for o in out])
    s = np.concatenate([o[2] for o in out])
    e = np.concatenate([o[3] for o in out])
    lev = np.concatenate([np.full(len(o[1]), o[0], dtype=np.int64) for o in out])
    order = np.lexsort((s, idx))
    idx, s, e, lev = idx[order], s[order], e[order], lev[order]
    sh, bl = shape[idx], block[idx]
    lo = (s[:, None] // bl) % sh
    hi = lo + 1
    dims = np.arange(d)[None, :]
    at = dims == lev[:, None]
    after = dims > lev[:, None]
    hi = np.where(at, lo + ((e - s)[:, None] // bl), hi)
    lo = np.where(after, 0, lo)
    hi = np.where(after, sh, hi)
    return idx, s, lo, hi


class Coverage(NamedTuple):
    """Result of :func:`exactly_once`: ``ok`` and, when not, the first offending group."""

    ok: bool
    reason: str = ""
    group: int = -1
    piece: int = -1


def exactly_once(region_lo: np.ndarray, region_hi: np.ndarray, region_group: np.ndarray,
                 piece_lo: np.ndarray, piece_hi: np.ndarray, piece_group: np.ndarray) -> Coverage:
    """Check that, in every group, the pieces cover the regions' elements exactly once.

    Regions of one group must be pairwise disjoint; pieces must be non-empty, pairwise
    disjoint, lie inside the union of their group's regions, and add up to its volume.
    """
    region_group = np.asarray(region_group, dtype=np.int64)
    piece_group = np.asarray(piece_group, dtype=np.int64)
    pv = volume(piece_lo, piece_hi)
    bad = np.flatnonzero(pv <= 0)
    if len(bad):
        return Coverage(False, "empty piece", int(piece_group[bad[0]]), int(bad[0]))
    for lo, hi, grp, what in ((region_lo, region_hi, region_group, "regions"),
                              (piece_lo, piece_hi, piece_group, "pieces")):
        ia, jb = self_pairs(grp)
        ilo, ihi = intersect(lo[ia], hi[ia], lo[jb], hi[jb])
        over = np.flatnonzero(nonempty(ilo, ihi))
        if len(over):
            k = over[0]
            return Coverage(False, f"overlapping {what}", int(grp[ia[k]]),
                            int(ia[k]) if what == "pieces" else -1)
    inside = covered_volume(piece_lo, piece_hi, piece_group, region_lo, region_hi, region_group)
    bad = np.flatnonzero(inside != pv)
    if len(bad):
        return Coverage(False, "piece outside its regions", int(piece_group[bad[0]]), int(bad[0]))
    groups, inv = np.unique(np.concatenate([region_group, piece_group]), return_inverse=True)
    need = np.bincount(inv[:len(region_group)], weights=volume(region_lo, region_hi), minlength=len(groups))
    got = np.bincount(inv[len(region_group):], weights=pv, minlength=len(groups))
    bad = np.flatnonzero(need != got)
    if len(bad):
        return Coverage(False, f"covers {int(got[bad[0]])} of {int(need[bad[0]])} elements", int(groups[bad[0]]))
    return Coverage(True)
