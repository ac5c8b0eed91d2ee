"""Lower an ordered distributed graph to a :class:`~parashift.ir.program.Program`.

Per pipeline stage (every rank of a stage shares one RankProgram: DP replicas and TP/EP peers differ
only by which shard they hold, which the strategy resolves), per logical stream, one total order:

- ``compute`` and ``comm``: nodes sorted by their Order slot (step position, position in the step);
- ``p2p``: one global order of matched send/recv pairs, taken from a dataflow replay of the stages'
  step orders with FLOP-proportional durations: a pair is ordered by the time its sender's step ends,
  so every rank meets its pairs in the same relative order and the rendezvous replay cannot deadlock.

Cross-stream dependencies become ``deps`` (per producing stream only the latest producer is kept;
the stream order implies the rest). Activation buffers ``act.c{chunk}.m{mb}`` are allocated by the
chunk's first forward instruction and freed by its last backward instruction.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import ProgramError
from ..strategy import Strategy
from .actions import Action
from .graph import Graph
from .placement import graph_placement, placement_meta
from .program import Instr, Program, RankProgram

__all__ = ["lower", "pair_order"]

STREAMS = ("compute", "comm", "p2p")


def stream_names(streams: Sequence[str]) -> tuple[str, ...]:
    """The built-in streams, then the user-named ones a ``Stream`` directive created (sorted)."""
    return STREAMS + tuple(sorted({str(s) for s in streams} - set(STREAMS)))


def pair_order(g: Graph, step_time: "Callable[[Action], float] | None" = None) -> list[int]:
    """Send nodes in the global order their pairs complete (see module docstring). ``step_time``
    (optional) gives each action's duration for the replay instead of its FLOPs, e.g. the durations
    a schedule was planned with, which also count the TP communication on the compute stream."""
    c = g.cols
    n = len(g)
    steps: dict[int, dict[int, float]] = {}          # stage -> step -> duration
    timed: set = set()                               # (stage, action) already counted
    for i in range(n):
        sl = c["slot"][i]
        if sl is None or not isinstance(c["action"][i], Action):
            continue
        st = c["stage"][i]
        d = steps.setdefault(st, {})
        if step_time is None:
            d[sl[0]] = d.get(sl[0], 0.0) + (c["flops"][i] if c["op"][i] == "compute" else 0.0)
        elif (st, c["action"][i]) not in timed:
            timed.add((st, c["action"][i]))
            d[sl[0]] = d.get(sl[0], 0.0) + float(step_time(c["action"][i]))
    scale = max((v for d in steps.values() for v in d.values()), default=1.0) or 1.0
    recv_of: dict[int, int] = {}
    for u, v in zip(g.src, g.dst):
        if c["op"][u] == "send" and c["op"][v] == "recv":
            recv_of[u] = v
    sends = [i for i in range(n) if c["op"][i] == "send" and c["stream"][i] == "p2p"]   # pipeline hand-offs
    recv_of = {u: v for u, v in recv_of.items() if c["stream"][u] == "p2p"}
    if len(recv_of) != len(sends):
        raise ProgramError("a send node has no recv node; apply Place to add send/recv pairs")
    needs: dict[tuple[int, int], list[int]] = {}     # (stage, step) -> sends whose recv it consumes
    out_of: dict[tuple[int, int], list[int]] = {}    # (stage, step) -> sends it produces
    for s in sends:
        r = recv_of[s]
        needs.setdefault((c["stage"][r], c["slot"][r][0]), []).append(s)
        out_of.setdefault((c["stage"][s], c["slot"][s][0]), []).append(s)
    order = {st: sorted(d) for st, d in steps.items()}
    ptr = dict.fromkeys(order, 0)
    free = dict.fromkeys(order, 0.0)
    t_send: dict[int, float] = {}
    progress = True
    while progress:
        progress = False
        for st, ks in order.items():
            while ptr[st] < len(ks):
                k = ks[ptr[st]]
                ins = needs.get((st, k), [])
                if any(s not in t_send for s in ins):
                    break
                start = max([free[st]] + [t_send[s] for s in ins])
                free[st] = start + steps[st][k] / scale + 1e-6
                for s in out_of.get((st, k), []):
                    t_send[s] = free[st]
                ptr[st] += 1
                progress = True
    stuck = [st for st, ks in order.items() if ptr[st] < len(ks)]
    if stuck:
        raise ProgramError(f"the step orders of stages {stuck} wait on each other (no stage can run its next "
                           f"step); fix the Order")
    return sorted(sends, key=lambda s: (t_send[s], c["stage"][s], c["slot"][s]))


def _slot_rank(g: Graph, stage: np.ndarray, streams: Sequence[str]) -> np.ndarray:
    """Per stage, one order of its compute and comm nodes: slot order where that already respects
    every data edge between them, else the slot-priority topological order (a directive may anchor
    a node at a slot before a producer it waits on: taken literally, the two streams' orders would
    wait on each other)."""
    import heapq
    c = g.cols
    n = len(g)
    nodes = [i for i in range(n) if streams[i] != "p2p"]
    names = stream_names(streams)
    nodes.sort(key=lambda i: (stage[i], c["slot"][i], names.index(streams[i]), i))
    rank = np.full(n, -1, np.int64)
    rank[nodes] = np.arange(len(nodes))
    src = np.asarray(g.src, np.int64)
    dst = np.asarray(g.dst, np.int64)
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
    heap = [(int(rank[i]), i) for i in nodes if indeg[i] == 0]
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


def lower(g: Graph, strategy: Strategy, *, static_memory: Sequence[Mapping[str, int]] = (),
          meta: Mapping[str, Any] | None = None, step_time: "Callable[[Action], float] | None" = None) -> Program:
    """One RankProgram per pipeline stage, shared by all ranks of that stage (``step_time``: see
    :func:`pair_order`)."""
    c = g.cols
    n = len(g)
    pp = strategy.pp
    strategy = graph_placement(g, strategy)       # a custom Place: the runtime follows the graph's placement
    stage = np.asarray(c["stage"], np.int64)
    if n and (stage.min() < 0 or stage.max() >= pp):
        raise ProgramError("every node needs a pipeline stage in [0, pp); apply Place first")
    missing = [i for i in range(n) if c["slot"][i] is None and c["op"][i] not in ("send", "recv")]
    if missing:
        raise ProgramError(f"{len(missing)} nodes have no order (e.g. {g.node(missing[0])}); apply an Order "
                           f"covering stage {c['stage'][missing[0]]}")
    # ---- per-stream positions -----------------------------------------------------------------
    streams = c["stream"]
    unknown = {s for s in streams if not isinstance(s, str) or not s.isidentifier()}
    if unknown:
        raise ProgramError(f"stream names {sorted(map(str, unknown))} are not identifiers; name a Stream "
                           f"like 'grads' or 'zero_gather'")
    names = stream_names(streams)
    sends = pair_order(g, step_time)
    recv_of = {u: v for u, v in zip(g.src, g.dst) if c["op"][u] == "send" and c["op"][v] == "recv"}
    p2p_rank = {}
    for k, s in enumerate(sends):
        p2p_rank[s] = (k, 0.0)
        p2p_rank[recv_of[s]] = (k, 0.0)
    per: dict[tuple[int, str], list[int]] = {}
    for i in range(n):
        per.setdefault((c["stage"][i], streams[i]), []).append(i)
    rank = _slot_rank(g, stage, streams)
    index = np.zeros(n, np.int64)
    seq: dict[tuple[int, str], list[int]] = {}
    for key, nodes in per.items():
        if key[1] == "p2p":
            nodes.sort(key=lambda i: p2p_rank[i])
        else:
            nodes.sort(key=lambda i: rank[i])
        index[nodes] = np.arange(len(nodes))
        seq[key] = nodes
    # ---- ids: per stage, in (slot, stream) order -------------------------------------------------
    ids = np.zeros(n, np.int64)
    for st in range(pp):
        nodes = [i for s in names for i in seq.get((st, s), [])]
        keyed = sorted(nodes, key=lambda i: (c["slot"][i] if c["slot"][i] is not None else (0, 0.0),
                                              names.index(streams[i]), index[i]))
        ids[keyed] = np.arange(len(keyed))
    # ---- deps ------------------------------------------------------------------------------------
    src = np.asarray(g.src, np.int64)
    dst = np.asarray(g.dst, np.int64)
    sid = np.fromiter((names.index(s) for s in streams), np.int64, n)
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
    deps: dict[int, dict[int, int]] = {}
    for u, v in zip(s3.tolist(), d3.tolist()):
        dv = deps.setdefault(v, {})
        su = sid[u]
        if su not in dv or index[u] > index[dv[su]]:
            dv[su] = u
    # ---- activation buffers -------------------------------------------------------------------------
    act_first: dict[tuple[int, int], int] = {}
    act_bytes: dict[tuple[int, int], int] = {}
    act_last: dict[tuple[int, int], int] = {}
    for i in range(n):
        a = c["action"][i]
        if c["op"][i] != "compute" or not isinstance(a, Action):
            continue
        key = (a.chunk, a.mb)
        if a.type == "F":
            act_bytes[key] = act_bytes.get(key, 0) + int(c["act"][i])
            if key not in act_first or index[i] < index[act_first[key]]:
                act_first[key] = i
        elif key not in act_last or index[i] > index[act_last[key]]:
            act_last[key] = i
    alloc_extra = {i: (f"act.c{k[0]}.m{k[1]}", act_bytes[k]) for k, i in act_first.items() if act_bytes[k]}
    free_extra = {i: f"act.c{k[0]}.m{k[1]}" for k, i in act_last.items() if act_bytes.get(k)}
    # ---- instructions -------------------------------------------------------------------------------
    progs: list[RankProgram] = []
    for st in range(pp):
        out: dict[str, tuple[Instr, ...]] = {}
        for s in names:
            nodes = seq.get((st, s))
            if not nodes:
                continue
            lst = []
            for i in nodes:
                op = c["op"][i]
                dv = deps.get(i)
                alloc = c["alloc"][i]
                if i in alloc_extra:
                    alloc = (alloc_extra[i],) + tuple(alloc)
                free = c["free"][i]
                if i in free_extra:
                    free = tuple(free) + (free_extra[i],)
                mb = c["mb"][i]
                ch = c["chunk"][i]
                lst.append(Instr.make(
                    id=int(ids[i]), op=op, stream=s,
                    deps=tuple(sorted(int(ids[u]) for u in dv.values())) if dv else (),
                    phase=c["phase"][i], stage=st if op == "compute" else None,
                    chunk=ch if ch >= 0 else None, microbatch=mb if mb >= 0 else None,
                    region=c["region"][i] if op == "compute" else None, flops=float(c["flops"][i]),
                    nbytes=int(c["nbytes"][i]), peer=c["peer"][i], group=c["group"][i], root=None,
                    tag=c["tag"][i], key=c["key"][i], alloc=tuple(alloc), free=tuple(free)))
            out[s] = tuple(lst)
        mem = dict(static_memory[st]) if st < len(static_memory) else {}
        progs.append(RankProgram(out, mem))
    ranks_stage = np.arange(strategy.world) // (strategy.world // strategy.pp)
    ranks = {int(r): progs[int(st)] for r, st in enumerate(ranks_stage)}
    meta = dict(meta or {})
    if placement_meta(strategy):
        meta["placement"] = placement_meta(strategy)
    return Program(ranks, strategy, meta)
