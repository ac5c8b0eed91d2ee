"""The training DAG: compute nodes (a region's forward, backward, split backward, recompute, optimizer
step) and communication nodes, joined by data edges (values flow) and order edges (scheduling).

A :class:`Graph` is columnar: one Python list per node attribute, so passes touch plain lists and
numpy arrays, never per-node objects. Graphs are values: every directive returns a new graph
(:meth:`Graph.copy` is a shallow copy of the columns).
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import repeat
from operator import eq, itemgetter
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from ..errors import ProgramError

__all__ = ["Graph", "Node", "DATA", "SAVED", "ORDER", "EDGE_KINDS", "NODE_FIELDS", "paused_gc", "take", "equals", "grouped",
           "distinct"]

DATA, SAVED, ORDER = 0, 1, 2
EDGE_KINDS = ("data", "saved", "order")

#: Node attributes (columns) with their defaults.
NODE_FIELDS: dict[str, Any] = {
    "op": "compute",      # "compute" or a comm kind (send, recv, all_reduce, ...)
    "phase": None,        # fwd, bwd, bwd_input, bwd_weight, recompute, optim
    "region": None,       # "embed", "layers.3.attn", ... (comm nodes: the region they serve)
    "kind": None,         # region kind: embed, attn, mlp, moe.route, moe.experts, moe.combine, head
    "layer": -1,          # transformer layer (-1 embed, layers for head)
    "chunk": -1,          # virtual pipeline stage (-1: unplaced)
    "mb": -1,             # micro-batch (-1: none)
    "stage": -1,          # pipeline stage holding the node (-1: unplaced)
    "flops": 0.0,         # this rank's FLOPs
    "nbytes": 0,          # comm: message/buffer bytes; compute: memory traffic estimate
    "act": 0,             # forward nodes: activation bytes stashed for backward
    "params": 0,          # compute nodes: parameter bytes the region reads on this rank
    "group": None,        # collectives: axis name or rank tuple
    "peer": None,         # p2p: "pp+1", "pp-1" or a rank
    "tag": None,          # matches send/recv pairs and collective members
    "key": None,          # opaque payload name for the runtime
    "stream": None,       # compute | comm | p2p (None: not yet assigned)
    "alloc": (),          # ((buffer, bytes), ...)
    "free": (),           # (buffer, ...)
    "action": None,       # schedule action this node belongs to: (chunk, type, mb) or None
    "pos": 0.0,           # order inside its action (region position; comm sits between regions)
    "slot": None,         # (action position on its stage, pos) once ordered; None before Order
    "shape": None,        # output shape (single-device graphs)
}
def take(col: Sequence, idx: Sequence[int]) -> list:
    """``[col[i] for i in idx]`` (at C speed)."""
    return list(itemgetter(*idx)(col)) if len(idx) > 1 else [col[i] for i in idx]


def equals(col: Sequence, value: object) -> np.ndarray:
    """``col[i] == value`` for every i, as a boolean array."""
    return np.fromiter(map(eq, col, repeat(value)), bool, len(col))


def grouped(keys: np.ndarray, nodes: np.ndarray) -> dict[int, list[int]]:
    """``nodes`` grouped by their integer ``keys``: key -> its nodes in the given order, the keys in
    first-seen order (what appending node by node to ``dict.setdefault(key, [])`` gives)."""
    if not len(keys):
        return {}
    o = np.argsort(keys, kind="stable")
    ks = keys[o]
    starts = np.flatnonzero(np.concatenate([[True], ks[1:] != ks[:-1]]))
    ns, b, kl = nodes[o].tolist(), np.append(starts, len(ks)).tolist(), ks[starts].tolist()
    return {kl[j]: ns[b[j]:b[j + 1]] for j in np.argsort(o[starts], kind="stable").tolist()}


def distinct(keys: np.ndarray) -> np.ndarray:
    """``np.unique(keys)``, by one sort (numpy 2's ``unique`` hashes: on a million integers 10-20x slower)."""
    s = np.sort(keys)
    return s[np.concatenate([[True], s[1:] != s[:-1]])] if len(s) else s


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (restored on exit). Compiling and simulating build
    millions of acyclic objects; left on, the collector rescans the growing heap over and over (a
    third of a full-scale compile's time) and frees nothing. On exit what the pause allocated joins
    the oldest generation, as long-lived objects do (else the first young collection after it would
    scan every one of them: a second per full-scale compile or simulation); a later full collection
    still reclaims any cycle among them."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.freeze()      # young and middle generations -> permanent ...
            gc.unfreeze()    # ... -> the oldest generation
            gc.enable()


_FIELD_SET = frozenset(NODE_FIELDS)
_KEEP = object()   # Graph.clone: a column copied from the cloned rows
_DEFAULTS = tuple(NODE_FIELDS.items())


@dataclass(frozen=True)
class Node:
    """A read-only view of one node (for people and tests; passes use the columns)."""

    index: int
    attrs: dict

    def __getattr__(self, name: str) -> Any:
        try:
            return self.attrs[name]
        except KeyError:
            raise AttributeError(name) from None

    def __str__(self) -> str:
        a = self.attrs
        bits = [f"#{self.index}", a["op"]]
        for k in ("phase", "region", "chunk", "mb", "stage", "tag"):
            v = a[k]
            if v is not None and v != -1:
                bits.append(f"{k}={v}")
        return " ".join(bits)


class Graph:
    """A DAG of compute and comm nodes (columnar) with typed edges (DATA, SAVED, ORDER)."""

    def __init__(self) -> None:
        self.cols: dict[str, list] = {k: [] for k in NODE_FIELDS}
        self.src: list[int] = []
        self.dst: list[int] = []
        self.ekind: list[int] = []
        self._scratch = False      # a result between two directives of apply_all: rewritten in place

    # ---- construction -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.cols["op"])

    def add(self, **attrs: Any) -> int:
        """Append a node; unspecified attributes take their defaults. Returns its index."""
        if not attrs.keys() <= _FIELD_SET:
            k = next(k for k in attrs if k not in NODE_FIELDS)
            raise ProgramError(f"unknown node attribute {k!r}; known: {', '.join(NODE_FIELDS)}")
        cols, get = self.cols, attrs.get
        for k, d in _DEFAULTS:
            cols[k].append(get(k, d))
        return len(cols["op"]) - 1

    def extend(self, n: int, **cols: Any) -> range:
        """Append ``n`` nodes at once: each keyword is a list of n values or one value for all."""
        for k in cols:
            if k not in NODE_FIELDS:
                raise ProgramError(f"unknown node attribute {k!r}; known: {', '.join(NODE_FIELDS)}")
        start = len(self)
        for k, d in NODE_FIELDS.items():
            v = cols.get(k, d)
            if isinstance(v, list):
                if len(v) != n:
                    raise ProgramError(f"column {k!r} has {len(v)} values for {n} nodes")
                self.cols[k].extend(v)
            else:
                self.cols[k].extend([v] * n)
        return range(start, start + n)

    def clone(self, rows: Sequence[int], **over: Any) -> range:
        """Append copies of nodes ``rows`` (in that order); each keyword replaces a column, with a
        list of one value per row or one value for all. Returns the new nodes' indices."""
        for k in over:
            if k not in NODE_FIELDS:
                raise ProgramError(f"unknown node attribute {k!r}; known: {', '.join(NODE_FIELDS)}")
        n, start = len(rows), len(self)
        take = itemgetter(*rows) if n > 1 else None
        for k, col in self.cols.items():
            v = over.get(k, _KEEP)
            if v is _KEEP:
                col.extend(take(col) if take is not None else [col[i] for i in rows])
            elif isinstance(v, list):
                if len(v) != n:
                    raise ProgramError(f"column {k!r} has {len(v)} values for {n} nodes")
                col.extend(v)
            else:
                col.extend([v] * n)
        return range(start, start + n)

    def edge(self, u: int, v: int, kind: int = DATA) -> None:
        self.src.append(u)
        self.dst.append(v)
        self.ekind.append(kind)

    def add_edges(self, src: Sequence[int], dst: Sequence[int], kind: int = DATA) -> None:
        """Edges ``src[i] -> dst[i]``, all of ``kind`` (one list extension, not a call per edge)."""
        self.src += src
        self.dst += dst
        self.ekind += [kind] * len(src)

    def copy(self) -> "Graph":
        g = Graph()
        g.cols = {k: list(v) for k, v in self.cols.items()}
        g.src, g.dst, g.ekind = list(self.src), list(self.dst), list(self.ekind)
        return g

    def owned(self) -> "Graph":
        """The graph a directive rewrites: a copy (a directive never changes its input), or this graph
        itself where it is a scratch result between two directives of ``apply_all`` that no one else
        holds (a full-scale step's graph has ~800k nodes: a copy per directive is a second of work)."""
        return self if self._scratch else self.copy()

    def node(self, i: int) -> Node:
        return Node(i, {k: v[i] for k, v in self.cols.items()})

    def nodes(self) -> Iterable[Node]:
        return (self.node(i) for i in range(len(self)))

    def col(self, name: str) -> list:
        return self.cols[name]

    def array(self, name: str) -> np.ndarray:
        """A numeric column as a numpy array (chunk, mb, stage, layer, flops, nbytes, ...)."""
        return np.asarray(self.cols[name])

    def edges(self, kinds: Sequence[int] = (DATA, SAVED, ORDER)) -> tuple[np.ndarray, np.ndarray]:
        s, d, k = np.asarray(self.src, np.int64), np.asarray(self.dst, np.int64), np.asarray(self.ekind)
        m = np.isin(k, kinds) if len(k) else np.zeros(0, bool)
        return s[m], d[m]

    # ---- edge rewriting -----------------------------------------------------------------------
    def out_edges(self, u: int, kind: int | None = None) -> list[int]:
        return [e for e, s in enumerate(self.src) if s == u and (kind is None or self.ekind[e] == kind)]

    def insert_after(self, items: Sequence[tuple[int, int]]) -> None:
        """For each (u, c): reroute u's DATA out-edges through c (u -> c -> old targets).

        Vectorized over all pairs at once: one pass over the edge list.
        """
        if not items:
            return
        via = dict(items)
        get = via.get
        self.src = [get(u, u) if k == DATA else u for u, k in zip(self.src, self.ekind)]
        self.add_edges([u for u, _ in items], [c for _, c in items], DATA)

    # ---- analysis ----------------------------------------------------------------------------
    def topo_order(self, kinds: Sequence[int] = (DATA, SAVED, ORDER), key: Sequence[float] | None = None
                   ) -> np.ndarray:
        """A topological order (Kahn; ties by ``key`` then index). Raises ProgramError on a cycle."""
        import heapq
        n = len(self)
        s, d = self.edges(kinds)
        indeg = np.bincount(d, minlength=n).tolist()
        order_ix = np.argsort(s, kind="stable")
        s_sorted, d_sorted = s[order_ix], d[order_ix]
        start = np.searchsorted(s_sorted, np.arange(n + 1)).tolist()
        succ = d_sorted.tolist()
        k = list(key) if key is not None else [0.0] * n
        heap = [(k[i], i) for i in range(n) if indeg[i] == 0]
        heapq.heapify(heap)
        out: list[int] = []
        while heap:
            _, u = heapq.heappop(heap)
            out.append(u)
            for j in range(start[u], start[u + 1]):
                v = succ[j]
                indeg[v] -= 1
                if indeg[v] == 0:
                    heapq.heappush(heap, (k[v], v))
        if len(out) != n:
            cyc = self.find_cycle(kinds)
            raise ProgramError("the graph has a cycle: " + " -> ".join(str(self.node(i)) for i in cyc)
                               + "; an Order or placement asks for a node before one it depends on")
        return np.asarray(out, np.int64)

    def find_cycle(self, kinds: Sequence[int] = (DATA, SAVED, ORDER)) -> list[int]:
        """Nodes of one cycle (first node repeated at the end), or [] when the graph is acyclic."""
        n = len(self)
        s, d = self.edges(kinds)
        adj: list[list[int]] = [[] for _ in range(n)]
        for u, v in zip(s.tolist(), d.tolist()):
            adj[u].append(v)
        color = [0] * n
        parent = [-1] * n
        for root in range(n):
            if color[root]:
                continue
            stack = [(root, 0)]
            color[root] = 1
            while stack:
                u, i = stack[-1]
                if i < len(adj[u]):
                    stack[-1] = (u, i + 1)
                    v = adj[u][i]
                    if color[v] == 0:
                        color[v] = 1
                        parent[v] = u
                        stack.append((v, 0))
                    elif color[v] == 1:
                        cyc = [v]
                        w = u
                        while w != v:
                            cyc.append(w)
                            w = parent[w]
                        cyc.append(v)
                        return cyc[::-1]
                else:
                    color[u] = 2
                    stack.pop()
        return []

    def is_acyclic(self, kinds: Sequence[int] = (DATA, SAVED, ORDER)) -> bool:
        return not self.find_cycle(kinds)

    def select(self, **where: Any) -> np.ndarray:
        """Indices of nodes whose attributes equal the given values."""
        m = np.ones(len(self), bool)
        for k, v in where.items():
            col = self.cols[k]
            m &= np.fromiter((x == v for x in col), bool, len(col))
        return np.flatnonzero(m)

    def totals(self) -> dict:
        """FLOPs and bytes summed by op."""
        out: dict[str, dict[str, float]] = {}
        for op, f, b in zip(self.cols["op"], self.cols["flops"], self.cols["nbytes"]):
            t = out.setdefault(op, {"count": 0, "flops": 0.0, "nbytes": 0})
            t["count"] += 1
            t["flops"] += f
            t["nbytes"] += b
        return out

    def to_frame(self):
        """One row per node (pandas)."""
        import pandas as pd
        return pd.DataFrame({k: v for k, v in self.cols.items() if k not in ("alloc", "free")})

    def __repr__(self) -> str:
        return f"Graph({len(self)} nodes, {len(self.src)} edges)"
