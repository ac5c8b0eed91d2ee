"""Lower an ordered distributed graph to a :class:`~parashift.ir.program.Program`.

Per pipeline stage (every rank of a stage shares one RankProgram: DP replicas and TP/EP peers differ
only by which shard they hold, which the strategy resolves), per logical stream, one total order:

- ``compute`` and ``comm``: nodes sorted by their Order slot (step position, position in the step);
- ``p2p``: one global order of matched send/recv pairs, taken from a dataflow replay of the stages'
  step orders with FLOP-proportional durations: a pair is ordered by the time its sender's step ends,
  so every rank meets its pairs in the same relative order and the rendezvous replay cannot deadlock.

Cross-stream dependencies become ``deps`` (per producing stream only the latest producer is kept;
the stream order implies the rest). Activation buffers ``act.c{chunk}.m{mb}[.{region}]`` (one per
region where a chunk's regions are separate instructions) are allocated by the first forward
instruction and freed by the last backward instruction of their region.
"""
from __future__ import annotations

from itertools import compress, repeat
from operator import is_not, itemgetter
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import ProgramError
from ..strategy import Strategy
from . import tags as T
from .actions import Action, action_ids
from .graph import Graph, equals as _equals, grouped, take as _take
from .placement import graph_placement, placement_meta
from .program import Instr, Program, RankProgram, instrs_from_rows

__all__ = ["lower", "pair_order"]

STREAMS = ("compute", "comm", "p2p")


def stream_names(streams: Sequence[str]) -> tuple[str, ...]:
    """The built-in streams, then the user-named ones a ``Stream`` directive created (sorted)."""
    return STREAMS + tuple(sorted({str(s) for s in set(streams)} - set(STREAMS)))


def pair_order(g: Graph, step_time: "Callable[[Action], float] | None" = None, *,
               _cols: "_Columns | None" = None) -> list[int]:
    """Send nodes in the global order their pairs complete (see module docstring). ``step_time``
    (optional) gives each action's duration for the replay instead of its FLOPs, e.g. the durations
    a schedule was planned with, which also count the TP communication on the compute stream."""
    c = g.cols
    n = len(g)
    cols = _Columns(g) if _cols is None else _cols
    slot_k, slot_p_all, aid, alist, stage = cols.slot_k, cols.slot_p, cols.aid, cols.alist, cols.stage
    timed = (aid >= 0) & cols.has_slot
    ti = np.flatnonzero(timed)
    st_t = stage[ti]
    k_t = slot_k[ti]
    steps: dict[int, dict[int, float]] = {}          # stage -> step -> duration
    if step_time is None:
        flops = np.fromiter((f if o == "compute" else 0.0 for o, f in zip(c["op"], c["flops"])), np.float64, n)[ti]
        # the steps in first-seen order, their FLOPs summed in node order (as a running sum would)
        keys = st_t * (int(k_t.max()) + 1 if len(k_t) else 1) + k_t
        uk, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        tot = np.zeros(len(uk))
        np.add.at(tot, inv, flops)
        for j in np.argsort(first, kind="stable").tolist():
            steps.setdefault(int(st_t[first[j]]), {})[int(k_t[first[j]])] = float(tot[j])
    else:
        a_t = aid[ti]
        _, seen = np.unique(st_t * max(len(alist), 1) + a_t, return_index=True)
        seen.sort()
        for st, a, k in zip(st_t[seen].tolist(), a_t[seen].tolist(), k_t[seen].tolist()):
            d = steps.setdefault(st, {})            # each (stage, action) once, in first-seen order
            d[k] = d.get(k, 0.0) + float(step_time(alist[a]))
    scale = max((v for d in steps.values() for v in d.values()), default=1.0) or 1.0
    is_send = cols.is_send
    on_p2p = _equals(c["stream"], "p2p")
    recv_of = cols.recv_of
    sends = np.flatnonzero(is_send & on_p2p).tolist()   # pipeline hand-offs
    recv_of = {u: v for u, v in recv_of.items() if on_p2p[u]}
    if len(recv_of) != len(sends):
        raise ProgramError("a send node has no recv node; apply Place to add send/recv pairs")
    # a (stage, step) as one int key: stage * width + step position
    width = int(slot_k.max()) + 1 if len(slot_k) else 1
    sa = np.asarray(sends, np.int64)
    ra = np.fromiter(map(recv_of.__getitem__, sends), np.int64, len(sends))
    needs = grouped(stage[ra] * width + slot_k[ra], sa)      # (stage, step) -> sends whose recv it consumes
    out_of = grouped(stage[sa] * width + slot_k[sa], sa)     # (stage, step) -> sends it produces
    order = {st: sorted(d) for st, d in steps.items()}
    ptr = dict.fromkeys(order, 0)
    free = dict.fromkeys(order, 0.0)
    t_send: dict[int, float] = {}
    sent = t_send.__getitem__
    progress = True
    while progress:
        progress = False
        for st, ks in order.items():
            p, f, d, base = ptr[st], free[st], steps[st], st * width
            while p < len(ks):
                k = ks[p]
                ins = needs.get(base + k)
                if ins:
                    try:
                        start = max(f, *map(sent, ins))
                    except KeyError:        # a send it waits for has not run yet
                        break
                else:
                    start = f
                f = start + d[k] / scale + 1e-6
                for s in out_of.get(base + k, ()):
                    t_send[s] = f
                p += 1
                progress = True
            ptr[st], free[st] = p, f
    stuck = [st for st, ks in order.items() if ptr[st] < len(ks)]
    if stuck:
        raise ProgramError(f"the step orders of stages {stuck} wait on each other (no stage can run its next "
                           f"step); fix the Order")
    if not sends:
        return []
    t = np.fromiter(map(sent, sends), np.float64, len(sends))
    o = np.lexsort((slot_p_all[sa], slot_k[sa], stage[sa], t))
    return sa[o].tolist()


class _Columns:
    """The graph's columns the lowering reads as arrays, converted once: stage, edges, slots
    (:func:`_slot_keys`; ``has_slot``), actions (:func:`.actions.action_ids`), send/recv masks and each
    send's recv (``recv_of``)."""

    def __init__(self, g: Graph) -> None:
        c, n = g.cols, len(g)
        self.stage = np.asarray(c["stage"], np.int64) if n else np.zeros(0, np.int64)
        self.src = np.asarray(g.src, np.int64)
        self.dst = np.asarray(g.dst, np.int64)
        self.slot_k, self.slot_p, self.has_slot = _slot_keys(c)
        self.aid, self.alist = action_ids(c["action"])
        self.is_send = _equals(c["op"], "send")
        self.is_recv = _equals(c["op"], "recv")
        src, dst = self.src, self.dst
        sr = self.is_send[src] & self.is_recv[dst] if len(src) else np.zeros(0, bool)
        self.recv_of = dict(zip(src[sr].tolist(), dst[sr].tolist()))


def _slot_keys(c: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each node's slot as two arrays (step position, position in the step; (0, 0.0) without one)
    and whether it has one."""
    slots = c["slot"]
    n = len(slots)
    has = np.fromiter(map(is_not, slots, repeat(None)), bool, n)
    held = list(compress(slots, has)) if not has.all() else slots
    k, p = np.zeros(n, np.int64), np.zeros(n, np.float64)
    k[has] = np.fromiter(map(itemgetter(0), held), np.int64, len(held))
    p[has] = np.fromiter(map(itemgetter(1), held), np.float64, len(held))
    return k, p, has


def _slot_rank(g: Graph, stage: np.ndarray, sid: np.ndarray, slot_k: np.ndarray, slot_p: np.ndarray,
               src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Per stage, one order of its compute and comm nodes: slot order where that already respects
    every data edge between them, else the slot-priority topological order (a directive may anchor
    a node at a slot before a producer it waits on: taken literally, the two streams' orders would
    wait on each other)."""
    import heapq
    n = len(g)
    idx = np.flatnonzero(sid != _P2P)
    o = np.lexsort((idx, sid[idx], slot_p[idx], slot_k[idx], stage[idx]))
    nodes = idx[o]
    rank = np.full(n, -1, np.int64)
    rank[nodes] = np.arange(len(nodes))
    ok = (rank[src] >= 0) & (rank[dst] >= 0) & (stage[src] == stage[dst])
    back = ok & (rank[src] > rank[dst])
    if not back.any():
        return rank
    su, du = src[ok], dst[ok]
    succ: dict[int, list[int]] = {}
    indeg = np.zeros(n, np.int64)
    for u, v in zip(su.tolist(), du.tolist()):
        succ.setdefault(u, []).append(v)
    np.add.at(indeg, du, 1)
    heap = [(int(rank[i]), i) for i in nodes.tolist() if indeg[i] == 0]
    heapq.heapify(heap)
    k = 0
    out = np.full(n, -1, np.int64)
    while heap:
        _, u = heapq.heappop(heap)
        out[u] = k
        k += 1
        for v in succ.get(u, ()):
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (int(rank[v]), v))
    if k != len(nodes):
        raise ProgramError("the distributed graph has a cycle; a directive added an edge that points backwards")
    return out


_SID = {s: k for k, s in enumerate(STREAMS)}
_P2P = _SID["p2p"]


def _within(order: np.ndarray, *group_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For nodes sorted by ``order`` (grouped by ``group_keys``): each one's position in its group,
    and the group boundaries (start offsets into ``order``, plus the end)."""
    m = len(order)
    brk = np.zeros(m, bool)
    if m:
        brk[0] = True
        for k in group_keys:
            ks = k[order]
            brk[1:] |= ks[1:] != ks[:-1]
    starts = np.flatnonzero(brk)
    pos = np.arange(m) - np.repeat(starts, np.diff(np.append(starts, m)))
    return pos, np.append(starts, m)


def lower(g: Graph, strategy: Strategy, *, static_memory: Sequence[Mapping[str, int]] = (),
          meta: Mapping[str, Any] | None = None, step_time: "Callable[[Action], float] | None" = None) -> Program:
    """One RankProgram per pipeline stage, shared by all ranks of that stage (``step_time``: see
    :func:`pair_order`)."""
    c = g.cols
    n = len(g)
    pp = strategy.pp
    strategy = graph_placement(g, strategy)       # a custom Place: the runtime follows the graph's placement
    cols = _Columns(g)
    stage = cols.stage
    if n and (stage.min() < 0 or stage.max() >= pp):
        raise ProgramError("every node needs a pipeline stage in [0, pp); apply Place first")
    ops = c["op"]
    missing = np.flatnonzero(~cols.has_slot & ~cols.is_send & ~cols.is_recv).tolist()
    if missing:
        raise ProgramError(f"{len(missing)} nodes have no order (e.g. {g.node(missing[0])}); apply an Order "
                           f"covering stage {c['stage'][missing[0]]}")
    # ---- per-stream positions -----------------------------------------------------------------
    streams = c["stream"]
    unknown = {s for s in set(streams) if not isinstance(s, str) or not s.isidentifier()}
    if unknown:
        raise ProgramError(f"stream names {sorted(map(str, unknown))} are not identifiers; name a Stream "
                           f"like 'grads' or 'zero_gather'")
    names = stream_names(streams)
    sid_of = {s: k for k, s in enumerate(names)}
    sid = np.fromiter(map(sid_of.__getitem__, streams), np.int64, n)
    slot_k, slot_p = cols.slot_k, cols.slot_p
    sends = pair_order(g, step_time, _cols=cols)
    src, dst, recv_of = cols.src, cols.dst, cols.recv_of
    key = _slot_rank(g, stage, sid, slot_k, slot_p, src, dst)      # compute/comm: slot-priority order
    p2p = sid == _P2P
    key[p2p] = -1
    ks = np.asarray(sends, np.int64)
    key[ks] = np.arange(len(ks))
    key[np.asarray([recv_of[s] for s in sends], np.int64)] = np.arange(len(ks))
    if (key[p2p] < 0).any():
        i = int(np.flatnonzero(p2p & (key < 0))[0])
        raise ProgramError(f"{g.node(i)} is on the p2p stream but is not a send/recv pair; apply Place")
    seq_order = np.lexsort((key, sid, stage))               # grouped by (stage, stream), in stream order
    pos, bounds = _within(seq_order, stage, sid)
    index = np.zeros(n, np.int64)
    index[seq_order] = pos
    # ---- ids: per stage, in (slot, stream) order -------------------------------------------------
    id_order = np.lexsort((index, sid, slot_p, slot_k, stage))
    ids = np.zeros(n, np.int64)
    ids[id_order] = _within(id_order, stage)[0]
    # ---- deps ------------------------------------------------------------------------------------
    cross_stage = stage[src] != stage[dst]
    if cross_stage.any():
        bad = [(int(u), int(v)) for u, v in zip(src[cross_stage], dst[cross_stage])
               if not (c["op"][u] == "send" and c["op"][v] == "recv")]
        if bad:
            u, v = bad[0]
            raise ProgramError(f"data flows between stages without send/recv: {g.node(u)} -> {g.node(v)}; "
                               f"apply Place")
    same = ~cross_stage
    s2, d2 = src[same], dst[same]
    in_stream = sid[s2] == sid[d2]
    back = in_stream & (index[s2] >= index[d2])
    if back.any():
        u, v = int(s2[back][0]), int(d2[back][0])
        raise ProgramError(f"stream order contradicts a dependency: {g.node(u)} must precede {g.node(v)}")
    s3, d3 = s2[~in_stream], d2[~in_stream]
    # per (consumer, producing stream) only the latest producer
    o = np.lexsort((-index[s3], sid[s3], d3))
    s3, d3 = s3[o], d3[o]
    first = np.ones(len(o), bool)
    first[1:] = (d3[1:] != d3[:-1]) | (sid[s3][1:] != sid[s3][:-1])
    dv, du = d3[first], ids[s3[first]]
    o = np.lexsort((du, dv))
    # ---- activation buffers -------------------------------------------------------------------------
    alloc_extra, free_extra = _act_buffers(c, index, cols)
    # ---- instructions -------------------------------------------------------------------------------
    dep_col: list = [()] * n
    for v, u in zip(dv[o].tolist(), du[o].tolist()):
        lst = dep_col[v]
        dep_col[v] = (u,) if not lst else lst + (u,)
    alloc_c, free_c = _tuples(c["alloc"]), _tuples(c["free"])
    for i, ax in alloc_extra.items():
        alloc_c[i] = (ax,) + alloc_c[i]
    for i, fx in free_extra.items():
        free_c[i] = free_c[i] + (fx,)
    b = bounds.tolist()
    stage_l = stage[seq_order[bounds[:-1]]].tolist() if n else []
    per_stage: list[dict[str, tuple[Instr, ...]]] = [{} for _ in range(pp)]
    # every node's instruction, built from its fields' columns (see program.instrs_from_rows)
    chunk, mbs, flops, nbytes = _numeric(c)
    comp = _equals(ops, "compute")
    built = instrs_from_rows(zip(
        ids.tolist(), ops, streams, dep_col, c["phase"], _unless(stage, comp), _unless(chunk, chunk >= 0),
        _unless(mbs, mbs >= 0), _unless(c["region"], comp), flops.tolist(), nbytes.tolist(), c["peer"], c["group"],
        repeat(None), c["tag"], c["key"], alloc_c, free_c))
    so = seq_order.tolist()
    ordered = _take(built, so)          # grouped by (stage, stream), in stream order
    for gi in range(len(b) - 1):
        per_stage[stage_l[gi]][streams[so[b[gi]]]] = tuple(ordered[b[gi]:b[gi + 1]])
    progs: list[RankProgram] = []
    for st in range(pp):
        mem = dict(static_memory[st]) if st < len(static_memory) else {}
        progs.append(RankProgram(per_stage[st], mem))
    ranks_stage = np.arange(strategy.world) // (strategy.world // strategy.pp)
    ranks = {int(r): progs[int(st)] for r, st in enumerate(ranks_stage)}
    meta = dict(meta or {})
    if placement_meta(strategy):
        meta["placement"] = placement_meta(strategy)
    return Program(ranks, strategy, meta)


def _numeric(c: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The chunk and micro-batch columns (int64), the FLOPs as Python floats would hold them
    (float64) and the bytes truncated to ints (as ``int()`` does), for gathering by node."""
    nb = np.asarray(c["nbytes"])
    if nb.dtype.kind != "i":
        nb = np.fromiter(map(int, c["nbytes"]), np.int64, len(nb))
    return (np.asarray(c["chunk"], np.int64), np.asarray(c["mb"], np.int64), np.asarray(c["flops"], np.float64),
            nb.astype(np.int64, copy=False))


def _unless(values: "np.ndarray | list", keep: np.ndarray) -> list:
    """``values[i]`` (a Python object) where ``keep[i]``, else None, as a list."""
    if not isinstance(values, np.ndarray):
        out = list(values)
        for i in np.flatnonzero(~keep).tolist():
            out[i] = None
        return out
    out = np.full(len(keep), None, object)
    out[keep] = values[keep].tolist()
    return out.tolist()


def _tuples(col: list) -> list:
    """A copy of ``col`` with every entry a tuple."""
    return list(col) if set(map(type, col)) <= {tuple} else [tuple(x) for x in col]


def _act_buffers(c: dict, index: np.ndarray, cols: _Columns) -> tuple[dict[int, tuple[str, int]], dict[int, str]]:
    """Activation buffers: one per region of a chunk's micro-batch, ``act.c{chunk}.m{mb}.{region}``,
    allocated by the region's first forward instruction (in stream order) and freed by its last
    backward one, as a region keeps its stash from its forward to its (weight-gradient) backward;
    ``act.c{chunk}.m{mb}`` when the chunk runs that micro-batch's forward as one region (fused).
    Returns node -> (name, bytes) and node -> name."""
    aid, alist = cols.aid, cols.alist
    nodes = np.flatnonzero(_equals(c["op"], "compute") & (aid >= 0))
    if not len(nodes):
        return {}, {}
    sel = nodes.tolist()
    aid = aid[nodes]
    regs = _take(c["region"], sel)
    codes = {r: k for k, r in enumerate(dict.fromkeys(regs))}      # in first-seen order
    rc = np.fromiter(map(codes.__getitem__, regs), np.int64, len(regs))
    names = list(codes)
    chunk = np.fromiter((a[0] for a in alist), np.int64, len(alist))[aid]
    mb = np.fromiter((a[2] for a in alist), np.int64, len(alist))[aid]
    fwd = np.fromiter((a[1] == "F" for a in alist), bool, len(alist))[aid]
    width, nreg = int(mb.max()) + 1, len(names)
    uk, inv = np.unique((chunk * width + mb) * nreg + rc, return_inverse=True)
    inv = inv.reshape(-1)
    act_bytes = np.zeros(len(uk), np.int64)
    np.add.at(act_bytes, inv[fwd], np.asarray(_take(c["act"], sel), np.int64)[fwd])
    cm = uk // nreg
    # regions per (chunk, mb) that run a forward: one means the chunk's forward is fused
    has_fwd = np.zeros(len(uk), bool)
    has_fwd[inv[fwd]] = True
    ucm, count = np.unique(cm[has_fwd], return_counts=True)
    at = np.minimum(np.searchsorted(ucm, cm), max(len(ucm) - 1, 0))
    multi = (ucm[at] == cm) & (count[at] > 1) if len(ucm) else np.zeros(len(cm), bool)
    ix = index[nodes]
    # per key: the forward node first in stream order, the backward node last (ties: the first node)
    o = np.lexsort((np.arange(len(sel)), ix, inv))
    o = o[fwd[o]]
    lead = np.ones(len(o), bool)
    lead[1:] = inv[o][1:] != inv[o][:-1]
    first = dict(zip(inv[o][lead].tolist(), nodes[o][lead].tolist()))
    o = np.lexsort((-np.arange(len(sel)), ix, inv))
    o = o[~fwd[o]]
    tail = np.ones(len(o), bool)
    tail[:-1] = inv[o][1:] != inv[o][:-1]
    last = dict(zip(inv[o][tail].tolist(), nodes[o][tail].tolist()))
    nbytes = act_bytes.tolist()
    # one buffer per key with bytes: the region named where the chunk's forward has several
    named = np.flatnonzero(act_bytes != 0)
    regions = [names[r] if m else None for r, m in zip((uk % nreg)[named].tolist(), multi[named].tolist())]
    name = dict(zip(named.tolist(), T.StepBuffer.act_names((cm[named] // width).tolist(), (cm[named] % width).tolist(),
                                                           regions)))
    alloc_extra = {i: (name[k], nbytes[k]) for k, i in first.items() if nbytes[k]}
    free_extra = {i: name[k] for k, i in last.items() if nbytes[k]}
    return alloc_extra, free_extra
