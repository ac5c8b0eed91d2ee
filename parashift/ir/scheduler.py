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
from .graph import Graph, take as _take
from .placement import graph_placement, placement_meta
from .program import Instr, Program, RankProgram, instrs_from_columns

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
    cols = _Columns(g) if _cols is None else _cols
    slot_k, slot_p, aid, alist, stage = cols.slot_k, cols.slot_p, cols.aid, cols.alist, cols.stage
    ti = np.flatnonzero((aid >= 0) & cols.has_slot)
    st_t, k_t = stage[ti], slot_k[ti]
    # a (stage, step) as one int key: stage * width + step position
    width = int(slot_k.max()) + 1 if len(slot_k) else 1
    if step_time is None:
        comp = cols.is_compute[ti]
        flops = np.zeros(len(ti))
        flops[comp] = _floats(_take(c["flops"], ti[comp].tolist()))
        # each step's FLOPs summed in node order (as a running sum would)
        keys = st_t * width + k_t
        steps, first = _firsts(keys)
        dur = np.zeros(len(steps))
        np.add.at(dur, np.searchsorted(steps, keys), flops)
    else:
        # each (stage, action) once, in first-seen order, its duration added to its step's
        a_t = aid[ti]
        pair = st_t * max(len(alist), 1) + a_t
        seen = np.sort(_firsts(pair)[1])
        first_key = st_t[seen] * width + k_t[seen]
        steps, first, inv = np.unique(first_key, return_index=True, return_inverse=True)
        first = seen[first]
        dur = np.zeros(len(steps))
        np.add.at(dur, inv.reshape(-1), np.fromiter(map(float, map(step_time, _take(alist, a_t[seen].tolist()))),
                                                     np.float64, len(seen)))
    scale = float(dur.max()) if len(dur) else 1.0
    scale = scale or 1.0
    is_send = cols.is_send & cols.on_p2p
    sa = np.flatnonzero(is_send)                  # pipeline hand-offs
    ra = cols.recv[sa]
    if (ra < 0).any():
        raise ProgramError("a send node has no recv node; apply Place to add send/recv pairs")
    # the step each send's pair is produced by and consumed in (len(steps): no such step)
    prod = _lookup(steps, stage[sa] * width + slot_k[sa])
    cons = _lookup(steps, stage[ra] * width + slot_k[ra])
    # stages' runs of steps (steps are sorted by stage, then position)
    st_of = steps // width
    bounds = np.flatnonzero(np.concatenate(([True], st_of[1:] != st_of[:-1], [True]))) if len(steps) else \
        np.zeros(1, np.int64)
    # per step, the producing steps of the sends it waits for (in send order): CSR
    has = cons < len(steps)
    o = np.argsort(cons[has], kind="stable")
    need = prod[has][o].tolist()
    nptr = np.concatenate(([0], np.cumsum(np.bincount(cons[has], minlength=len(steps))))).tolist()
    end = _replay(bounds.tolist(), (dur / scale).tolist(), nptr, need)
    stuck = [i for i in range(len(bounds) - 1) if end[bounds[i + 1] - 1] is None]
    if stuck:
        # stages in first-seen order
        sts = st_of[bounds[:-1]]
        seen_at = np.minimum.reduceat(first, bounds[:-1]) if len(steps) else np.zeros(0, np.int64)
        names = [int(sts[i]) for i in sorted(stuck, key=lambda i: seen_at[i])]
        raise ProgramError(f"the step orders of stages {names} wait on each other (no stage can run its next "
                           f"step); fix the Order")
    if not len(sa):
        return []
    if (prod == len(steps)).any():
        raise ProgramError(f"{g.node(int(sa[np.flatnonzero(prod == len(steps))[0]]))} is in no step of its stage's "
                           f"Order; fix the Order")
    t = np.asarray(end[:-1], np.float64)[prod]
    o = np.lexsort((slot_p[sa], slot_k[sa], stage[sa], t))
    return sa[o].tolist()


def _lookup(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Each key's index in ``sorted_keys`` (``len(sorted_keys)`` where absent)."""
    m = len(sorted_keys)
    if not m:
        return np.zeros(len(keys), np.int64)
    at = np.minimum(np.searchsorted(sorted_keys, keys), m - 1)
    return np.where(sorted_keys[at] == keys, at, m)


def _replay(bounds: list, dur: list, nptr: list, need: list) -> list:
    """The dataflow replay of :func:`pair_order`: steps ``bounds[i]:bounds[i + 1]`` run in order on stage i,
    step j taking ``dur[j]`` (+1e-6) once the steps ``need[nptr[j]:nptr[j + 1]]`` have ended (step
    ``len(dur)`` never does). Returns each step's end time (None: never ran), then that None."""
    end: list = [None] * (len(dur) + 1)
    ptr, last = bounds[:-1], bounds[1:]
    free = [0.0] * len(ptr)
    progress = True
    while progress:
        progress = False
        for i in range(len(ptr)):
            p, h, f = ptr[i], last[i], free[i]
            p0 = p
            while p < h:
                a, b = nptr[p], nptr[p + 1]
                start = f
                if a != b:
                    for u in need[a:b]:
                        e = end[u]
                        if e is None:
                            break
                        if e > start:
                            start = e
                    else:
                        f = end[p] = start + dur[p] + 1e-6
                        p += 1
                        continue
                    break
                f = end[p] = start + dur[p] + 1e-6
                p += 1
            if p != p0:
                ptr[i], free[i] = p, f
                progress = True
    return end


class _Columns:
    """The graph's columns the lowering reads as arrays, converted once: stage, edges, slots
    (:func:`_slot_keys`; ``has_slot``), actions (:func:`.actions.action_ids`), op and stream masks and each
    send's recv (``recv``)."""

    def __init__(self, g: Graph) -> None:
        c, n = g.cols, len(g)
        self.stage = _ints(c["stage"])
        self.src, self.dst = _ints(g.src), _ints(g.dst)
        self.slot_k, self.slot_p, self.has_slot = _slot_keys(c)
        self.aid, self.alist = action_ids(c["action"])
        op, code = _codes(c["op"])
        self.is_send, self.is_recv, self.is_compute = (_is(op, code, x) for x in ("send", "recv", "compute"))
        self.stream, self.stream_code = _codes(c["stream"])
        self.on_p2p = _is(self.stream, self.stream_code, "p2p")
        src, dst = self.src, self.dst
        sr = self.is_send[src] & self.is_recv[dst] if len(src) else np.zeros(0, bool)
        self.recv = np.full(n, -1, np.int64)       # each send's recv (-1: none)
        self.recv[src[sr]] = dst[sr]


def _ints(col: Sequence) -> np.ndarray:
    """A column of integers as int64."""
    return np.fromiter(col, np.int64, len(col))


def _chunks(col: list) -> np.ndarray:
    """The chunk column as int64 (-1: unplaced, also for None)."""
    try:
        return _ints(col)
    except TypeError:
        return np.fromiter((-1 if x is None else x for x in col), np.int64, len(col))


def _floats(col: Sequence) -> np.ndarray:
    return np.fromiter(col, np.float64, len(col))


class _FirstSeen(dict):
    """value -> its index among the distinct values looked up so far (first-seen order), assigned on lookup."""

    def __missing__(self, value: object) -> int:
        k = self[value] = len(self)
        return k


def _codes(col: Sequence) -> tuple[np.ndarray, dict]:
    """Each entry's index among the column's distinct entries (in first-seen order) as an array, and the
    value -> index map (equal values share one)."""
    code = _FirstSeen()
    try:
        return np.frombuffer(bytes(map(code.__getitem__, col)), np.uint8), dict(code)
    except ValueError:      # over 256 distinct values (the codes so far stay as they are)
        return np.fromiter(map(code.__getitem__, col), np.int64, len(col)), dict(code)


def _is(codes: np.ndarray, code: dict, value: object) -> np.ndarray:
    """Where a coded column equals ``value``."""
    k = code.get(value)
    return codes == k if k is not None else np.zeros(len(codes), bool)


def _slot_keys(c: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each node's slot as two arrays (step position, position in the step; (0, 0.0) without one)
    and whether it has one."""
    slots = c["slot"]
    n = len(slots)
    try:        # every node ordered (a None slot is not subscriptable)
        return (np.fromiter(map(itemgetter(0), slots), np.int64, n),
                np.fromiter(map(itemgetter(1), slots), np.float64, n), np.ones(n, bool))
    except TypeError:
        pass
    has = np.fromiter(map(is_not, slots, repeat(None)), bool, n)
    held = list(compress(slots, has))
    k, p = np.zeros(n, np.int64), np.zeros(n, np.float64)
    k[has] = np.fromiter(map(itemgetter(0), held), np.int64, len(held))
    p[has] = np.fromiter(map(itemgetter(1), held), np.float64, len(held))
    return k, p, has


def _sort(*keys: np.ndarray, unique: bool = False) -> np.ndarray:
    """``np.lexsort(keys[::-1])`` (``keys`` integer arrays, the most significant first), as one sort of
    the keys packed into one int64 (the index as the last key, unless the keys are ``unique``) where
    they fit in one."""
    n = len(keys[0])
    if not n:
        return np.zeros(0, np.int64)
    packed = np.zeros(n, np.int64)
    bits = 0
    for k in keys if unique else (*keys, np.arange(n)):
        low = int(k.min())
        b = (int(k.max()) - low).bit_length()
        bits += b
        if bits > 62:
            return np.lexsort(keys[::-1])
        packed <<= b
        packed |= k - low
    if unique:
        return np.argsort(packed)
    packed.sort()
    return packed & ((1 << (n - 1).bit_length()) - 1)       # the index, in the low bits


def _distinct(x: np.ndarray) -> np.ndarray:
    """``np.unique(x)``, by a sort (numpy's hash-based unique of integers is slower on large arrays)."""
    s = np.sort(x)
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if len(s) else s


def _rank(x: np.ndarray) -> np.ndarray:
    """Each value's rank among the distinct values (sorts as ``x`` does)."""
    return np.searchsorted(_distinct(x), x)


def _firsts(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys (sorted) and where each first occurs, as ``np.unique(keys, return_index=True)``,
    looking only at the starts of runs of equal keys."""
    head = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1]))) if len(keys) else keys
    u, first = np.unique(keys[head], return_index=True)
    return u, head[first]


def _slot_rank(g: Graph, stage: np.ndarray, sid: np.ndarray, slot_k: np.ndarray, slot_p: np.ndarray,
               src: np.ndarray, dst: np.ndarray, same_stage: np.ndarray) -> np.ndarray:
    """Per stage, one order of its compute and comm nodes: slot order where that already respects
    every data edge between them, else the slot-priority topological order (a directive may anchor
    a node at a slot before a producer it waits on: taken literally, the two streams' orders would
    wait on each other). ``same_stage``: per edge, whether it joins two nodes of one stage."""
    import heapq
    n = len(g)
    idx = np.flatnonzero(sid != _P2P)
    o = _sort(stage[idx], slot_k[idx], slot_p[idx], sid[idx])       # slots ranked (:func:`_rank`)
    nodes = idx[o]
    rank = np.full(n, -1, np.int64)
    rank[nodes] = np.arange(len(nodes))
    rs, rd = rank[src], rank[dst]
    ok = (rs >= 0) & (rd >= 0) & same_stage
    back = ok & (rs > rd)
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
    cols = _Columns(g)
    stage = cols.stage
    chunk = _chunks(c["chunk"])
    strategy = graph_placement(g, strategy, compute=cols.is_compute, stage=stage, chunk=chunk)
    if n and (stage.min() < 0 or stage.max() >= pp):
        raise ProgramError("every node needs a pipeline stage in [0, pp); apply Place first")
    missing = np.flatnonzero(~cols.has_slot & ~cols.is_send & ~cols.is_recv).tolist()
    if missing:
        raise ProgramError(f"{len(missing)} nodes have no order (e.g. {g.node(missing[0])}); apply an Order "
                           f"covering stage {c['stage'][missing[0]]}")
    sid = _stream_index(cols)
    cross_stage = stage[cols.src] != stage[cols.dst]
    krank, prank = _rank(cols.slot_k), _rank(cols.slot_p)
    seq_order, bounds, index = _stream_positions(g, cols, sid, krank, prank, cross_stage, step_time)
    # ---- ids: per stage, in (slot, stream) order -------------------------------------------------
    id_order = _sort(stage, krank, prank, sid, index, unique=True)
    ids = np.zeros(n, np.int64)
    ids[id_order] = _within(id_order, stage)[0]
    dep_col = _dep_column(g, cols, sid, cross_stage, index, ids)
    built = _instructions(c, cols, index, ids, dep_col, chunk)
    per_stage: list[dict[str, tuple[Instr, ...]]] = [{} for _ in range(pp)]
    so, b = seq_order.tolist(), bounds.tolist()
    stage_l = stage[seq_order[bounds[:-1]]].tolist() if n else []
    for gi in range(len(b) - 1):        # each (stage, stream) group, taken in stream order
        idx = so[b[gi]:b[gi + 1]]
        group = itemgetter(*idx)(built) if len(idx) > 1 else (built[idx[0]],)
        per_stage[stage_l[gi]][group[0].stream] = group
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


def _stream_index(cols: _Columns) -> np.ndarray:
    """Per node, the index of its stream in :func:`stream_names` order; raises on a name that is not an
    identifier."""
    unknown = {s for s in cols.stream_code if not isinstance(s, str) or not s.isidentifier()}
    if unknown:
        raise ProgramError(f"stream names {sorted(map(str, unknown))} are not identifiers; name a Stream "
                           f"like 'grads' or 'zero_gather'")
    names = stream_names(list(cols.stream_code))
    lut = np.zeros(len(cols.stream_code), np.int64)
    for s, k in cols.stream_code.items():
        lut[k] = names.index(s)
    return lut[cols.stream]


def _stream_positions(g: Graph, cols: _Columns, sid: np.ndarray, krank: np.ndarray, prank: np.ndarray,
                      cross_stage: np.ndarray, step_time: "Callable[[Action], float] | None") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Order each (stage, stream): compute and collectives by slot priority, sends/recvs in pair order.
    Returns (nodes grouped by (stage, stream) in stream order, group bounds, each node's position)."""
    stage, src, dst = cols.stage, cols.src, cols.dst
    sends = pair_order(g, step_time, _cols=cols)
    key = _slot_rank(g, stage, sid, krank, prank, src, dst, ~cross_stage)      # compute/comm: slot-priority order
    p2p = sid == _P2P
    key[p2p] = -1
    ks = np.asarray(sends, np.int64)
    key[ks] = np.arange(len(ks))
    key[cols.recv[ks]] = np.arange(len(ks))
    if (key[p2p] < 0).any():
        i = int(np.flatnonzero(p2p & (key < 0))[0])
        raise ProgramError(f"{g.node(i)} is on the p2p stream but is not a send/recv pair; apply Place")
    seq_order = _sort(stage, sid, key)                   # grouped by (stage, stream), in stream order
    pos, bounds = _within(seq_order, stage, sid)
    index = np.zeros(len(g), np.int64)
    index[seq_order] = pos
    return seq_order, bounds, index


def _dep_column(g: Graph, cols: _Columns, sid: np.ndarray, cross_stage: np.ndarray, index: np.ndarray,
                ids: np.ndarray) -> list:
    """Per node, the ids it depends on: the latest producer on each other stream of its stage (its own
    stream's order implies the rest); raises on a cross-stage edge without send/recv or a backward edge."""
    src, dst = cols.src, cols.dst
    if cross_stage.any():
        bad = np.flatnonzero(cross_stage & ~(cols.is_send[src] & cols.is_recv[dst]))
        if len(bad):
            u, v = int(src[bad[0]]), int(dst[bad[0]])
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
    o = _sort(d3, sid[s3], -index[s3])
    s3, d3 = s3[o], d3[o]
    first = np.ones(len(o), bool)
    first[1:] = (d3[1:] != d3[:-1]) | (sid[s3][1:] != sid[s3][:-1])
    dv, du = d3[first], ids[s3[first]]
    o = _sort(dv, du, unique=True)
    dep_col: list = [()] * len(g)
    for v, u in zip(dv[o].tolist(), du[o].tolist()):
        lst = dep_col[v]
        dep_col[v] = (u,) if not lst else lst + (u,)
    return dep_col


def _instructions(c: Mapping[str, Any], cols: _Columns, index: np.ndarray, ids: np.ndarray, dep_col: list,
                  chunk: np.ndarray) -> list:
    """Every node's instruction, built from its fields' columns in node order (the order the graph's
    values lie in memory), with the activation buffers' alloc/free added."""
    alloc_c, free_c = _tuples(c["alloc"]), _tuples(c["free"])
    alloc_at, alloc_names, alloc_bytes, free_at, free_names = _act_buffers(c, index, cols)
    for i, name, nb in zip(alloc_at.tolist(), alloc_names, alloc_bytes):
        alloc_c[i] = ((name, nb),) + alloc_c[i]
    for i, name in zip(free_at.tolist(), free_names):
        free_c[i] = free_c[i] + (name,)
    comp, stage = cols.is_compute, cols.stage
    mb = _ints(c["mb"])
    return instrs_from_columns(
        _shared_ints(ids), c["op"], c["stream"], dep_col, c["phase"], _unless(stage, comp), _unless(chunk, chunk >= 0),
        _shared_ints(mb), _unless(c["region"], comp), _flops(c["flops"]), _nbytes(c["nbytes"]),
        c["peer"], c["group"], repeat(None), c["tag"], c["key"], alloc_c, free_c)


def _flops(col: list) -> list:
    """The FLOPs as Python floats."""
    return col if set(map(type, col)) == {float} else _floats(col).tolist()


def _nbytes(col: list) -> list:
    """The bytes as Python ints (truncated, as ``int()`` does)."""
    if set(map(type, col)) == {int}:
        return col
    nb = np.asarray(col)
    if nb.dtype.kind != "i":
        nb = np.fromiter(map(int, col), np.int64, len(col))
    return nb.astype(np.int64, copy=False).tolist()


def _unless(values: "np.ndarray | list", keep: np.ndarray) -> list:
    """``values[i]`` (a Python object) where ``keep[i]``, else None, as a list."""
    out = values.astype(object) if isinstance(values, np.ndarray) else np.fromiter(values, object, len(values))
    out[~keep] = None
    return out.tolist()


def _shared_ints(values: np.ndarray) -> list:
    """``values`` (integers) as a list of Python ints, negative ones as None; equal values share one int
    object (fewer objects to make, and to hold in the program)."""
    if not len(values):
        return []
    return np.array([*range(max(int(values.max()) + 1, 0)), None], object)[np.maximum(values, -1)].tolist()


def _tuples(col: list) -> list:
    """A copy of ``col`` with every entry a tuple."""
    return list(col) if set(map(type, col)) <= {tuple} else [tuple(x) for x in col]


def _act_buffers(c: dict, index: np.ndarray, cols: _Columns) -> tuple[np.ndarray, list, list, np.ndarray, list]:
    """Activation buffers: one per region of a chunk's micro-batch, ``act.c{chunk}.m{mb}.{region}``,
    allocated by the region's first forward instruction (in stream order) and freed by its last
    backward one, as a region keeps its stash from its forward to its (weight-gradient) backward;
    ``act.c{chunk}.m{mb}`` when the chunk runs that micro-batch's forward as one region (fused).
    Returns the allocating nodes, their buffers' names and bytes, the freeing nodes and their names."""
    aid, alist = cols.aid, cols.alist
    none = np.zeros(0, np.int64)
    nodes = np.flatnonzero(cols.is_compute & (aid >= 0))
    if not len(nodes):
        return none, [], [], none, []
    sel = nodes.tolist()
    m = len(sel)
    aid = aid[nodes]
    regs = _take(c["region"], sel)
    rc, codes = _codes(regs)      # in first-seen order
    names = list(codes)
    rc = rc.astype(np.int64)
    chunk = np.fromiter(map(itemgetter(0), alist), np.int64, len(alist))[aid]
    mb = np.fromiter(map(itemgetter(2), alist), np.int64, len(alist))[aid]
    fwd = np.fromiter((a[1] == "F" for a in alist), bool, len(alist))[aid]
    width, nreg = int(mb.max()) + 1, len(names)
    keys = (chunk * width + mb) * nreg + rc
    uk = _distinct(keys)
    inv = np.searchsorted(uk, keys)
    act_bytes = np.zeros(len(uk), np.int64)
    fi = np.flatnonzero(fwd)
    np.add.at(act_bytes, inv[fi], np.fromiter(_take(c["act"], nodes[fi].tolist()), np.int64, len(fi)))
    cm = uk // nreg
    # regions per (chunk, mb) that run a forward: one means the chunk's forward is fused
    has_fwd = np.zeros(len(uk), bool)
    has_fwd[inv[fi]] = True
    ucm, count = np.unique(cm[has_fwd], return_counts=True)
    at = np.minimum(np.searchsorted(ucm, cm), max(len(ucm) - 1, 0))
    multi = (ucm[at] == cm) & (count[at] > 1) if len(ucm) else np.zeros(len(cm), bool)
    # per key: the forward node first in stream order, the backward node last (ties: the first node)
    ix = index[nodes] * m
    first = np.full(len(uk), np.iinfo(np.int64).max)
    np.minimum.at(first, inv[fi], ix[fi] + fi)
    bi = np.flatnonzero(~fwd)
    last = np.full(len(uk), -1)
    np.maximum.at(last, inv[bi], ix[bi] + (m - 1 - bi))
    # one buffer per key with bytes: the region named where the chunk's forward has several
    named = np.flatnonzero(act_bytes != 0)
    regions = [names[r] if x else None for r, x in zip((uk % nreg)[named].tolist(), multi[named].tolist())]
    name = T.StepBuffer.act_names((cm[named] // width).tolist(), (cm[named] % width).tolist(), regions)
    a = first[named] < np.iinfo(np.int64).max
    f = last[named] >= 0
    alloc_at = nodes[first[named][a] % m]
    free_at = nodes[m - 1 - last[named][f] % m]
    return (alloc_at, list(compress(name, a.tolist())), act_bytes[named][a].tolist(), free_at,
            list(compress(name, f.tolist())))
