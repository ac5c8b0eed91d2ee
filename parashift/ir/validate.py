"""``Program.validate()``: ids, dependencies, matching, collectives and deadlock freedom.

Checks, in order, each raising :class:`~parashift.errors.ProgramError` (or
:class:`~parashift.errors.DeadlockError`) that names the ranks and instructions at fault:

1. per RankProgram: ids unique, every instruction on the stream it names, deps name existing
   instructions, known ops and phases, and stream order plus deps acyclic;
2. every send is matched by exactly one recv (same tag, equal bytes, resolved peers point at each
   other) and every recv by exactly one send;
3. every member of a collective's resolved group issues it with the same op, tag, bytes and group;
4. a replay of the per-stream orders completes every instruction (send/recv meet as a rendezvous;
   a collective completes when all members arrived); otherwise a wait-for cycle is reported.

Symmetry makes it cheap: ranks are partitioned into classes that share a RankProgram and whose
peers and group members fall into the same classes (partition refinement, vectorized with numpy);
matching is checked once per class and instruction over all its ranks at once, and the replay runs
one representative per class, which is exact because all ranks of a class evolve identically.
"""
from __future__ import annotations

from collections import deque
from typing import Mapping

import numpy as np

from ..errors import DeadlockError, ProgramError
from ..strategy import Strategy
from .instr import COMM_OPS, COMPUTE, PHASES, Instr, RankProgram

__all__ = ["validate_ranks"]


class _Resolver:
    """Vectorized resolution of symbolic peers and groups for many ranks."""

    def __init__(self, strategy: "Strategy | None", world: int) -> None:
        self.s = strategy
        self.world = world
        self._groups: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def peers(self, rank_arr: np.ndarray, peer: "int | str | None", who: str) -> np.ndarray:
        if isinstance(peer, (int, np.integer)):
            return np.full(len(rank_arr), int(peer), np.int64)
        if peer is None or self.s is None or not str(peer).startswith(("pp", "cp")):
            raise ProgramError(f"{who}: cannot resolve peer {peer!r}; use a rank or 'pp+k'/'cp-k' with a strategy")
        return np.asarray(self.s.peer(rank_arr, str(peer)), np.int64)

    def group_table(self, axis: str) -> tuple[np.ndarray, np.ndarray]:
        """(members [groups, size] sorted rows, row of each rank or -1)."""
        if axis not in self._groups:
            if self.s is None:
                raise ProgramError(f"group {axis!r} is symbolic but the program has no strategy")
            m = np.sort(np.asarray(self.s.groups(axis), np.int64), axis=1)
            row = np.full(self.world, -1, np.int64)
            row[m.ravel()] = np.repeat(np.arange(len(m)), m.shape[1])
            self._groups[axis] = (m, row)
        return self._groups[axis]

    def members(self, rank_arr: np.ndarray, group: "tuple | str | None", who: str) -> np.ndarray:
        """[len(rank_arr), size] sorted members of each rank's group."""
        if group is None:
            raise ProgramError(f"{who}: collective without a group")
        if isinstance(group, tuple):
            g = np.sort(np.asarray(group, np.int64))
            return np.broadcast_to(g, (len(rank_arr), len(g)))
        m, row = self.group_table(group)
        r = row[rank_arr]
        if (r < 0).any():
            bad = int(rank_arr[r < 0][0])
            raise ProgramError(f"{who}: rank {bad} belongs to no {group!r} group")
        return m[r]


def _check_rank_program(rp: RankProgram, ranks: list[int]) -> dict[int, tuple[str, int]]:
    """Structural checks of one RankProgram; returns id -> (stream, position)."""
    where: dict[int, tuple[str, int]] = {}
    who = f"rank {ranks[0]}" + (f" (and {len(ranks) - 1} ranks sharing its program)" if len(ranks) > 1 else "")
    for s, instrs in rp.streams.items():
        for k, ins in enumerate(instrs):
            if ins.id in where:
                raise ProgramError(f"{who}: instruction id {ins.id} appears twice ({where[ins.id][0]} and {s}); "
                                   f"ids must be unique per rank")
            where[ins.id] = (s, k)
            if ins.stream != s:
                raise ProgramError(f"{who}: instruction {ins} sits on stream {s!r} but names stream {ins.stream!r}")
            if ins.op != COMPUTE and ins.op not in COMM_OPS:
                raise ProgramError(f"{who}: unknown op in {ins}; use compute or one of {', '.join(COMM_OPS)}")
            if ins.op == COMPUTE and ins.phase not in PHASES:
                raise ProgramError(f"{who}: compute instruction {ins} has phase {ins.phase!r}; use one of "
                                   f"{', '.join(PHASES)}")
            if ins.is_p2p and ins.peer is None:
                raise ProgramError(f"{who}: {ins} has no peer")
            if ins.is_collective and ins.group is None:
                raise ProgramError(f"{who}: {ins} has no group")
            if (ins.is_p2p or ins.is_collective) and not ins.tag:
                raise ProgramError(f"{who}: {ins} has no tag; tags match sends with recvs and collective members")
    for s, instrs in rp.streams.items():
        for ins in instrs:
            for d in ins.deps:
                if d not in where:
                    raise ProgramError(f"{who}: instruction {ins} depends on id {d}, which does not exist on this rank")
    # acyclic: stream order + deps (Kahn)
    n = len(where)
    pos = {i: k for k, i in enumerate(where)}
    indeg = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for instrs in rp.streams.values():
        for a, b in zip(instrs, instrs[1:]):
            succ[pos[a.id]].append(pos[b.id])
            indeg[pos[b.id]] += 1
        for ins in instrs:
            for d in ins.deps:
                succ[pos[d]].append(pos[ins.id])
                indeg[pos[ins.id]] += 1
    q = deque(i for i in range(n) if indeg[i] == 0)
    seen = 0
    while q:
        u = q.popleft()
        seen += 1
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                q.append(v)
    if seen != n:
        ids = list(where)
        stuck = [ids[i] for i in range(n) if indeg[i] > 0][:6]
        raise ProgramError(f"{who}: dependencies form a cycle (with the stream order) among instructions "
                           f"{stuck}; remove the dep that points backwards")
    return where


def validate_ranks(ranks: Mapping[int, RankProgram], strategy: "Strategy | None") -> None:
    """Raise ProgramError / DeadlockError unless a Program of ``ranks`` (rank -> its RankProgram), whose
    symbolic peers and groups ``strategy`` resolves, satisfies every invariant."""
    world = len(ranks)
    if sorted(ranks) != list(range(world)):
        raise ProgramError(f"ranks must be 0..{world - 1}; got {sorted(ranks)[:8]}...")
    res = _Resolver(strategy, world)
    prog_ids, progs, cls, members = _program_classes(ranks)
    where = [_check_rank_program(rp, members[k]) for k, rp in enumerate(progs)]
    comm = [[i for s in rp.streams.values() for i in s if i.is_p2p or i.is_collective] for rp in progs]
    cls = _refine_classes(ranks, prog_ids, comm, cls, res)
    ncls = int(cls.max()) + 1
    rep = np.full(ncls, -1, np.int64)
    rep[cls[::-1]] = np.arange(world)[::-1]
    cprog = [prog_ids[id(ranks[int(rep[k])])] for k in range(ncls)]
    cranks = [np.flatnonzero(cls == k) for k in range(ncls)]
    partners = _Matcher(comm, cprog, cls, res).match(cranks)
    _replay(progs, cprog, cranks, cls, where, partners, res)


def _program_classes(ranks: Mapping[int, RankProgram]
                     ) -> tuple[dict[int, int], list[RankProgram], np.ndarray, dict[int, list[int]]]:
    """Group ranks by shared RankProgram object: (id(program) -> index, programs, rank -> index,
    index -> its ranks)."""
    world = len(ranks)
    prog_ids: dict[int, int] = {}
    progs: list[RankProgram] = []
    cls = np.empty(world, np.int64)
    members: dict[int, list[int]] = {}
    for r in range(world):
        rp = ranks[r]
        k = prog_ids.setdefault(id(rp), len(progs))
        if k == len(progs):
            progs.append(rp)
        cls[r] = k
        members.setdefault(k, []).append(r)
    return prog_ids, progs, cls, members


def _refine_classes(ranks: Mapping[int, RankProgram], prog_ids: dict[int, int], comm: list[list[Instr]],
                    cls: np.ndarray, res: _Resolver) -> np.ndarray:
    """Split rank classes until every class's peers and group members fall into uniform classes."""
    world = len(ranks)
    specs_of = [sorted({(i.is_p2p, i.peer if i.is_p2p else i.group) for i in comm[p]}, key=repr)
                for p in range(len(comm))]
    while True:
        order = np.argsort(cls, kind="stable")
        bounds = np.searchsorted(cls[order], np.arange(cls.max() + 2))
        new = np.empty(world, np.int64)
        nxt = 0
        for k in range(len(bounds) - 1):
            rk = order[bounds[k]:bounds[k + 1]]
            if not len(rk):
                continue
            specs = specs_of[prog_ids[id(ranks[int(rk[0])])]]
            if len(rk) == 1 or not specs:  # a single rank (or no comm) cannot split
                new[rk] = nxt
                nxt += 1
                continue
            sig = np.empty((len(rk), len(specs)), np.int64)
            for j, (is_p2p, spec) in enumerate(specs):
                if is_p2p:
                    sig[:, j] = cls[res.peers(rk, spec, f"rank {int(rk[0])}")]
                else:
                    mc = np.sort(cls[res.members(rk, spec, f"rank {int(rk[0])}")], axis=1)
                    sig[:, j] = np.unique(mc, axis=0, return_inverse=True)[1].ravel()
            _, sub = np.unique(sig, axis=0, return_inverse=True)
            sub = sub.ravel()
            new[rk] = nxt + sub
            nxt += int(sub.max()) + 1
        if nxt == int(cls.max()) + 1:
            return cls
        cls = new


class _Matcher:
    """Match every communication instruction of each rank class to its partners; caches resolutions
    shared between classes."""

    def __init__(self, comm: list[list[Instr]], cprog: list[int], cls: np.ndarray, res: _Resolver):
        self.cprog, self.cls, self.res = cprog, cls, res
        self.world = len(cls)
        self.index: list[dict[tuple[str, str], list[Instr]]] = []
        for lst in comm:
            d: dict[tuple[str, str], list[Instr]] = {}
            for i in lst:
                d.setdefault((i.op, i.tag), []).append(i)
            self.index.append(d)
        self.comm = comm
        self.peer_cache: dict[tuple, np.ndarray] = {}
        self.trip_ok: dict[tuple, bool] = {}
        self.mem_cache: dict[tuple, tuple] = {}
        self.group_ok: dict[tuple, bool] = {}

    def match(self, cranks: list[np.ndarray]) -> list[dict[int, list[tuple[int, int]]]]:
        """Per class: instruction id -> [(partner class, partner instruction id)]."""
        partners: list[dict[int, list[tuple[int, int]]]] = [dict() for _ in cranks]
        for k, rk in enumerate(cranks):
            for x in self.comm[self.cprog[k]]:
                if len(rk) == 1 and x.is_p2p and isinstance(x.peer, int):  # concrete peer: scalar fast path
                    partners[k][x.id] = self._p2p_concrete(x, int(rk[0]))
                elif x.is_p2p:
                    partners[k][x.id] = self._p2p(x, k, rk)
                else:
                    partners[k][x.id] = self._collective(x, k, rk)
        return partners

    def _p2p_concrete(self, x: Instr, r0: int) -> list[tuple[int, int]]:
        """The one matching send/recv of ``x`` issued by the single rank ``r0`` to a concrete peer."""
        q0, world, res = x.peer, self.world, self.res
        if not 0 <= q0 < world:
            raise ProgramError(f"rank {r0} instruction {x}: peer outside the world of {world} ranks")
        kb = int(self.cls[q0])
        other = "recv" if x.op == "send" else "send"
        hits = [y for y in self.index[self.cprog[kb]].get((other, x.tag), ())
                if (y.peer == r0 if isinstance(y.peer, int)
                    else int(res.peers(np.asarray([q0]), y.peer, str(y))[0]) == r0)]
        if len(hits) != 1 or hits[0].nbytes != x.nbytes:
            what = ("no matching" if not hits else f"{len(hits)} matching" if len(hits) > 1
                    else "a size-mismatched")
            raise ProgramError(f"rank {r0} instruction {x}: {what} {other} with tag {x.tag!r} on rank "
                               f"{q0} (its peer must resolve back to rank {r0} and sizes must be "
                               f"equal); every send needs exactly one recv")
        return [(kb, hits[0].id)]

    def _p2p(self, x: Instr, k: int, rk: np.ndarray) -> list[tuple[int, int]]:
        """The one matching send/recv of ``x`` on the ranks ``rk`` of class ``k`` (symbolic peer)."""
        r0, world, res = int(rk[0]), self.world, self.res
        ck = (k, x.peer)
        q = self.peer_cache.get(ck)
        if q is None:
            q = self.peer_cache[ck] = res.peers(rk, x.peer, f"rank {r0} instruction {x}")
            if (q < 0).any() or (q >= world).any():
                raise ProgramError(f"rank {r0} instruction {x}: peer outside the world of {world} ranks")
        kb = int(self.cls[q[0]])
        other = "recv" if x.op == "send" else "send"
        cands = self.index[self.cprog[kb]].get((other, x.tag), ())
        hits = []
        for y in cands:
            tk = (k, x.peer, kb, y.peer)
            if tk not in self.trip_ok:
                self.trip_ok[tk] = bool(np.array_equal(res.peers(q, y.peer, f"rank {int(q[0])} instruction {y}"), rk))
            if self.trip_ok[tk]:
                hits.append(y)
        if len(hits) != 1:
            what = "no matching" if not hits else f"{len(hits)} matching"
            raise ProgramError(f"rank {r0} instruction {x}: {what} {other} with tag {x.tag!r} on rank "
                               f"{int(q[0])} (its peer must resolve back to rank {r0}); every send needs "
                               f"exactly one recv")
        y = hits[0]
        if y.nbytes != x.nbytes:
            raise ProgramError(f"rank {r0} instruction {x}: {x.op} of {x.nbytes} bytes but rank {int(q[0])}'s "
                               f"{other} {y} has {y.nbytes} bytes; sizes must be equal")
        return [(kb, y.id)]

    def _collective(self, x: Instr, k: int, rk: np.ndarray) -> list[tuple[int, int]]:
        """The same collective of ``x`` in every member class of its group, on the ranks ``rk`` of class ``k``."""
        r0, res, cls = int(rk[0]), self.res, self.cls
        ck = (k, x.group)
        info = self.mem_cache.get(ck)
        if info is None:
            mem = res.members(rk, x.group, f"rank {r0} instruction {x}")
            inside = (mem == rk[:, None]).any(axis=1)
            if not inside.all():
                raise ProgramError(f"rank {int(rk[~inside][0])} instruction {x}: the rank is not a member "
                                   f"of its own group")
            per = []
            for kb in np.unique(cls[mem[0]]).tolist():
                sel = cls[mem] == kb
                per.append((kb, mem[sel], np.repeat(mem, sel.sum(axis=1), axis=0)))
            info = self.mem_cache[ck] = tuple(per)
        parts = []
        for kb, qs, rows in info:
            cands = self.index[self.cprog[kb]].get((x.op, x.tag), ())
            if len(cands) != 1:
                raise ProgramError(f"rank {r0} instruction {x}: member rank {int(qs[0])} issues {len(cands)} "
                                   f"{x.op} with tag {x.tag!r}; every member must issue it exactly once")
            y = cands[0]
            if y.nbytes != x.nbytes or y.root != x.root:
                raise ProgramError(f"rank {r0} instruction {x}: member rank {int(qs[0])} issues {y} with "
                                   f"different bytes/root")
            gk = (k, x.group, kb, y.group)
            if gk not in self.group_ok:
                my = res.members(qs, y.group, f"rank {int(qs[0])} instruction {y}")
                self.group_ok[gk] = my.shape == rows.shape and bool(np.array_equal(my, rows))
            if not self.group_ok[gk]:
                raise ProgramError(f"rank {r0} instruction {x}: member rank {int(qs[0])} resolves the group of "
                                   f"{y} to other ranks; all members must name the same group")
            parts.append((kb, y.id))
        return parts


def _replay(progs: list[RankProgram], cprog: list[int], cranks: list[np.ndarray],
            cls: np.ndarray, where: list[dict], partners: list[dict], res: _Resolver) -> None:
    """Replay one representative per class; raise DeadlockError with the wait-for cycle."""
    ncls = len(cprog)
    streams = [[list(s) for s in progs[cprog[k]].streams.values()] for k in range(ncls)]
    # per program: id -> (stream index, position); per class: streams as (id, deps, partners) tuples
    loc = []
    for rp in progs:
        d = {}
        for si, lst in enumerate(rp.streams.values()):
            for pos, x in enumerate(lst):
                d[x.id] = (si, pos)
        loc.append(d)
    flat = []
    for k in range(ncls):
        pk = partners[k]
        flat.append([[(x.id, x.deps, pk.get(x.id)) for x in lst] for lst in streams[k]])
    cloc = [loc[cprog[k]] for k in range(ncls)]
    ptr = [[0] * len(streams[k]) for k in range(ncls)]
    done: list[set] = [set() for _ in range(ncls)]
    arrived: list[set] = [set() for _ in range(ncls)]
    total = sum(len(s) for k in range(ncls) for s in streams[k])
    finished = 0
    work = deque(range(ncls))
    queued = [True] * ncls
    while work:
        k = work.popleft()
        queued[k] = False
        dk, ak, pk_, fk = done[k], arrived[k], ptr[k], flat[k]
        progress = True
        while progress:
            progress = False
            for si, lst in enumerate(fk):
                n = len(lst)
                i = pk_[si]
                while i < n:
                    xid, deps, part = lst[i]
                    if xid in ak:
                        break
                    if deps and not all(d in dk for d in deps):
                        break
                    if part is None:
                        dk.add(xid)
                        i += 1
                        finished += 1
                        progress = True
                        continue
                    ak.add(xid)
                    if all(y in arrived[kb] for kb, y in part):
                        members = [(k, xid)] + [m for m in part if m != (k, xid)]
                        for kb, y in members:
                            arrived[kb].discard(y)
                            done[kb].add(y)
                            sj, pos = cloc[kb][y]
                            ptr[kb][sj] = pos + 1
                            finished += 1
                            if kb != k and not queued[kb]:
                                work.append(kb)
                                queued[kb] = True
                        i = pk_[si]
                        progress = True
                    break
                pk_[si] = i
    if finished < total:
        _deadlock(progs, cprog, cls, where, partners, ptr, done, arrived, streams, res)


def _deadlock(progs, cprog, cls, where, partners, ptr, done, arrived, streams, res) -> None:
    """Follow wait-for edges from a blocked instruction on concrete ranks until one repeats."""
    ncls = len(cprog)
    start = None
    for k in range(ncls):
        for si, lst in enumerate(streams[k]):
            if ptr[k][si] < len(lst):
                start = (int(np.flatnonzero(cls == k)[0]), lst[ptr[k][si]].id)
                break
        if start:
            break
    assert start is not None

    def instr(r: int, i: int) -> Instr:
        p = progs[cprog[int(cls[r])]]
        s, pos = where[cprog[int(cls[r])]][i]
        return p.streams[s][pos]

    def nxt(r: int, i: int) -> tuple[int, int]:
        k = int(cls[r])
        x = instr(r, i)
        s, pos = where[cprog[k]][i]
        si = list(progs[cprog[k]].streams).index(s)
        if ptr[k][si] < pos:
            return r, streams[k][si][ptr[k][si]].id
        undone = [d for d in x.deps if d not in done[k]]
        if undone:
            return r, undone[0]
        if x.is_p2p:
            q = int(res.peers(np.asarray([r]), x.peer, "")[0])
            return q, partners[k][x.id][0][1]
        mem = res.members(np.asarray([r]), x.group, "")[0]
        for q in mem.tolist():
            kb = int(cls[q])
            for kc, y in partners[k][x.id]:
                if kc == kb and y not in arrived[kb]:
                    return q, y
        return r, i

    path: list[tuple[int, int]] = []
    seen: dict[tuple[int, int], int] = {}
    node = start
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = nxt(*node)
    cyc = path[seen[node]:] + [node]
    txt = " -> waits for -> ".join(f"rank {r} [{instr(r, i)}]" for r, i in cyc)
    ranks = sorted({r for r, _ in cyc})
    raise DeadlockError(f"deadlock among ranks {ranks}: {txt}; reorder these instructions so each pair "
                        f"meets (e.g. one side sends before it receives)")
