"""Stamping: a training DAG of m micro-batches built from the same DAG of two.

Directives that treat every micro-batch's nodes alike (``stampable = True``: Split, Place, Shard,
Recompute, Replicate, Stream) give, for m micro-batches, m copies of one micro-batch's nodes and
edges, each with its own micro-batch number in ``mb``, tags, buffer names and actions, between nodes
that belong to no micro-batch (``mb == -1``: optimizer steps, gradient syncs). :func:`apply_stamped`
applies them for two micro-batches, reads that layout off the small graph (:func:`layout`) and
stamps it to m (:func:`stamp`), so a full-scale step costs a few micro-batches of directive work plus
list copies. The layout is checked, never assumed: the directives applied for three micro-batches
must equal the two-micro-batch graph stamped to three, node by node and edge by edge (values and
types), else a shorter leading part of them is stamped, or none.
"""
from __future__ import annotations

import dataclasses
from itertools import repeat
from typing import Any, Sequence

import numpy as np

from .actions import Action
from .graph import Graph

__all__ = ["apply_stamped", "layout", "stamp"]

#: Fewest micro-batches worth stamping: below it the checking runs cost more than they save.
STAMP_FROM = 32


class _Unstampable(Exception):
    """The two-micro-batch graph is not m copies of one micro-batch (a value, node or edge that the
    layout cannot extend)."""


def _runs(labels: np.ndarray) -> list[tuple[int, int, int]]:
    """``(label, start, length)`` of each run of equal labels."""
    if not len(labels):
        return []
    cut = np.flatnonzero(labels[1:] != labels[:-1]) + 1
    starts = np.concatenate([[0], cut]).tolist()
    ends = np.concatenate([cut, [len(labels)]]).tolist()
    return [(int(labels[s]), s, e - s) for s, e in zip(starts, ends)]


def _segments(labels: np.ndarray) -> list[tuple[int, int, bool]]:
    """The rows of a two-micro-batch graph (labels: 0, 1, or -1 for none) as segments ``(start,
    length, per_mb)``: a run of micro-batch 0 followed by an equally long run of micro-batch 1 (one
    block per micro-batch), or a run of rows of no micro-batch (kept once)."""
    runs, out, k = _runs(labels), [], 0
    while k < len(runs):
        lab, s, n = runs[k]
        if lab == -1:
            out.append((s, n, False))
            k += 1
        elif lab == 0 and k + 1 < len(runs) and runs[k + 1][0] == 1 and runs[k + 1][2] == n:
            out.append((s, n, True))
            k += 2
        else:
            raise _Unstampable(f"rows {s}..{s + n} of micro-batch {lab} have no twin")
    return out


def layout(g2: Graph) -> tuple[list, list]:
    """Node and edge segments of a graph of two micro-batches (see :func:`_segments`); an edge belongs
    to the micro-batch of its endpoints (an edge between two micro-batches cannot be stamped)."""
    mb = np.asarray(g2.cols["mb"], np.int64)
    if len(mb) and (mb.min() < -1 or mb.max() > 1):
        raise _Unstampable("micro-batch numbers outside 0..1")
    src, dst = np.asarray(g2.src, np.int64), np.asarray(g2.dst, np.int64)
    lu, lv = mb[src], mb[dst]
    if np.any((lu >= 0) & (lv >= 0) & (lu != lv)):
        raise _Unstampable("an edge joins two micro-batches")
    return _segments(mb), _segments(np.maximum(lu, lv))


class _Series:
    """Per-micro-batch values of node attributes for ``m`` micro-batches (each distinct action's built once)."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.names = list(map(str, range(m)))
        self.actions: dict = {}

    def __call__(self, v0: Any, v1: Any) -> list:
        """``[v(0), ..., v(m - 1)]`` for an attribute that is ``v0`` at micro-batch 0 and ``v1`` at
        micro-batch 1: an int steps linearly, a text names the micro-batch (``"...m0"`` -> ``"...m<k>"``),
        an Action moves to micro-batch k, a tuple varies element by element."""
        t, m = type(v0), self.m
        if t is not type(v1):
            raise _Unstampable(f"{v0!r} and {v1!r} differ in type")
        if v0 == v1:
            return [v0] * m
        if t is int:
            return list(range(v0, v0 + m * (v1 - v0), v1 - v0))
        if t is str:
            if v0[-1:] == "0" and v1 == v0[:-1] + "1":      # the usual case: the number ends the name
                head, tail = v0[:-1], ""
            else:
                p = 0
                while p < len(v0) and p < len(v1) and v0[p] == v1[p]:
                    p += 1
                head, tail = v0[:p], v0[p + 1:]
            if v0 != head + "0" + tail or v1 != head + "1" + tail or head[-1:].isdigit() or tail[:1].isdigit():
                raise _Unstampable(f"{v0!r} and {v1!r} do not name micro-batches 0 and 1")
            return list(map(head.__add__, self.names)) if not tail else [head + k + tail for k in self.names]
        if t is Action:
            if (v0.chunk, v0.type, v0.mb, v1.mb) != (v1.chunk, v1.type, 0, 1):
                raise _Unstampable(f"actions {v0} and {v1} are not one action of micro-batches 0 and 1")
            out = self.actions.get(v0)
            if out is None:      # validated as v0 was: only the micro-batch differs
                out = self.actions[v0] = list(map(Action._make, zip(repeat(v0.chunk), repeat(v0.type), range(m))))
            return out
        if t is tuple and len(v0) == len(v1):
            return list(zip(*[self(a, b) for a, b in zip(v0, v1)])) if v0 else [()] * m
        raise _Unstampable(f"{v0!r} and {v1!r} do not vary with the micro-batch")


def _varying(one: list, two: list) -> list[int]:
    """Positions where micro-batch 0's and 1's values differ (in value or type)."""
    if one == two and list(map(type, one)) == list(map(type, two)):
        return []
    return [p for p, (a, b) in enumerate(zip(one, two)) if a is not b and (a != b or type(a) is not type(b))]


def stamp(g2: Graph, m: int, lay: "tuple[list, list] | None" = None) -> Graph:
    """The graph of ``m`` micro-batches whose two-micro-batch form is ``g2`` (layout ``lay``, see
    :func:`layout`): every micro-batch block repeated m times with its micro-batch's values, every
    other node and edge kept once, in the order the directives would have made them."""
    nodes, edges = lay if lay is not None else layout(g2)
    n2 = len(g2)
    base = np.zeros(n2, np.int64)     # a micro-batch-0 or shared node's index in the result ...
    step = np.zeros(n2, np.int64)     # ... and how far it moves per micro-batch
    at = 0
    for s, n, per in nodes:
        base[s:s + n] = np.arange(at, at + n)
        if per:
            step[s:s + n] = n
        at += n * m if per else n
    out = Graph()
    series = _Series(m)
    ks = np.arange(m, dtype=np.int64)[:, None]
    for name, col in g2.cols.items():
        new: list = []
        for s, n, per in nodes:
            if not per:
                new += col[s:s + n]
                continue
            one, two = col[s:s + n], col[s + n:s + 2 * n]
            vary = _varying(one, two)
            if len(vary) == n and set(map(type, one)) == {int} == set(map(type, two)):    # e.g. mb
                a = np.asarray(one, np.int64)
                new += (a + ks * (np.asarray(two, np.int64) - a)).reshape(-1).tolist()
                continue
            at = len(new)
            for _ in range(m):
                new += one
            for p in vary:
                new[at + p::n] = series(one[p], two[p])
        out.cols[name] = new
    rows, mbs = [], []      # the result's edges: their g2 rows and micro-batches
    for s, n, per in edges:
        rows.append(np.tile(np.arange(s, s + n), m if per else 1))
        mbs.append(np.repeat(np.arange(m if per else 1), n))
    if rows:
        e, k = np.concatenate(rows), np.concatenate(mbs)
        u, v = np.asarray(g2.src, np.int64)[e], np.asarray(g2.dst, np.int64)[e]
        out.src = (base[u] + k * step[u]).tolist()
        out.dst = (base[v] + k * step[v]).tolist()
        out.ekind = np.asarray(g2.ekind, np.int64)[e].tolist()
    return out


def _kind(v: Any) -> Any:
    """``v``'s type, and for a plain tuple its elements' (what equality overlooks: ``1 == 1.0``)."""
    t = type(v)
    return (t, tuple(map(_kind, v))) if t is tuple else t


def _same_column(a: list, b: list) -> bool:
    if a != b or list(map(type, a)) != list(map(type, b)):
        return False
    return [_kind(x) for x in a if type(x) is tuple and x] == [_kind(x) for x in b if type(x) is tuple and x]


def _same(a: Graph, b: Graph) -> bool:
    """Node by node and edge by edge the same graph, values and their types alike."""
    return (a.src == b.src and a.dst == b.dst and a.ekind == b.ekind and a.cols.keys() == b.cols.keys()
            and all(_same_column(a.cols[k], b.cols[k]) for k in a.cols))


def _prefixes(g: Graph, steps: Sequence, k: int) -> list[Graph]:
    """The graphs after each of ``steps`` applied for ``k`` micro-batches, up to the first that fails."""
    out: list[Graph] = []
    try:
        for d in [dataclasses.replace(steps[0], microbatches=k), *steps[1:]]:
            g = d.apply(g)          # copies: each graph is kept
            out.append(g)
    except Exception:      # noqa: BLE001 - the caller applies that step for all m: the same result or error
        pass
    return out


def apply_stamped(g: Graph, steps: Sequence, m: int) -> tuple["Graph | None", int]:
    """The longest leading part of ``steps`` (a ``Split(microbatches=m)`` then stampable directives)
    whose result on the forward graph ``g`` stamps: applied for two micro-batches and stamped to ``m``,
    and how many steps that is; ``(None, 0)`` where no part would give the graph that applying it for
    m gives (checked on three micro-batches)."""
    two, three = _prefixes(g, steps, 2), _prefixes(g, steps, 3)
    for k in range(min(len(two), len(three)), 0, -1):
        try:
            lay = layout(two[k - 1])
            if _same(stamp(two[k - 1], 3, lay), three[k - 1]):
                return stamp(two[k - 1], m, lay), k
        except _Unstampable:
            pass
    return None, 0
